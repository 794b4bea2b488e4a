"""A DLRM with a user-history sequence module, dedup-aware (RecD).

    a learned constant ─────────────────────────────┐
    user-side dense floats ─── user bottom MLP ─────┤
    item-side dense floats ─── item bottom MLP ─────┤
    each id / id-list feature ─ EmbeddingBag ───────┤── pairwise dots ─┬ top MLP ─┐
    the history sequence ────── HistoryEncoder ─────┤  (+ the bottom    └ weighted ─┴ + ─ raw logit
      └ its tokens, attended by the sample's item ──┘   MLP outputs,      sum (FM)        │
                    all of them side by side ── cross layers ─ (`cross_layers`) ┘         │
                                    logit = slope * raw logit + offset (the calibration) ─┘

Why this shape: the dot interaction only sees what arrives as separate vectors. Dense
features get one bottom MLP per side (user, item, context), so a user-side dense vector
meets an item-side one in a dot product (a learned bilinear affinity) instead of being
mixed before the interaction; the bottom MLPs end linear, so those vectors can point
anywhere (a ReLU'd vector is non-negative and a dot of two cannot be negative). The
constant vector dotted with each embedding is a learned first-order term per id (a user's
or an item's own click propensity), as in a factorization machine. Id lists are mean-pooled
by default, so a list's vector does not grow with its length. Features that name the same
`table` in the feature set share it (a user's followed creators and the item's creator; the
clicked items of the history and the shown item): their dot product then compares ids of
one space, learned from both uses. The shown item attends over the encoded history (target
attention, as in DIN): the history's encoder runs once per unique user row, only the
attention runs per sample. The dots also reach the logit through one learned weight each
(a factorization machine's second-order term, zero at first): through the top MLP alone a
pair's signal arrives as one of hundreds of inputs, and on one day's data the tables learned
the pairs that matter (the user's topics against the item's) more slowly. With `cross_layers`,
the vectors side by side also pass DCN-v2's cross layers (x_{l+1} = x_0 * (W x_l + b) +
x_l) into the top MLP: products of single coordinates of any two vectors, which a dot of
whole vectors sums away (MovieLens: docs/quality.md). The calibration is a
buffer, the identity while training; training fits it on the validation slice at the end
(modeling/calibration.py), so a served or evaluated model's scores are calibrated.

A `Batch` (dpp/batch_store.py) carries per-sample features in a KeyedJaggedTensor and each deduplicated feature
group in an InverseKeyedJaggedTensor. Modules that see only a group's features (embedding
bags, the history encoder) run on the group's unique rows; their outputs are expanded with
`index_select(0, inverse_indices)`, but for the history's tokens, which stay per unique row:
each sample's item comes to them as a query (`target_attention`); the largest group's
vectors stay per unique row into the interaction too, their dots with each other and those
dots' share of the top MLP computed once a row (modeling/interaction.py). Autograd sums the
gradients of duplicates, so a dedup step and a baseline step on the same batch give the same
loss and gradients.
Embedding tables take sparse gradients (`sparse=True`): a dense gradient of a large table
costs more than dedup saves.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from recd_core.config import FeatureSet, FeatureSpec, ModelConfig
from recd_core.dedup.sparse import JaggedError, JaggedTensor
from recd_core.dpp.batch_store import Batch
from recd_core.modeling.interaction import Split, full_dots, split_logit, upper_pairs


def mlp(sizes: list[int], last_relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*(layers if last_relu else layers[:-1]))


def padded(jt: JaggedTensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Jagged rows -> ([N, L] ids, [N, L] valid mask, [N, L] positions in `jt.values`),
    L = min(longest row, max_len). Rows longer than max_len keep their last (most recent)
    max_len ids; a padding slot holds id 0 and a valid position (masked by `mask`)."""
    lengths = jt.lengths.clamp(max=max_len)
    n = lengths.numel()
    width = max(int(lengths.max()) if n else 0, 1)
    pos = torch.arange(width, device=lengths.device)
    mask = pos.unsqueeze(0) < lengths.unsqueeze(1)
    start = jt.offsets[1:] - lengths  # the last `lengths` values of each row
    idx = (start.unsqueeze(1) + pos.unsqueeze(0)).clamp(max=max(jt.values.numel() - 1, 0))
    ids = jt.values[idx] if jt.values.numel() else torch.zeros_like(idx)
    return torch.where(mask, ids, torch.zeros_like(ids)), mask, idx


