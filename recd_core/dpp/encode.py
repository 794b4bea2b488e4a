"""A batch's encoding: sample rows -> one Arrow record batch of flat tensors, each dedup
group's features transformed once per unique row (an IKJT), the rest per sample (a KJT).
What DPP writes (dpp/preprocess.py), and what scoring builds in memory from the same
transforms and statistics (`Prepared`), so a served row scores as a trained one.

A batch is one record batch of ONE row whose columns are flat tensors:

    labels                    list<float32>   [B]
    dense                     list<float32>   [B * dense_dim], row-major
    ids.<key>.values          list<int64>     per-sample id features (a KJT)
    ids.<key>.lengths         list<int32>     [B]
    group.<g>.inverse         list<int32>     [B]   sample -> unique row
    group.<g>.<key>.values    list<int64>     the group's unique rows (an IKJT)
    group.<g>.<key>.lengths   list<int32>     [U]
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from recd_core.config import DedupConfig, FeatureSet, FeatureSpec, PreprocessConfig, TransformSpec
from recd_core.dedup.unique import DedupPlan, unique_rows, unique_runs, unique_sessions
from recd_core.dedup.unique import list_array as _lists
from recd_core.dedup.unique import list_parts as _list_parts
from recd_core.dpp.batch_store import Batch, decode_batch
from recd_core.dpp.transforms import transform_dense, transform_ids
from recd_core.schema import SIDE_ROW

_F32 = pa.list_(pa.float32())


_I64 = pa.list_(pa.int64())


_I32 = pa.list_(pa.int32())


@dataclass(frozen=True)
class Prepared:
    """What every batch of a run needs: raw and model feature sets, plan, statistics."""

    raw: FeatureSet
    model: FeatureSet
    groups: dict[str, list[str]]
    stats: dict[str, dict]
    cfg: PreprocessConfig
    dedup_method: str = "runs"  # resolved: session | runs | hash
    # each feature's transform, resolved once (a served request's batch needs all of them)
    _transforms: dict[str, TransformSpec] = field(default_factory=dict, repr=False, compare=False)

    def transform(self, spec: FeatureSpec) -> TransformSpec:
        """`cfg.transform_for(spec)`, kept."""
        if spec.name not in self._transforms:
            self._transforms[spec.name] = self.cfg.transform_for(spec)
        return self._transforms[spec.name]

    def to_json(self) -> str:
        return json.dumps(
            {
                "dedup_method": self.dedup_method,
                "raw": self.raw.model_dump(mode="json"),
                "model": self.model.model_dump(mode="json"),
                "groups": self.groups,
                "stats": self.stats,
                "cfg": self.cfg.model_dump(mode="json"),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Prepared:
        d = json.loads(text)
        return cls(
            FeatureSet.model_validate(d["raw"]),
            FeatureSet.model_validate(d["model"]),
            d["groups"],
            d["stats"],
            PreprocessConfig.model_validate(d["cfg"]),
            d["dedup_method"],
        )


def dense_matrix(col: pa.ChunkedArray | pa.Array, dim: int) -> np.ndarray:
    """A dense feature's column as [rows, dim] float32 (a missing value as NaN)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    arr = col.flatten() if pa.types.is_list(col.type) else col
    return np.asarray(arr.fill_null(np.nan) if arr.null_count else arr, np.float32).reshape(
        len(col), dim
    )


# -- batches ------------------------------------------------------------------------------------
def encode_batch(rows: pa.Table, prep: Prepared, side: pa.Table | None = None) -> pa.RecordBatch:
    """Transform one batch of samples into the one-row batch record (format: module doc)."""
    n = rows.num_rows
    return _encode(rows, np.arange(n), np.array([0, n]), prep, side)


CHUNK_ROWS = 4096  # rows encoded together: per-column Python work amortized, arrays in cache


