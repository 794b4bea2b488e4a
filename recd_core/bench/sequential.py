"""The sequential CTR models practitioners compare against, on the very samples ours trains
on (`recd bench`'s MovieLens part): DIN, DCN-v2 and a SIM-style model, in plain torch.

Every model reads the same inputs, one embedding table per feature `table` (the history,
the rating lists and the shown item share the item table, as in ours):

    id features ──── embedding ─────────────────────┐
    id lists ─────── embedding, mean ───────────────┤
    dense values ───────────────────────────────────┤── the model's own part ── logit
    the history ──── embedding per token ── [B, L, d]┘

  DIN (Zhou et al., KDD 2018)       the candidate item attends over the history: an MLP of
                                    [key, query, key - query, key * query] weighs each
                                    token (unnormalized, as the paper), the weighted sum
                                    beside every other feature into an MLP (200-80, PReLU)
  DCN-v2 (Wang et al., WWW 2021)    every feature's vector (the history mean-pooled) and the
                                    dense values concatenated: three full-rank cross layers
                                    x_{l+1} = x_0 * (W x_l + b) + x_l beside a deep MLP
                                    (256-128), both into the logit
  SIM (Pi et al., CIKM 2020)        a hard search (GSU) keeps the history's items that share
                                    a genre with the candidate, the most recent `SIM_TOP_K`;
                                    multi-head target attention (ESU) over them with their
                                    recency, beside DIN's attention over the most recent
                                    `SIM_RECENT` items, into the MLP

Each is tuned like the other references: fit on the earlier 90% of the training part (by
time, split like the test), the learning rate and the number of passes with the best NE on
the latest 10% (validated every half pass, stopped two checks after its best), then refit
on all of the training part for that many steps and scored on the test rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn
from torch.nn import functional as F

from recd_core import metrics
from recd_core.bench.references import _dense, time_split, tune
from recd_core.config import FeatureSet

SEQ_LR = (1e-3, 3e-3)
SIM_TOP_K, SIM_RECENT = 32, 16
GENRES = "item_genres"


@dataclass
class Inputs:
    """A table's features as tensors, ids shifted by one (row 0 of every table is padding):

    ids     {feature: [n] int64}           one id a sample
    lists   {feature: [n, L] int32}        an id list or the history, the most recent
                                           `max_length` ids left-aligned, 0 pads
    dense   [n, D] float32                 every dense feature's values, in order
    label   [n] float32
    """

    ids: dict[str, torch.Tensor]
    lists: dict[str, torch.Tensor]
    dense: torch.Tensor
    label: torch.Tensor

    def __len__(self) -> int:
        return self.label.numel()

    def to(self, device: str) -> Inputs:
        return Inputs(
            {k: v.to(device) for k, v in self.ids.items()},
            {k: v.to(device) for k, v in self.lists.items()},
            self.dense.to(device),
            self.label.to(device),
        )

    def take(self, rows: torch.Tensor) -> Inputs:
        return Inputs(
            {k: v[rows] for k, v in self.ids.items()},
            {k: v[rows].long() for k, v in self.lists.items()},
            self.dense[rows],
            self.label[rows],
        )


def _padded(col: pa.Array, size: int, width: int) -> np.ndarray:
    """A list column -> [n, width] int32: each row's last `width` ids (mod `size`) + 1,
    left-aligned, 0 after them."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lengths = np.asarray(pc.list_value_length(col).fill_null(0), np.int64)
    values = np.asarray(pc.list_flatten(col).fill_null(0), np.int64) % size + 1
    ends = np.cumsum(lengths)
    kept = np.minimum(lengths, width)
    out = np.zeros((lengths.size, width), np.int32)
    pos = np.arange(width)
    mask = pos[None, :] < kept[:, None]
    src = (ends - kept)[:, None] + pos[None, :]
    out[mask] = values[src[mask]]
    return out


def encode(table: pa.Table, features: FeatureSet) -> Inputs:
    ids, lists, dense = {}, {}, []
    n = table.num_rows
    for f in features.features:
        col = table[f.name].combine_chunks()
        if f.kind == "dense":
            dense.append(_dense(col, f, n).astype(np.float32))
        elif pa.types.is_list(col.type):
            lists[f.name] = torch.from_numpy(_padded(col, f.table_size or 1, f.max_length or 128))
        else:
            ids[f.name] = torch.from_numpy(
                np.asarray(col.fill_null(0), np.int64) % (f.table_size or 1) + 1
            )
    x = np.concatenate(dense, 1) if dense else np.zeros((n, 0), np.float32)
    label = torch.from_numpy(np.asarray(table["label"], np.float32))
    return Inputs(ids, lists, torch.from_numpy(x), label)