def pooled(values: torch.Tensor, jt: JaggedTensor, mode: str) -> torch.Tensor:
    """[rows, d]: each row's ids' vectors (`values`, [nnz, d]) summed or averaged (an empty
    row: zeros), as nn.EmbeddingBag pools them."""
    n = jt.lengths.numel()
    row = torch.repeat_interleave(torch.arange(n, device=values.device), jt.lengths)
    out = values.new_zeros(n, values.shape[1]).index_add(0, row, values)
    if mode == "mean":
        out = out / jt.lengths.clamp(min=1).unsqueeze(1).to(values.dtype)
    return out


class HistoryEncoder(nn.Module):
    """User history -> one vector: id embeddings + positions, `layers` transformer encoder
    layers, then attention pooling with a learned query. A learned null token is always
    attended to, so an empty history is well defined. The encoded tokens are returned too,
    for the candidate item to attend over (target attention, see DLRM).

    `shared`: the ids look up a table the DLRM passes in (`forward(jt, table)`), e.g. the
    item table when the history lists item ids: one vector per item, trained by both uses."""

    def __init__(self, spec: FeatureSpec, cfg: ModelConfig, shared: bool = False):
        super().__init__()
        d = cfg.embedding_dim
        self.max_len = spec.max_length or 128
        self.embedding = None if shared else nn.Embedding(spec.table_size or 1, d, sparse=True)
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

    def forward(
        self,
        jt: JaggedTensor,
        table: torch.Tensor | None = None,
        vectors: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (pooled [N, d], tokens [N, 1 + L, d], valid [N, 1 + L]); token 0 is the null.
        `vectors`: the ids' vectors already looked up ([nnz, d], a sharded table's)."""
        ids, mask, idx = padded(jt, self.max_len)
        n, width = ids.shape
        if vectors is not None:
            emb = (
                vectors[idx] if vectors.shape[0] else vectors.new_zeros(n, width, vectors.shape[1])
            )
        elif table is None:
            emb = self.embedding(ids)
        else:
            emb = F.embedding(ids, table, sparse=True)
        x = emb + self.position[1 : width + 1]
        x = torch.cat([self.null.expand(n, 1, -1) + self.position[:1], x], dim=1)
        valid = torch.cat([torch.ones(n, 1, dtype=torch.bool, device=ids.device), mask], dim=1)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=~valid)
        out, _ = self.pool(
            self.query.expand(n, 1, -1), x, x, key_padding_mask=~valid, need_weights=False
        )
        return out.squeeze(1), x, valid


def target_attention(
    tokens: torch.Tensor,
    valid: torch.Tensor,
    query: torch.Tensor,
    inverse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sample's candidate (query [B, d]) attends over its user's history tokens: the
    history summarized by what is relevant to this item (DIN's idea). -> [B, d].

    `inverse` None: tokens [B, T, d], a sample's own. `inverse` [B]: tokens [U, T, d] of
    the unique user rows, sample b's row `inverse[b]`: the tokens (the keys and values) stay
    once per unique row and the row's samples' queries come to them, side by side:

        queries [U, K, d]   (K: the most samples of one row; a row's queries in its slots)
        scores  [U, T, K] = tokens @ queries^T    softmax over T, per query
        out     [U, K, d] = scores^T @ tokens  -> sample b: out[inverse[b], its slot]

    The same numbers as expanding the tokens to [B, T, d], without the copy, which costs the
    more the more samples a row has (one user's candidates most; docs/journal.md)."""
    scale = tokens.shape[-1] ** 0.5
    if inverse is None:
        scores = torch.bmm(tokens, query.unsqueeze(2)).squeeze(2) / scale
        weights = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=1)
        return torch.bmm(weights.unsqueeze(1), tokens).squeeze(1)
    rows = tokens.shape[0]
    counts = torch.bincount(inverse, minlength=rows)
    order = torch.argsort(inverse, stable=True)
    slot = torch.empty_like(inverse)
    slot[order] = (
        torch.arange(inverse.numel(), device=inverse.device)
        - (torch.cumsum(counts, 0) - counts)[inverse[order]]
    )
    width = int(counts.max()) if inverse.numel() else 1
    queries = query.new_zeros(rows, width, query.shape[1]).index_put((inverse, slot), query)
    scores = torch.bmm(tokens, queries.transpose(1, 2)) / scale  # [U, T, K]
    weights = torch.softmax(scores.masked_fill(~valid.unsqueeze(2), float("-inf")), dim=1)
    return torch.bmm(weights.transpose(1, 2), tokens)[inverse, slot]


