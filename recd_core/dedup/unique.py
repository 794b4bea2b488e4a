"""Finding duplicates, the core of RecD: exact unique rows of a (list) column, unique runs
and sessions (DPP builds its IKJTs from these), the dedup plan (which features to group and
dedup, `plan_dedup`), and the profile of how many distinct values a feature takes within a
training batch.

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
from pydantic import BaseModel, ConfigDict

from recd_core.config import DedupConfig, FeatureSet
from recd_core.schema import sessions_checked

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_NULL = np.uint64(0x6A09E667F3BCC909)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective scramble of 64-bit words (a new array)."""
    return _mix64_(x.astype(np.uint64, copy=True))


def _mix64_(x: np.ndarray) -> np.ndarray:
    """`mix64` in place, on a uint64 array the caller owns (hashing is most of a profile's
    and of ingest's session check's time: no temporaries)."""
    t = np.empty_like(x)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        np.right_shift(x, np.uint64(shift), out=t)
        x ^= t
        if mult is not None:
            x *= mult
    return x


def _as_words(values: pa.Array) -> np.ndarray:
    """The values as uint64 words, a view where they are 64-bit already (read only)."""
    arr = np.asarray(values.fill_null(0) if values.null_count else values)
    if arr.dtype.kind == "f":
        arr = arr.astype(np.float64, copy=False)
    return arr.view(np.uint64) if arr.itemsize == 8 else arr.astype(np.uint64)