def genre_masks(tables: list[pa.Table], features: FeatureSet) -> torch.Tensor:
    """[item table rows + 1] int64: each item's genres as a bit mask (SIM's category search
    reads the history's genres from it); 0 for an unseen item and for padding."""
    item = features.item_key
    size = features[item].table_size or 1
    masks = np.zeros(size + 1, np.int64)
    for t in tables:
        items = np.asarray(t[item].fill_null(0), np.int64) % size + 1
        genres = t[GENRES].combine_chunks()
        lengths = np.asarray(pc.list_value_length(genres).fill_null(0), np.int64)
        bits = np.left_shift(1, np.asarray(pc.list_flatten(genres).fill_null(0), np.int64) % 62)
        per_row = np.zeros(items.size, np.int64)
        np.bitwise_or.at(per_row, np.repeat(np.arange(items.size), lengths), bits)
        masks[items] = per_row
    return torch.from_numpy(masks)


class Embedder(nn.Module):
    """One table per feature `table`; every feature as a vector ([B, d], lists mean-pooled),
    and the history's tokens."""

    def __init__(self, features: FeatureSet, d: int):
        super().__init__()
        self.features = features
        names = [f for f in features.features if f.kind != "dense"]
        self.tables = nn.ModuleDict()
        for f in names:
            key = f"t_{features.table_of(f.name)}"
            if key not in self.tables:
                self.tables[key] = nn.Embedding((f.table_size or 1) + 1, d, padding_idx=0)
                nn.init.normal_(self.tables[key].weight, std=0.05)
        self.key = {f.name: f"t_{features.table_of(f.name)}" for f in names}
        self.history = next(f.name for f in features.features if f.kind == "sequence")

    def lookup(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return self.tables[self.key[name]](ids)

    def vectors(self, x: Inputs, pool_history: bool) -> list[torch.Tensor]:
        out = [self.lookup(n, v) for n, v in x.ids.items()]
        for n, v in x.lists.items():
            if n == self.history and not pool_history:
                continue
            mask = (v > 0).unsqueeze(2).float()
            out.append((self.lookup(n, v) * mask).sum(1) / mask.sum(1).clamp(min=1))
        return out

    def candidate(self, x: Inputs) -> torch.Tensor:
        return self.lookup(self.features.item_key, x.ids[self.features.item_key])


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.PReLU()]
    return nn.Sequential(*layers)


class DINAttention(nn.Module):
    """DIN's activation unit: a weight per history token from [k, q, k - q, k * q]."""

    def __init__(self, d: int):
        super().__init__()
        self.unit = nn.Sequential(_mlp([4 * d, 36]), nn.Linear(36, 1))

    def forward(self, keys: torch.Tensor, mask: torch.Tensor, query: torch.Tensor):
        q = query.unsqueeze(1).expand_as(keys)
        w = self.unit(torch.cat([keys, q, keys - q, keys * q], 2)).squeeze(2)
        return (w.masked_fill(~mask, 0.0).unsqueeze(2) * keys).sum(1)


