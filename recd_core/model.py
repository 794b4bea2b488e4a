"""A DLRM with a user-history sequence module, dedup-aware (RecD).

    dense floats ──────────────── bottom MLP ──┐
    each id / id-list feature ─── EmbeddingBag ─┤
    the history sequence ──────── HistoryEncoder┤── pairwise dots ── top MLP ── logit
                                                 (+ the bottom MLP output)

A `Batch` carries per-sample features in a KeyedJaggedTensor and each deduplicated feature
group in an InverseKeyedJaggedTensor. Modules that see only a group's features (embedding
bags, the history encoder) run on the group's unique rows; their outputs are expanded with
`index_select(0, inverse_indices)`. Autograd sums the gradients of duplicates, so a dedup
step and a baseline step on the same batch give the same loss and gradients.
Embedding tables take sparse gradients (`sparse=True`): a dense gradient of a large table
costs more than dedup saves (DESIGN.md section 9).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from recd_core.config import FeatureSet, FeatureSpec, ModelConfig
from recd_core.sparse import InverseKeyedJaggedTensor, JaggedError, JaggedTensor, KeyedJaggedTensor


@dataclass
class Batch:
    """One training batch. `kjt`: per-sample id features; `groups`: deduplicated ones."""

    dense: torch.Tensor  # [B, D] float32
    kjt: KeyedJaggedTensor | None
    labels: torch.Tensor  # [B] float32
    groups: dict[str, InverseKeyedJaggedTensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.labels.numel()

    def to(self, device, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.kjt.to(device, non_blocking) if self.kjt is not None else None,
            self.labels.to(device, non_blocking=non_blocking),
            {g: ik.to(device, non_blocking) for g, ik in self.groups.items()},
        )

    def pin_memory(self) -> Batch:
        return Batch(
            self.dense.pin_memory(),
            self.kjt.pin_memory() if self.kjt is not None else None,
            self.labels.pin_memory(),
            {g: ik.pin_memory() for g, ik in self.groups.items()},
        )


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def padded(jt: JaggedTensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged rows -> ([N, L] ids, [N, L] valid mask), L = min(longest row, max_len).
    Rows longer than max_len keep their last (most recent) max_len ids."""
    lengths = jt.lengths.clamp(max=max_len)
    n = lengths.numel()
    width = max(int(lengths.max()) if n else 0, 1)
    pos = torch.arange(width, device=lengths.device)
    mask = pos.unsqueeze(0) < lengths.unsqueeze(1)
    start = jt.offsets[1:] - lengths  # the last `lengths` values of each row
    idx = (start.unsqueeze(1) + pos.unsqueeze(0)).clamp(max=max(jt.values.numel() - 1, 0))
    ids = jt.values[idx] if jt.values.numel() else torch.zeros_like(idx)
    return torch.where(mask, ids, torch.zeros_like(ids)), mask


class HistoryEncoder(nn.Module):
    """User history -> one vector: id embeddings + positions, `layers` transformer encoder
    layers, then attention pooling with a learned query. A learned null token is always
    attended to, so an empty history is well defined."""

    def __init__(self, spec: FeatureSpec, cfg: ModelConfig):
        super().__init__()
        d = cfg.embedding_dim
        self.max_len = spec.max_length or 128
        self.embedding = nn.Embedding(spec.table_size or 1, d, sparse=True)
        self.position = nn.Parameter(torch.randn(self.max_len + 1, d) * 0.02)
        self.null = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.query = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, cfg.history_heads, cfg.history_ff, dropout=0.0, batch_first=True
            )
            for _ in range(cfg.history_layers)
        )
        self.pool = nn.MultiheadAttention(d, cfg.history_heads, dropout=0.0, batch_first=True)

    def forward(self, jt: JaggedTensor) -> torch.Tensor:
        ids, mask = padded(jt, self.max_len)
        n, width = ids.shape
        x = self.embedding(ids) + self.position[1 : width + 1]
        x = torch.cat([self.null.expand(n, 1, -1) + self.position[:1], x], dim=1)
        valid = torch.cat([torch.ones(n, 1, dtype=torch.bool, device=ids.device), mask], dim=1)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=~valid)
        out, _ = self.pool(
            self.query.expand(n, 1, -1), x, x, key_padding_mask=~valid, need_weights=False
        )
        return out.squeeze(1)