class CrossLayer(nn.Module):
    """DCN-v2's cross layer: x0 * (W x + b) + x, W full rank or U V^T of `rank`."""

    def __init__(self, width: int, rank: int | None):
        super().__init__()
        if rank is None:
            self.w = nn.Linear(width, width)
        else:
            self.w = nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width))
        last = self.w if rank is None else self.w[1]
        nn.init.zeros_(last.weight)  # the identity at first: the vectors pass as they are
        nn.init.zeros_(last.bias)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.w(x) + x


class Calibrated(nn.Module):
    """What every model here ends in: logit = slope * raw logit + offset, the calibration a
    buffer, the identity while training (training fits it on the validation slice after,
    modeling/calibration.py). A subclass gives `member_logits`, the raw logits training
    fits ([K, B]: one row per model trained on its own loss), and `raw_logit`."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calibration", torch.tensor([1.0, 0.0]))

    def set_calibration(self, slope: float, offset: float) -> None:
        self.calibration.copy_(torch.tensor([slope, offset]))

    def reset_calibration(self) -> None:
        self.set_calibration(1.0, 0.0)

    def forward(self, batch: Batch, per_member: bool = False) -> torch.Tensor:
        """The calibrated logit of each sample, [B] (the raw one while the calibration is
        the identity, as in training); `per_member`: `member_logits`, [K, B]."""
        if per_member:
            return self.member_logits(batch)
        return self.raw_logit(batch) * self.calibration[0] + self.calibration[1]

    def member_logits(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def raw_logit(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


class DLRM(Calibrated):
    """`tables=False`: no tables of its own; a subclass looks the ids' vectors up
    (`lookup`) and the model pools them itself (sharded/model.py's `ShardedDLRM`: TorchRec's
    sharded tables)."""

    def __init__(self, features: FeatureSet, cfg: ModelConfig, tables: bool = True):
        super().__init__()
        self.features, self.cfg = features, cfg
        d = cfg.embedding_dim
        torch.manual_seed(cfg.seed)
        dense = [f for f in features.features if f.kind == "dense"]
        self.dense_names = [f.name for f in dense]
        self.dense_dim = sum(f.dim for f in dense)
        # the columns of `Batch.dense` each side's bottom MLP reads (features in order)
        self.dense_columns: dict[str, list[int]] = {}
        col = 0
        for f in dense:
            self.dense_columns.setdefault(f.side, []).extend(range(col, col + f.dim))
            col += f.dim
        for side, cols in self.dense_columns.items():
            self.register_buffer(f"_cols_{side}", torch.tensor(cols), persistent=False)
        self.sparse_names = [f.name for f in features.features if f.kind in ("sparse", "id_list")]
        self.sequence_names = [f.name for f in features.features if f.kind == "sequence"]
        self.table_sizes = {f.name: f.table_size for f in features.features if f.kind != "dense"}
        self.constant = nn.Parameter(torch.randn(d) * 0.05)
        self.bottoms = nn.ModuleDict(
            {
                side: mlp([len(cols), *cfg.bottom_mlp, d], last_relu=False)
                for side, cols in self.dense_columns.items()
            }
        )
        # one embedding bag per table; features naming the same `table` share it (module
        # keys are prefixed: a table named like a ModuleDict method, e.g. `items`, is fine)
        self.table_of = {n: f"t_{features.table_of(n)}" for n in self.sparse_names}
        self.bag_tables = list(dict.fromkeys(self.table_of.values()))
        self.bags = nn.ModuleDict()
        for n in self.sparse_names if tables else []:
            if self.table_of[n] not in self.bags:
                bag = nn.EmbeddingBag(features[n].table_size, d, mode=cfg.pooling, sparse=True)
                nn.init.uniform_(bag.weight, -0.05, 0.05)
                self.bags[self.table_of[n]] = bag
        # a history whose `table` is a bag's table (e.g. clicked items and the shown item)
        # looks its ids up there; otherwise it has a table of its own
        self.history_table = {
            n: f"t_{features.table_of(n)}"
            if f"t_{features.table_of(n)}" in self.bag_tables
            else None
            for n in self.sequence_names
        }
        self.history = nn.ModuleDict(
            {
                n: HistoryEncoder(features[n], cfg, not tables or self.history_table[n] is not None)
                for n in self.sequence_names
            }
        )
        self.targeted = self.sequence_names if cfg.target_attention else []
        n_dense = len(self.bottoms)
        self.order = [*self.sparse_names, *self.sequence_names]
        n_vec = 1 + n_dense + len(self.order) + len(self.targeted)
        flat_pairs = [i * n_vec + j for i, j in upper_pairs(n_vec)]
        self.register_buffer("_pairs", torch.tensor(flat_pairs), persistent=False)
        self._splits: dict = {}  # (group's features, device) -> interaction.Split
        self.cross = nn.ModuleList(
            CrossLayer(n_vec * d, cfg.cross_rank) for _ in range(cfg.cross_layers)
        )
        crossed = n_vec * d if cfg.cross_layers else 0
        self.top = nn.Sequential(
            mlp([n_dense * d + n_vec * (n_vec - 1) // 2 + crossed, *cfg.top_mlp]),
            nn.Linear(cfg.top_mlp[-1], 1),
        )
        # the dots also reach the logit directly, each with a learned weight (zero at
        # first): a factorization machine's second-order term beside the top MLP
        self.fm = None
        if cfg.fm:
            self.fm = nn.Linear(n_vec * (n_vec - 1) // 2, 1, bias=False)
            nn.init.zeros_(self.fm.weight)

    def init_output_bias(self, click_rate: float) -> None:
        """Start at the base click rate instead of 50%: the first steps learn structure, not
        the prior (the usual bias initialization for an imbalanced label)."""
        p = min(max(click_rate, 1e-4), 1 - 1e-4)
        with torch.no_grad():
            self.top[-1].bias.fill_(float(np.log(p / (1 - p))))

    def sparse_parameters(self) -> list[nn.Parameter]:
        return [b.weight for b in self.bags.values()] + [
            h.embedding.weight for h in self.history.values() if h.embedding is not None
        ]

    def table_for(self, name: str) -> torch.Tensor:
        """The embedding table an id feature looks its ids up in (shared tables included)."""
        if name in self.history and self.history_table[name] is None:
            return self.history[name].embedding.weight
        key = self.history_table[name] if name in self.history else self.table_of[name]
        return self.bags[key].weight

    def dense_parameters(self) -> list[nn.Parameter]:
        sparse = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    def lookup(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Each id feature's vectors, looked up elsewhere (feature -> [nnz, d]); {}: the
        model's own tables look them up."""
        return {}

    def _check_ids(self, features: list[tuple[str, JaggedTensor]]) -> None:
        """Every feature's ids within its table (an out-of-range id would read another
        table's memory on a GPU, or die in a device assert): the bounds of all features in
        one tensor, read back once per batch (one device sync, not two per feature)."""
        present = [(n, jt.values) for n, jt in features if jt.values.numel()]
        if not present:
            return
        bounds = torch.stack([torch.stack(torch.aminmax(v)) for _, v in present]).tolist()
        for (name, _), (lo, hi) in zip(present, bounds, strict=True):
            size = self.table_sizes[name]
            if lo < 0 or hi >= size:
                raise JaggedError(
                    f"feature {name!r}: ids must be in [0, {size}) (its table size), got [{lo}, {hi}]"
                )

    def _encode(self, name: str, jt: JaggedTensor, vectors: torch.Tensor | None = None):
        """One feature's rows -> ([rows, d], the history's tokens and mask for target
        attention, or None). The caller has checked the ids (`_check_ids`). `vectors`: the
        ids' vectors, looked up elsewhere (`lookup`)."""
        if name not in self.history:
            if vectors is not None:
                return pooled(vectors, jt, self.cfg.pooling), None
            return self.bags[self.table_of[name]](jt.values, jt.offsets[:-1]), None
        shared = self.history_table[name]
        if vectors is not None:
            pooled_, x, valid = self.history[name](jt, vectors=vectors)
        else:
            table = self.bags[shared].weight if shared else None
            pooled_, x, valid = self.history[name](jt, table)
        return pooled_, ((x, valid) if name in self.targeted else None)

    def embedded(
        self, batch: Batch
    ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
        """The id features' vectors: per sample ([B, d], from `kjt`, and each history
        attended by the sample's item, `<history>@item`), and each group's on its unique
        rows, `{group: (inverse [B], {feature: [U, d]})}` (the unique rows' results taken
        from `batch.shared` where an earlier batch of the same request left them)."""
        out: dict[str, torch.Tensor] = {}
        # a history's tokens and mask, per sample (inverse None) or per unique row
        tokens: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        per_sample = list(batch.kjt.to_dict().items()) if batch.kjt is not None else []
        unique = {g: ik.unique.to_dict() for g, ik in batch.groups.items()}
        done = batch.shared if batch.shared is not None else {}
        todo = [
            (n, jt) for jts in unique.values() for n, jt in jts.items() if (self, n) not in done
        ]
        self._check_ids(per_sample + todo)
        vectors = self.lookup(batch)  # always: a sharded lookup is a collective
        for name, jt in per_sample:
            out[name], seq = self._encode(name, jt, vectors.get(name))
            if seq is not None:
                tokens[name] = (*seq, None)
        grouped = {}
        for g, jts in unique.items():
            inverse, rows = batch.groups[g].inverse_indices, {}
            for name, jt in jts.items():
                if (self, name) not in done:
                    done[self, name] = self._encode(name, jt, vectors.get(name))
                rows[name], seq = done[self, name]
                if seq is not None:  # attended per unique row (`target_attention`)
                    tokens[name] = (*seq, inverse)
            grouped[g] = (inverse, rows)
        missing = [
            n for n in self.order if n not in out and not any(n in r for _, r in grouped.values())
        ]
        if missing:
            raise JaggedError(f"batch lacks features {missing}")
        item = self.features.item_key
        if tokens and item not in out:  # an item grouped (not so by default): per sample
            inverse, rows = next((i, r) for i, r in grouped.values() if item in r)
            out[item] = rows[item].index_select(0, inverse)
        for name, (x, valid, inverse) in tokens.items():
            out[f"{name}@item"] = target_attention(x, valid, out[item], inverse)
        return out, grouped

    def member_logits(self, batch: Batch) -> torch.Tensor:
        return self.raw_logit(batch).unsqueeze(0)  # [1, B]: one model, one loss

    def raw_logit(self, batch: Batch) -> torch.Tensor:
        if batch.dense.shape[1] != self.dense_dim:
            raise JaggedError(
                f"dense input has {batch.dense.shape[1]} columns, the model expects {self.dense_dim}"
            )
        sides = [
            bottom(batch.dense.index_select(1, getattr(self, f"_cols_{side}")))
            for side, bottom in self.bottoms.items()
        ]
        emb, grouped = self.embedded(batch)
        names = [*self.order, *(f"{n}@item" for n in self.targeted)]
        first = 1 + len(sides)  # the vectors: [constant | sides | names]
        # the group of most vectors has its part of the interaction once a unique row
        # (modeling/interaction.py); the cross layers read every sample's vectors whole
        once = (
            None
            if len(self.cross)
            else max(grouped, key=lambda g: len(grouped[g][1]), default=None)
        )
        inverse, rows = grouped.pop(once) if once is not None else (None, {})
        for inverse_, rows_ in grouped.values():
            emb |= {n: v.index_select(0, inverse_) for n, v in rows_.items() if n not in emb}
        if rows:
            unique = [0, *(first + k for k, n in enumerate(names) if n in rows)]
            key = (tuple(unique), self._pairs.device)
            if key not in self._splits:
                self._splits[key] = Split.of(first + len(names), unique, self._pairs.device)
            split = self._splits[key]
            vecs = [rows[names[k - first]] for k in unique[1:]]
            u = torch.stack([self.constant.expand(vecs[0].shape[0], -1), *vecs], dim=1)
            p = torch.stack(
                [sides[k - 1] if k < first else emb[names[k - first]] for k in split.per_sample],
                dim=1,
            )
            top = [*self.top[0], self.top[1]]
            return split_logit(u, p, inverse, sides, split, top, self.fm)
        const = self.constant.expand(batch.size, -1)
        vecs = torch.stack([const, *sides, *(emb[n] for n in names)], dim=1)  # [B, n, d]
        dots = full_dots(vecs, self._pairs)
        crossed = []
        if len(self.cross):
            x0 = x = vecs.flatten(1)
            for layer in self.cross:
                x = layer(x0, x)
            crossed = [x]
        logit = self.top(torch.cat([*sides, dots, *crossed], dim=1))
        if self.fm is not None:
            logit = logit + self.fm(dots)
        return logit.squeeze(1)


class Ensemble(Calibrated):
    """`ModelConfig.members` DLRMs of one shape, each from its own seed, scored by their
    mean logit:

        batch ─┬─ DLRM (seed s)     ─ raw logit ─┐
               ├─ DLRM (seed s + 1) ─ raw logit ─┼─ mean ─ slope * . + offset ─ logit
               └─ ...               ─ raw logit ─┘           (the calibration)

    Training fits each member on its own loss (the losses summed), not the mean logit on
    one loss: members sharing a loss learn to cover for each other, and the gain of an
    average is that independent errors partly cancel. The members see the same batches in
    the same order and differ by their initialization. The calibration is the ensemble's
    (the members' stay the identity). Saved like a DLRM: one state dict, `members.K.` in
    front of each member's keys."""

    def __init__(self, features: FeatureSet, cfg: ModelConfig):
        super().__init__()
        self.features, self.cfg = features, cfg
        self.members = nn.ModuleList(
            DLRM(features, cfg.model_copy(update={"seed": cfg.seed + k, "members": 1}))
            for k in range(cfg.members)
        )

    def init_output_bias(self, click_rate: float) -> None:
        for m in self.members:
            m.init_output_bias(click_rate)

    def sparse_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.members for p in m.sparse_parameters()]

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.members for p in m.dense_parameters()]

    def member_logits(self, batch: Batch) -> torch.Tensor:
        return torch.stack([m.raw_logit(batch) for m in self.members])  # [K, B]

    def raw_logit(self, batch: Batch) -> torch.Tensor:
        return self.member_logits(batch).mean(0)


Model = DLRM | Ensemble


def build_model(features: FeatureSet, cfg: ModelConfig) -> Model:
    """The model a config describes: one DLRM, or an `Ensemble` of `cfg.members`."""
    return DLRM(features, cfg) if cfg.members == 1 else Ensemble(features, cfg)


def members_of(model: Model) -> list[DLRM]:
    """The DLRMs a model is made of (itself, for a DLRM)."""
    return list(model.members) if isinstance(model, Ensemble) else [model]
