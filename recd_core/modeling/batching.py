"""Training batches in memory, and the order batches are trained in.

`make_batch` turns a slice of samples into a training batch through DPP's own encode and
decode (the same code path as `recd preprocess`; ids hashed into their tables, dense values
as they are): tests and benchmarks build batches with it without writing them to the
warehouse. Training itself streams the preprocessed batches (dpp/batch_store.py).

Which features are deduplicated is decided by the dedup plan (`dedup.plan_dedup`,
re-exported here): a feature is grouped when its measured dedup factor reaches
`min_factor`; user-side features that qualify form one group with one `inverse_indices`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from recd_core.config import DedupConfig, FeatureSet
from recd_core.dedup.unique import DedupPlan, id_features, plan_dedup  # noqa: F401 (re-exported)
from recd_core.dpp.batch_store import Batch


def make_batch(rows: pa.Table, features: FeatureSet, plan: DedupPlan | None) -> Batch:
    """One batch; `plan=None` is the baseline (every feature per sample). Unique rows are
    found by hashing (exact, any row order)."""
    from recd_core.config import PreprocessConfig, TransformSpec
    from recd_core.dpp.batch_store import decode_batch
    from recd_core.dpp.preprocess import Prepared, encode_batch

    groups = {g: fs for g, fs in plan.groups.items() if fs} if plan else {}
    cfg = PreprocessConfig(
        mode="dedup" if groups else "baseline",
        default_dense=TransformSpec(),
        dedup=DedupConfig(method="hash"),
    )
    prep = Prepared(features, features, groups, {}, cfg, dedup_method="hash")
    return decode_batch(encode_batch(rows, prep), features, groups)


def epoch_order(num_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The batches of an epoch in a seeded order (contiguous rows stay together)."""
    return np.random.default_rng([seed, epoch]).permutation(num_batches)