class _Model(nn.Module):
    def __init__(self, features: FeatureSet, d: int, dense_dim: int):
        super().__init__()
        self.embed = Embedder(features, d)
        self.d = d
        n_ids = sum(1 for f in features.features if f.kind in ("sparse", "id_list", "sequence"))
        self.width = n_ids * d + dense_dim  # every feature as one vector, dense values

    def history(self, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        ids = x.lists[self.embed.history]
        return self.embed.lookup(self.embed.history, ids), ids > 0


class DIN(_Model):
    def __init__(self, features: FeatureSet, d: int, dense_dim: int):
        super().__init__(features, d, dense_dim)
        self.attention = DINAttention(d)
        self.top = nn.Sequential(_mlp([self.width, 200, 80]), nn.Linear(80, 1))

    def forward(self, x: Inputs) -> torch.Tensor:
        keys, mask = self.history(x)
        attended = self.attention(keys, mask, self.embed.candidate(x))
        return self.top(torch.cat([*self.embed.vectors(x, False), attended, x.dense], 1))[:, 0]


class DCNv2(_Model):
    def __init__(self, features: FeatureSet, d: int, dense_dim: int, layers: int = 3):
        super().__init__(features, d, dense_dim)
        self.cross = nn.ModuleList(nn.Linear(self.width, self.width) for _ in range(layers))
        self.deep = _mlp([self.width, 256, 128])
        self.out = nn.Linear(self.width + 128, 1)

    def forward(self, x: Inputs) -> torch.Tensor:
        x0 = torch.cat([*self.embed.vectors(x, True), x.dense], 1)
        xl = x0
        for layer in self.cross:
            xl = x0 * layer(xl) + xl
        return self.out(torch.cat([xl, self.deep(x0)], 1))[:, 0]


class SIM(_Model):
    def __init__(self, features: FeatureSet, d: int, dense_dim: int, genres: torch.Tensor):
        super().__init__(features, d, dense_dim)
        self.register_buffer("genres", genres, persistent=False)
        self.recency = nn.Embedding(features[self.embed.history].max_length or 128, d)
        self.esu = nn.MultiheadAttention(d, 2, batch_first=True)
        self.short = DINAttention(d)
        self.top = nn.Sequential(_mlp([self.width + 2 * d, 200, 80]), nn.Linear(80, 1))

    def search(self, ids: torch.Tensor, candidate: torch.Tensor):
        """GSU: [B, L] history ids -> the positions of the most recent `SIM_TOP_K` sharing
        a genre with the candidate ([B, K]) and which of them are real ([B, K])."""
        hit = (self.genres[ids] & self.genres[candidate].unsqueeze(1)) != 0
        hit &= ids > 0
        order = torch.arange(ids.shape[1], device=ids.device)
        score = torch.where(hit, order, torch.full_like(order, -1).expand_as(ids))
        k = min(SIM_TOP_K, ids.shape[1])
        top, pos = score.topk(k, dim=1)
        return pos, top >= 0

    def forward(self, x: Inputs) -> torch.Tensor:
        ids = x.lists[self.embed.history]
        item = x.ids[self.embed.features.item_key]
        q = self.embed.candidate(x)
        keys, mask = self.history(x)
        pos, found = self.search(ids, item)
        lengths = mask.sum(1, keepdim=True)
        age = (lengths - 1 - pos).clamp(min=0)  # 0: the most recent
        kv = keys.gather(1, pos.unsqueeze(2).expand(-1, -1, self.d)) + self.recency(age)
        none = ~found.any(1, keepdim=True)  # attend to something: masked to zero after
        long, _ = self.esu(q.unsqueeze(1), kv, kv, key_padding_mask=~(found | none))
        long = long[:, 0] * (~none).float()
        recent = (lengths - SIM_RECENT).clamp(min=0)
        cols = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        short = self.short(keys, mask & (cols >= recent), q)
        features = [*self.embed.vectors(x, True), long, short, x.dense]
        return self.top(torch.cat(features, 1))[:, 0]


MODELS = {"din": DIN, "dcn_v2": DCNv2, "sim": SIM}
SEQUENTIAL = tuple(MODELS)


def _scores(model: nn.Module, x: Inputs, batch: int = 8192) -> np.ndarray:
    model.eval()
    device = x.label.device
    with torch.no_grad():
        out = [
            torch.sigmoid(model(x.take(torch.arange(a, min(a + batch, len(x)), device=device))))
            for a in range(0, len(x), batch)
        ]
    model.train()
    return torch.cat(out).double().cpu().numpy()


def _fit(
    model: nn.Module,
    x: Inputs,
    lr: float,
    steps: int,
    batch: int,
    seed: int,
    each=None,
    every: int = 0,
) -> nn.Module:
    """`steps` Adam steps over shuffled passes of `x`; `each(step)` every `every` steps
    (False stops)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    device = x.label.device
    step, at, order = 0, 0, torch.randperm(len(x), generator=gen).to(device)
    while step < steps:
        if at >= len(x):
            order, at = torch.randperm(len(x), generator=gen).to(device), 0
        b = x.take(order[at : at + batch])
        at += batch
        loss = F.binary_cross_entropy_with_logits(model(b), b.label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if each is not None and every and step % every == 0 and each(step) is False:
            break
    return model


def sequential_reference(
    name: str,
    train: pa.Table,
    test: pa.Table,
    features: FeatureSet,
    per_user: bool = True,
    d: int = 16,
    batch: int = 256,
    max_passes: int = 4,
    learning_rates: tuple[float, ...] = SEQ_LR,
    seed: int = 0,
    device: str = "auto",
) -> dict:
    """NE, log loss and AUC on `test` of `MODELS[name]` tuned on the latest 10% of
    `train` (the learning rate and the steps), then refit on all of `train`. `batch`: the
    bench passes ours' (its batch scales with the data); `device` "auto": CUDA where the
    machine has it, as ours trains (`train.device`)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    late = time_split(train, 0.9, per_user)
    fit_rows, val_rows = train.filter(pc.invert(late)), train.filter(late)
    x_fit, x_val = encode(fit_rows, features).to(device), encode(val_rows, features).to(device)
    y_val = x_val.label.double().cpu().numpy()
    dense_dim = x_fit.dense.shape[1]
    extra = (genre_masks([train, test], features),) if name == "sim" else ()

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return MODELS[name](features, d, dense_dim, *extra).to(device)

    every = max(1, math.ceil(len(x_fit) / batch / 2))  # validate every half pass

    def fit(lr: float, each) -> None:
        model = build()
        _fit(
            model,
            x_fit,
            lr,
            max_passes * 2 * every,
            batch,
            seed,
            lambda step: each(step, model),
            every,
        )

    def validate(model) -> float:
        return metrics.normalized_entropy(y_val, _scores(model, x_val))

    _, lr, steps = tune(learning_rates, fit, validate, 2 * every)
    x_train = encode(train, features).to(device)
    # as many passes over all of `train` as the best state had over its earlier 90%
    steps = round(steps * len(x_train) / len(x_fit))
    model = _fit(build(), x_train, lr, steps, batch, seed)
    x_test = encode(test, features).to(device)
    p, y = _scores(model, x_test), x_test.label.double().cpu().numpy()
    return {
        "ne": metrics.normalized_entropy(y, p),
        "logloss": metrics.logloss(y, p),
        "auc": metrics.auc(y, p),
        "lr": lr,
        "batch": batch,
        "passes": steps * batch / len(x_train),
    }