class DLRM(nn.Module):
    def __init__(self, features: FeatureSet, cfg: ModelConfig):
        super().__init__()
        self.features, self.cfg = features, cfg
        d = cfg.embedding_dim
        torch.manual_seed(cfg.seed)
        self.dense_names = [f.name for f in features.features if f.kind == "dense"]
        self.dense_dim = sum(f.dim for f in features.features if f.kind == "dense")
        self.sparse_names = [f.name for f in features.features if f.kind in ("sparse", "id_list")]
        self.sequence_names = [f.name for f in features.features if f.kind == "sequence"]
        self.table_sizes = {f.name: f.table_size for f in features.features if f.kind != "dense"}
        self.bottom = mlp([max(self.dense_dim, 1), *cfg.bottom_mlp, d])
        self.bags = nn.ModuleDict(
            {
                n: nn.EmbeddingBag(features[n].table_size, d, mode=cfg.pooling, sparse=True)
                for n in self.sparse_names
            }
        )
        for bag in self.bags.values():
            nn.init.uniform_(bag.weight, -0.05, 0.05)
        self.history = nn.ModuleDict(
            {n: HistoryEncoder(features[n], cfg) for n in self.sequence_names}
        )
        n_vec = 1 + len(self.sparse_names) + len(self.sequence_names)
        self.order = [*self.sparse_names, *self.sequence_names]
        self.register_buffer("_tri", torch.triu_indices(n_vec, n_vec, offset=1), persistent=False)
        self.top = nn.Sequential(
            mlp([d + n_vec * (n_vec - 1) // 2, *cfg.top_mlp]), nn.Linear(cfg.top_mlp[-1], 1)
        )

    def init_output_bias(self, click_rate: float) -> None:
        """Start at the base click rate instead of 50%: the first steps learn structure, not
        the prior (the usual bias initialization for an imbalanced label)."""
        p = min(max(click_rate, 1e-4), 1 - 1e-4)
        with torch.no_grad():
            self.top[-1].bias.fill_(float(np.log(p / (1 - p))))

    def sparse_parameters(self) -> list[nn.Parameter]:
        return [b.weight for b in self.bags.values()] + [
            h.embedding.weight for h in self.history.values()
        ]

    def dense_parameters(self) -> list[nn.Parameter]:
        sparse = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    def _check_ids(self, name: str, jt: JaggedTensor) -> None:
        if jt.values.numel():
            lo, hi = int(jt.values.min()), int(jt.values.max())
            size = self.table_sizes[name]
            if lo < 0 or hi >= size:
                raise JaggedError(
                    f"feature {name!r}: ids must be in [0, {size}) (its table size), got [{lo}, {hi}]"
                )

    def _embed(self, name: str, jt: JaggedTensor) -> torch.Tensor:
        self._check_ids(name, jt)
        if name in self.history:
            return self.history[name](jt)
        return self.bags[name](jt.values, jt.offsets[:-1])

    def embed_features(self, batch: Batch) -> dict[str, torch.Tensor]:
        """[B, d] per id feature: per sample from `kjt`, unique-then-expand from `groups`."""
        out: dict[str, torch.Tensor] = {}
        if batch.kjt is not None:
            for name, jt in batch.kjt.to_dict().items():
                out[name] = self._embed(name, jt)
        for ik in batch.groups.values():
            inverse = ik.inverse_indices
            for name, jt in ik.unique.to_dict().items():
                out[name] = self._embed(name, jt).index_select(0, inverse)
        missing = [n for n in self.order if n not in out]
        if missing:
            raise JaggedError(f"batch lacks features {missing}")
        return out

    def forward(self, batch: Batch) -> torch.Tensor:
        if batch.dense.shape[1] != self.dense_dim:
            raise JaggedError(
                f"dense input has {batch.dense.shape[1]} columns, the model expects {self.dense_dim}"
            )
        x = self.bottom(batch.dense if self.dense_dim else batch.dense.new_zeros(batch.size, 1))
        emb = self.embed_features(batch)
        vecs = torch.stack([x, *(emb[n] for n in self.order)], dim=1)  # [B, n_vec, d]
        dots = torch.bmm(vecs, vecs.transpose(1, 2))[:, self._tri[0], self._tri[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)
