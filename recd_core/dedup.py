"""Duplicate profiling: how many distinct values a feature takes within a training batch.

`dedup.factor.<feature>` = samples in a batch / distinct values of the feature in that
batch, averaged over the batches of a layout at a batch size. A factor of 12 means the
feature's work (transform, embedding lookup, user module) can shrink 12x by computing it
once per distinct value and expanding (RecD's IKJT).

Rows are compared by a 64-bit hash of their whole value (for a list: its elements and
their positions), computed with numpy over the flat values, never per row in Python. Two
different values collide with probability ~n^2 / 2^64: fine for a profile; the IKJT built
in DPP compares values exactly.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_NULL = np.uint64(0x6A09E667F3BCC909)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective scramble of 64-bit words."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _as_words(values: pa.Array) -> np.ndarray:
    arr = np.asarray(values.fill_null(0) if values.null_count else values)
    if arr.dtype.kind == "f":
        arr = arr.astype(np.float64).view(np.uint64)
    return arr.astype(np.uint64)


def row_hashes(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One uint64 per row; equal values give equal hashes (nulls hash alike)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    with np.errstate(over="ignore"):
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            flat = col.flatten()
            offsets = np.asarray(col.offsets)
            offsets = offsets - offsets[0]
            pos = np.arange(len(flat), dtype=np.uint64) - np.repeat(
                offsets[:-1], np.diff(offsets)
            ).astype(np.uint64)
            mixed = mix64(_as_words(flat) * _GOLD + pos)
            csum = np.concatenate([[np.uint64(0)], np.cumsum(mixed, dtype=np.uint64)])
            h = csum[offsets[1:]] - csum[offsets[:-1]]
            h = mix64(h ^ mix64(np.diff(offsets).astype(np.uint64)))
        else:
            h = mix64(_as_words(col))
        if col.null_count:
            h = np.where(np.asarray(col.is_null()), _NULL, h)
    return h


def batch_factors(hashes: np.ndarray, batch_size: int) -> np.ndarray:
    """Per batch of `batch_size` consecutive rows: rows / distinct hashes."""
    n = hashes.size
    if n == 0:
        return np.zeros(0)
    batch = np.arange(n) // batch_size
    order = np.lexsort((hashes, batch))
    hb, bb = hashes[order], batch[order]
    new = np.concatenate([[True], (hb[1:] != hb[:-1]) | (bb[1:] != bb[:-1])])
    uniques = np.bincount(bb[new])
    sizes = np.bincount(batch)
    return sizes / uniques


def dedup_profile(table: pa.Table, features: list[str], batch_size: int) -> dict[str, float]:
    """`dedup.factor.<feature>` for each feature, averaged over batches."""
    return {f: float(batch_factors(row_hashes(table[f]), batch_size).mean()) for f in features}


def group_hashes(table: pa.Table, columns: list[str]) -> np.ndarray:
    """A hash of several columns together (e.g. all user-side features of a row)."""
    h = np.zeros(table.num_rows, np.uint64)
    with np.errstate(over="ignore"):
        for i, c in enumerate(columns):
            h = mix64(h ^ (row_hashes(table[c]) + np.uint64(i)))
    return h


def distinct_count(col: pa.Array | pa.ChunkedArray) -> int:
    return int(pc.count_distinct(pa.array(row_hashes(col))).as_py())