def encode_batches(
    rows: pa.Table, keep: np.ndarray, prep: Prepared, batch_size: int, side: pa.Table | None = None
) -> Iterator[pa.RecordBatch]:
    """The kept rows (`keep`: a mask over `rows`) as batches of `batch_size` consecutive kept
    rows, each the one-row batch record of the module doc, in order.

    Every transform is per value, so consecutive batches are encoded together, about
    `CHUNK_ROWS` rows at a time: each column is transformed once for the chunk and cut at
    the batches' boundaries (a record batch with a row per batch, sliced). The Python work is
    per chunk, not per batch, which matters at small batch sizes; chunks stay small enough
    for the hashing passes to run in cache. Dedup finds each batch's unique rows (a session's
    first row in the batch, or by values for `runs`/`hash`) and transforms only those.
    `side`: the grouped columns as stored once per session run (a normalized partition;
    `rows` then carry `_side_row` instead of them); the unique rows are taken from it."""
    pos = np.flatnonzero(keep)
    bounds = np.r_[np.arange(0, pos.size, batch_size), pos.size]
    per = max(1, CHUNK_ROWS // batch_size)  # batches a chunk
    for c in range(0, bounds.size - 1, per):
        b = bounds[c : c + per + 1]
        chunk = _encode(rows, pos[b[0] : b[-1]], b - b[0], prep, side)
        for i in range(chunk.num_rows):
            yield chunk.slice(i, 1)


def _encode(
    rows: pa.Table, pos: np.ndarray, bounds: np.ndarray, prep: Prepared, side: pa.Table | None
) -> pa.RecordBatch:
    """Rows `pos` of `rows` as batches, a record row each: batch i holds
    pos[bounds[i]:bounds[i+1]]."""
    grouped = {k for ks in prep.groups.values() for k in ks}
    chunk = _take_rows(rows.select([c for c in rows.column_names if c not in grouped]), pos)
    n = chunk.num_rows
    cols: dict[str, pa.Array] = {}
    cols["labels"] = _lists(np.asarray(chunk["label"], np.float32), bounds, _F32)
    dense_parts, extra_ids = [], {}
    for f in prep.raw.features:
        if f.kind != "dense":
            continue
        out = transformed_dense(chunk[f.name], f, prep)
        if isinstance(out, tuple):
            extra_ids[f.name] = out
        else:
            dense_parts.append(out)
    dense = np.concatenate(dense_parts, axis=1) if dense_parts else np.zeros((n, 0), np.float32)
    cols["dense"] = _lists(dense.reshape(-1), bounds * dense.shape[1], _F32)
    for f in prep.model.features:
        if f.kind == "dense" or f.name in grouped:
            continue
        values, lengths = extra_ids.get(f.name) or feature_ids(chunk[f.name], prep, f.name)
        _add_ids(cols, f"ids.{f.name}", values, lengths, bounds)
    for g, keys in prep.groups.items():
        first, inverse, ubounds = _unique_per_batch(chunk, rows, pos, bounds, keys, prep)
        if side is not None:  # a session's rows share their values: any of its side rows
            uniq = side.select(keys).take(pa.array(np.asarray(chunk[SIDE_ROW])[first]))
        else:
            uniq = rows.select(keys).take(pa.array(pos[first]))
        cols[f"group.{g}.inverse"] = _lists(inverse.astype(np.int32), bounds, _I32)
        for k in keys:
            values, lengths = feature_ids(uniq[k], prep, k)
            _add_ids(cols, f"group.{g}.{k}", values, lengths, ubounds)
    return pa.RecordBatch.from_pydict(cols)


def _unique_per_batch(
    chunk: pa.Table,
    rows: pa.Table,
    pos: np.ndarray,
    bounds: np.ndarray,
    keys: list[str],
    prep: Prepared,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each batch's unique rows of the group: their positions in the chunk (batch by batch),
    every row's index among its batch's unique rows, and the batches' bounds in the unique
    rows. `chunk` holds rows `pos` of `rows` (without the group's columns)."""
    if pos.size == 0:
        return pos, np.zeros(0, np.int64), np.zeros(bounds.size, np.int64)
    if prep.dedup_method == "session":  # no value of the group is read
        first, u = unique_sessions(np.asarray(chunk["session_id"]), cuts=bounds[:-1])
        ubounds = np.r_[u[bounds[:-1]], u[-1] + 1]  # u: the chunk-wide unique index
        return first, u - np.repeat(ubounds[:-1], np.diff(bounds)), ubounds
    find = unique_runs if prep.dedup_method == "runs" else unique_rows
    firsts, inverses, ubounds = [], [], [0]
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        batch = _take_rows(rows.select(keys), pos[lo:hi])
        parts = [_list_parts(batch[k]) for k in keys]
        first, inverse = find([p[0] for p in parts], [p[1] for p in parts])
        firsts.append(lo + first)
        inverses.append(inverse)
        ubounds.append(ubounds[-1] + first.size)
    return np.concatenate(firsts), np.concatenate(inverses), np.asarray(ubounds)


def _take_rows(table: pa.Table, pos: np.ndarray) -> pa.Table:
    """Rows `pos` (increasing) of a table: zero-copy slices of its runs of consecutive rows
    (one slice when they all are), or a take where the runs are short."""
    if pos.size == 0 or pos[-1] - pos[0] + 1 == pos.size:
        return table.slice(int(pos[0]) if pos.size else 0, pos.size)
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    if (cuts.size + 1) * 32 > pos.size:
        return table.take(pa.array(pos))
    starts, ends = np.r_[0, cuts], np.r_[cuts, pos.size]
    return pa.concat_tables(
        [table.slice(int(pos[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]
    )


def _add_ids(cols: dict, name: str, values: np.ndarray, lengths: np.ndarray, bounds) -> None:
    """An id feature's flat values and lengths, cut into batches at `bounds` (rows)."""
    offsets = np.r_[0, np.cumsum(lengths)]
    cols[f"{name}.values"] = _lists(values, offsets[bounds], _I64)
    cols[f"{name}.lengths"] = _lists(lengths.astype(np.int32), bounds, _I32)


def transformed_dense(col, spec, prep: Prepared):
    """A dense feature's column transformed as the run's DPP does: [rows, dim] floats, or
    (bucketized) an id list's values and lengths."""
    return transform_dense(
        dense_matrix(col, spec.dim), prep.transform(spec), prep.stats.get(spec.name)
    )


def feature_ids(col, prep: Prepared, name: str) -> tuple[np.ndarray, np.ndarray]:
    """An id feature's column as the model's ids (hashed, truncated): flat values, lengths."""
    spec = prep.raw[name]
    values, lengths = _list_parts(col)
    return transform_ids(values, lengths, spec, prep.transform(spec))


def batch_ranges(num_rows: int, batch_size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + batch_size, num_rows)) for lo in range(0, num_rows, batch_size)]


def make_batch(rows: pa.Table, features: FeatureSet, plan: DedupPlan | None) -> Batch:
    """A slice of samples as one training batch in memory, through DPP's own encode and
    decode (ids hashed into their tables, dense values as they are; `plan=None` is the
    baseline, every feature per sample; unique rows found by hashing, any row order): what
    tests and benchmarks build batches with, without writing them to the warehouse."""

    groups = {g: fs for g, fs in plan.groups.items() if fs} if plan else {}
    cfg = PreprocessConfig(
        mode="dedup" if groups else "baseline",
        default_dense=TransformSpec(),
        dedup=DedupConfig(method="hash"),
    )
    prep = Prepared(features, features, groups, {}, cfg, dedup_method="hash")
    return decode_batch(encode_batch(rows, prep), features, groups)
