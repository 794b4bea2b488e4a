"""Samples (Arrow) -> training batches (KJT / IKJT), and the dedup plan that decides which
features are deduplicated.

This is the in-process batcher `recd train` uses until DPP preprocessing writes batches to
the warehouse; DPP will apply the same plan and the same transforms.

The plan: a feature is deduplicated when its measured dedup factor (samples per distinct
value in a batch, on the training partition at the training batch size) reaches
`min_factor`, the point where computing once per unique row and expanding beats computing
per sample. User-side features that qualify form one group, deduplicated together (one
`inverse_indices`); item and context features vary per sample and stay in the KJT. Both are
overridable: `groups` names the groups explicitly.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from pydantic import BaseModel, ConfigDict

from recd_core.config import DedupConfig, FeatureSet
from recd_core.dedup import dedup_profile
from recd_core.model import Batch
from recd_core.sparse import ikjt_from_arrow, kjt_from_arrow


class DedupPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    groups: dict[str, list[str]]
    profile: dict[str, float]

    @property
    def grouped(self) -> set[str]:
        return {f for fs in self.groups.values() for f in fs}


def id_features(features: FeatureSet) -> list[str]:
    return [f.name for f in features.features if f.kind != "dense"]


def plan_dedup(
    table: pa.Table, features: FeatureSet, cfg: DedupConfig, batch_size: int
) -> DedupPlan:
    ids = id_features(features)
    if cfg.groups is not None:
        unknown = sorted({f for fs in cfg.groups.values() for f in fs} - set(ids))
        if unknown:
            raise ValueError(f"dedup groups name unknown id features: {unknown}")
        return DedupPlan(groups=cfg.groups, profile={})
    profile = dedup_profile(table, ids, batch_size)
    user = [
        f.name
        for f in features.by_side("user")
        if f.kind != "dense" and profile[f.name] >= cfg.min_factor
    ]
    return DedupPlan(groups={"user": user} if user else {}, profile=profile)


def _hashed(col: pa.ChunkedArray | pa.Array, table_size: int) -> pa.Array:
    """ids mod table size (the id transform; DPP owns the configurable version)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_list(col.type):
        flat = pc.cast(col.flatten(), pa.int64())
        offsets = col.offsets
        if offsets[0].as_py() != 0:
            offsets = pc.subtract(offsets, offsets[0])
        return pa.ListArray.from_arrays(offsets, pa.array(np.mod(np.asarray(flat), table_size)))
    return pa.array(np.mod(np.asarray(col, np.int64), table_size))


def make_batch(rows: pa.Table, features: FeatureSet, plan: DedupPlan | None) -> Batch:
    """One batch: `plan=None` is the baseline (every feature per sample in the KJT)."""
    ids = id_features(features)
    hashed = pa.table({f: _hashed(rows[f], features[f].table_size or 1) for f in ids})
    dense_parts = []
    for f in features.features:
        if f.kind != "dense":
            continue
        col = rows[f.name].combine_chunks()
        arr = np.asarray(col.flatten() if pa.types.is_list(col.type) else col, np.float32)
        dense_parts.append(arr.reshape(rows.num_rows, f.dim))
    dense = (
        torch.from_numpy(np.concatenate(dense_parts, axis=1))
        if dense_parts
        else torch.zeros(rows.num_rows, 0)
    )
    labels = torch.from_numpy(np.asarray(rows["label"], np.float32))
    grouped = plan.grouped if plan else set()
    per_sample = [f for f in ids if f not in grouped]
    kjt = kjt_from_arrow(hashed, per_sample) if per_sample else None
    groups = {
        g: ikjt_from_arrow(hashed, fs) for g, fs in (plan.groups.items() if plan else []) if fs
    }
    return Batch(dense, kjt, labels, groups)


def batch_slices(num_rows: int, batch_size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + batch_size, num_rows)) for lo in range(0, num_rows, batch_size)]


def epoch_order(num_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The batches of an epoch in a seeded order (contiguous rows stay together)."""
    return np.random.default_rng([seed, epoch]).permutation(num_batches)


def iterate_batches(
    table: pa.Table,
    features: FeatureSet,
    plan: DedupPlan | None,
    batch_size: int,
    order: np.ndarray,
) -> Iterator[Batch]:
    slices = batch_slices(table.num_rows, batch_size)
    for b in order:
        lo, hi = slices[int(b)]
        yield make_batch(table.slice(lo, hi - lo), features, plan)