def row_hashes(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One uint64 per row; equal values give equal hashes (nulls hash alike)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    with np.errstate(over="ignore"):
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            offsets = np.asarray(col.offsets)
            h = _row_hash(_as_words(col.flatten()), np.diff(offsets))
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
    return combine_hashes([row_hashes(table[c]) for c in columns], table.num_rows)


def combine_hashes(hashes: list[np.ndarray], rows: int) -> np.ndarray:
    """`group_hashes` from the columns' `row_hashes`, in column order (for a caller that
    has them already: hashing the user-side lists is most of a profile's time)."""
    h = np.zeros(rows, np.uint64)
    with np.errstate(over="ignore"):
        for i, c in enumerate(hashes):
            h = mix64(h ^ (c + np.uint64(i)))
    return h


# -- exact unique rows over flat arrays ------------------------------------------------------------
def _row_hash(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """One hash per list: the sum of its mixed (value, position in the list) words, mixed
    with its length."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    with np.errstate(over="ignore"):
        mixed = np.multiply(values.astype(np.uint64, copy=False), _GOLD)  # a new array
        mixed += np.arange(values.size, dtype=np.uint64)
        mixed -= np.repeat(offsets[:-1].astype(np.uint64), lengths)  # position in its list
        _mix64_(mixed)
        csum = np.empty(values.size + 1, np.uint64)
        csum[0] = 0
        np.cumsum(mixed, dtype=np.uint64, out=csum[1:])
        h = csum[offsets[1:]] - csum[offsets[:-1]]
        h ^= mix64(lengths)
        return _mix64_(h)


def unique_rows(
    flat_values: list[np.ndarray], lengths: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of a group of jagged features, in order of first appearance.

    Returns (first, inverse): `first[u]` is the first sample with unique row u, and
    `inverse[i]` the unique row of sample i. Rows are bucketed by a 64-bit hash, then every
    sample is compared exactly with its bucket's first sample; a hash collision (never seen
    in practice) falls back to exact comparison of the rows as bytes.
    """
    n = lengths[0].size if lengths else 0
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for k, (v, ln) in enumerate(zip(flat_values, lengths, strict=True)):
            h = mix64(h ^ (_row_hash(v, ln) + np.uint64(k)))
    _, first_idx, inv = np.unique(h, return_index=True, return_inverse=True)
    # renumber unique rows by first appearance (keeps the clustered order)
    order = np.argsort(first_idx, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    first, inverse = first_idx[order], rank[inv]
    if not _rows_equal(flat_values, lengths, np.arange(n), first[inverse]):
        return _unique_rows_exact(flat_values, lengths)
    return first.astype(np.int64), inverse.astype(np.int64)


def same_as_previous(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per row: is it identical to the row before it? (one shifted comparison per value)"""
    n = lengths.size
    same = np.zeros(n, bool)
    if n < 2:
        return same
    same[1:] = lengths[1:] == lengths[:-1]
    if values.size == n and (lengths == 1).all():  # a scalar feature: one shifted compare
        same[1:] &= values[1:] == values[:-1]
        return same
    if values.size:
        row_of = np.repeat(np.arange(n), lengths)
        cand = same[row_of]  # values of rows whose length matches the previous row's
        j = np.flatnonzero(cand)
        mismatch = values[j] != values[j - lengths[row_of[j]]]
        same[np.unique(row_of[j[mismatch]])] = False
    return same


def unique_sessions(
    session_ids: np.ndarray, cuts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Unique rows of the user group by session runs: each run's first row, and every row's
    run. Exact for data whose user-side values are checked constant within a session
    (ingest's session check); O(rows). `cuts`: rows where a run starts anew anyway (batch
    boundaries: each batch's unique rows are its own)."""
    n = session_ids.size
    start = np.ones(n, bool)
    start[1:] = session_ids[1:] != session_ids[:-1]
    if cuts is not None:
        start[cuts] = True
    return np.flatnonzero(start).astype(np.int64), (np.cumsum(start) - 1).astype(np.int64)


def unique_runs(
    flat_values: list[np.ndarray], lengths: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Like `unique_rows`, for rows where duplicates are adjacent (a session-clustered
    batch): a new unique row starts wherever a row differs from the one before it. Exact by
    construction and cheaper than hashing; equal rows that are not adjacent stay separate
    unique rows (which costs dedup, never correctness)."""
    n = lengths[0].size if lengths else 0
    same = np.ones(n, bool)
    # scalars first: rows they already split need no list comparison
    for v, ln in sorted(zip(flat_values, lengths, strict=True), key=lambda p: p[0].size):
        if not same.any():
            break
        same &= same_as_previous(v, ln)
    start = ~same
    if n:
        start[0] = True
    return np.flatnonzero(start).astype(np.int64), (np.cumsum(start) - 1).astype(np.int64)


def _rows_equal(flat_values, lengths, a: np.ndarray, b: np.ndarray) -> bool:
    """Is row a[i] == row b[i] for every i, in every feature? (vectorized)"""
    for v, ln in zip(flat_values, lengths, strict=True):
        if not np.array_equal(ln[a], ln[b]):
            return False
        offsets = np.concatenate([[0], np.cumsum(ln)])
        la = ln[a]
        base = np.repeat(np.arange(la.size), la)
        within = np.arange(int(la.sum())) - np.repeat(np.concatenate([[0], np.cumsum(la)])[:-1], la)
        if not np.array_equal(v[offsets[a][base] + within], v[offsets[b][base] + within]):
            return False
    return True


def _unique_rows_exact(flat_values, lengths) -> tuple[np.ndarray, np.ndarray]:
    offsets = [np.concatenate([[0], np.cumsum(ln)]) for ln in lengths]
    seen: dict[tuple, int] = {}
    first, inverse = [], []
    for i in range(lengths[0].size):
        key = tuple(v[o[i] : o[i + 1]].tobytes() for v, o in zip(flat_values, offsets, strict=True))
        u = seen.setdefault(key, len(seen))
        if u == len(first):
            first.append(i)
        inverse.append(u)
    return np.asarray(first, np.int64), np.asarray(inverse, np.int64)


def list_parts(col: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a list or scalar int column, without a Python loop over rows."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        offsets = np.asarray(col.offsets, np.int64)
        values = np.asarray(col.values.slice(offsets[0], offsets[-1] - offsets[0]), np.int64)
        return values, np.diff(offsets)
    return np.asarray(col, np.int64), np.ones(len(col), np.int64)


def list_array(flat: np.ndarray, offsets: np.ndarray, typ: pa.DataType) -> pa.Array:
    """The inverse of `list_parts`: a list column of type `typ` whose row i is
    flat[offsets[i]:offsets[i+1]]."""
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, typ.value_type))


class DedupPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    groups: dict[str, list[str]]
    profile: dict[str, float]

    @property
    def grouped(self) -> set[str]:
        return {f for fs in self.groups.values() for f in fs}


def id_features(features: FeatureSet) -> list[str]:
    return [f.name for f in features.features if f.kind != "dense"]


def session_factors(session_ids: np.ndarray, batch_size: int) -> np.ndarray:
    """Per batch: samples / session runs (a lower bound of every user feature's factor)."""
    n = session_ids.size
    if n == 0:
        return np.zeros(0)
    batch = np.arange(n) // batch_size
    start = np.ones(n, bool)
    start[1:] = (session_ids[1:] != session_ids[:-1]) | (batch[1:] != batch[:-1])
    return np.bincount(batch) / np.bincount(batch[start])


def session_plan(
    session_ids: np.ndarray, features: FeatureSet, cfg: DedupConfig, batch_size: int
) -> DedupPlan | None:
    """The plan decided from the session ids of the first `profile_batches` batches alone,
    in O(rows): user-side values are constant within a session (checked at ingest), so every
    user feature's factor is at least samples per session run. None when there is no user
    id feature or that floor is under `min_factor`: then the features are measured."""
    user_ids = [f.name for f in features.by_side("user") if f.kind != "dense"]
    if not user_ids:
        return None
    head = session_ids[: cfg.profile_batches * batch_size]
    floor = float(session_factors(head, batch_size).mean()) if head.size else 0.0
    if floor < cfg.min_factor:
        return None
    return DedupPlan(groups={"user": user_ids}, profile={f: floor for f in user_ids})


def plan_dedup(
    table: pa.Table, features: FeatureSet, cfg: DedupConfig, batch_size: int
) -> DedupPlan:
    ids = id_features(features)
    if cfg.groups is not None:
        unknown = sorted({f for fs in cfg.groups.values() for f in fs} - set(ids))
        if unknown:
            raise ValueError(f"dedup groups name unknown id features: {unknown}")
        return DedupPlan(groups=cfg.groups, profile={})
    head = table.slice(0, cfg.profile_batches * batch_size)
    if sessions_checked(table.schema) and "session_id" in table.column_names:
        plan = session_plan(np.asarray(head["session_id"]), features, cfg, batch_size)
        if plan is not None:
            return plan
    # measured on the first `profile_batches` batches: the profile is a decision, not a report
    profile = dedup_profile(head, ids, batch_size)
    user = [
        f.name
        for f in features.by_side("user")
        if f.kind != "dense" and profile[f.name] >= cfg.min_factor
    ]
    return DedupPlan(groups={"user": user} if user else {}, profile=profile)
