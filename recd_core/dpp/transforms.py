"""DPP feature transforms, vectorized over flat numpy arrays (never a Python loop over rows).

Id features arrive as (values, lengths): the flat ids of a batch's rows and each row's
length. Dense features arrive as [rows, dim] float32. Each function returns the same
shapes, so a transform applied to a batch's unique rows and then expanded equals the
transform applied to every row: which is what makes dedup preprocessing exact.
"""

from __future__ import annotations

import numpy as np

from recd_core.config import FeatureSpec, TransformSpec
from recd_core.dedup.unique import mix64


def hash_ids(values: np.ndarray, table_size: int, stable_hash: bool) -> np.ndarray:
    """Ids into [0, table_size): a stable 64-bit mix then modulo (or plain modulo)."""
    v = values.astype(np.uint64, copy=False)
    if stable_hash:
        with np.errstate(over="ignore"):
            v = mix64(v)
    return (v % np.uint64(table_size)).astype(np.int64)


def truncate(
    values: np.ndarray, lengths: np.ndarray, n: int, keep_last: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Cut rows to at most n ids: the first n, or the last n (sequences: most recent last)."""
    if lengths.size == 0 or lengths.max(initial=0) <= n:
        return values, lengths
    new = np.minimum(lengths, n)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first = ends - new if keep_last else starts
    new_offsets = np.concatenate([[0], np.cumsum(new)])
    idx = np.repeat(first - new_offsets[:-1], new) + np.arange(new_offsets[-1])
    return values[idx], new


def transform_ids(values, lengths, spec: FeatureSpec, t: TransformSpec):
    if t.truncate is not None:
        values, lengths = truncate(values, lengths, t.truncate, keep_last=spec.kind == "sequence")
    return hash_ids(values, spec.table_size or 1, t.hash_for(spec)), lengths


def dense_stats(x: np.ndarray) -> dict[str, list[float]]:
    """Per-dimension mean and std (std 1 where a dimension is constant)."""
    mean = x.mean(axis=0, dtype=np.float64) if x.size else np.zeros(x.shape[1])
    std = x.std(axis=0, dtype=np.float64) if x.size else np.ones(x.shape[1])
    return {"mean": mean.tolist(), "std": np.where(std > 0, std, 1.0).tolist()}


def pre_standardize(x: np.ndarray, t: TransformSpec) -> np.ndarray:
    """The steps before standardization (so statistics are taken on what they scale)."""
    if t.default is not None:
        x = np.where(np.isnan(x), np.float32(t.default), x)
    if t.log1p:
        x = np.log1p(np.maximum(x, 0))
    if t.clip is not None:
        x = np.clip(x, t.clip[0], t.clip[1])
    return x.astype(np.float32, copy=False)


def transform_dense(x: np.ndarray, t: TransformSpec, stats: dict | None):
    """[rows, dim] floats -> floats, or (for `buckets`) ids and lengths of an id list."""
    x = pre_standardize(x, t)
    if t.standardize:
        if stats is None:
            raise ValueError("standardize needs statistics of the training partition")
        x = (
            (x - np.asarray(stats["mean"], np.float32)) / np.asarray(stats["std"], np.float32)
        ).astype(np.float32)
    if t.buckets is not None:
        nb = len(t.buckets) + 1
        ids = np.searchsorted(np.asarray(t.buckets, np.float32), x, side="right") + nb * np.arange(
            x.shape[1]
        )
        return ids.reshape(-1).astype(np.int64), np.full(x.shape[0], x.shape[1], np.int64)
    return x


def model_spec(spec: FeatureSpec, t: TransformSpec) -> FeatureSpec:
    """The feature as the model sees it after the transform (bucketized dense -> id list)."""
    if spec.kind == "dense" and t.buckets is not None:
        return FeatureSpec(
            name=spec.name,
            side=spec.side,
            kind="id_list",
            table_size=spec.dim * (len(t.buckets) + 1),
            max_length=spec.dim,
            required=spec.required,
        )
    if spec.kind == "dense":
        return spec
    # how the ids found their rows (a warm start must have mapped them alike)
    update: dict = {"hash": t.hash_for(spec)}
    if spec.is_list and t.truncate is not None:
        update["max_length"] = min(t.truncate, spec.max_length or t.truncate)
    return spec.model_copy(update=update)
