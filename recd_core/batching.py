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

from recd_core.config import DedupConfig, FeatureSet
from recd_core.dedup import DedupPlan, id_features, plan_dedup  # noqa: F401 (re-exported)
from recd_core.model import Batch


def make_batch(rows: pa.Table, features: FeatureSet, plan: DedupPlan | None) -> Batch:
    """One batch in memory, through DPP's own encode/decode (ids hashed into their tables;
    dense values as they are). `plan=None` is the baseline: every feature per sample."""
    from recd_core.batch_store import decode_batch
    from recd_core.config import PreprocessConfig, TransformSpec
    from recd_core.dpp import Prepared, encode_batch

    groups = {g: fs for g, fs in plan.groups.items() if fs} if plan else {}
    cfg = PreprocessConfig(
        mode="dedup" if groups else "baseline",
        default_dense=TransformSpec(),
        dedup=DedupConfig(method="hash"),
    )
    prep = Prepared(features, features, groups, {}, cfg, dedup_method="hash")
    return decode_batch(encode_batch(rows, prep), features, groups)


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
