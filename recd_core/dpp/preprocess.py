"""`recd preprocess`: DPP. Samples -> transformed training batches, once per unique value.

Reads `samples/layout=clustered/ds=D`, cuts it into batches of `batch_size` contiguous rows,
transforms the features (dpp/transforms.py) and writes the batches to
`batches/mode=<dedup|baseline>/ds=D`. In dedup mode the user group's rows are deduplicated
exactly first and only the unique rows are transformed; the batch keeps them as an IKJT.
Expanding a dedup batch gives the baseline batch, tensor for tensor (tested). On a
session-normalized partition (data/generate.py) dedup reads the user-side values as stored,
once per session run, and never decodes a repeated one (`read_split`).

Validation: the latest `validation_fraction` of the day's rows by time (or of each user's
rows, `validation_by: user`) are batched apart, into `valid-NNNNN.arrow` beside each split's
`shard-NNNNN.arrow`; training evaluates on them and never trains on them. Both keep the
clustered order, so validation batches deduplicate like training batches.

Batch format (Arrow IPC, never pickle): a shard file `shard-NNNNN.arrow` per split; each
training batch is one record batch of ONE row whose columns are flat tensors:

    labels                    list<float32>   [B]
    dense                     list<float32>   [B * dense_dim], row-major
    ids.<key>.values          list<int64>     per-sample id features (a KJT)
    ids.<key>.lengths         list<int32>     [B]
    group.<g>.inverse         list<int32>     [B]   sample -> unique row
    group.<g>.<key>.values    list<int64>     the group's unique rows (an IKJT)
    group.<g>.<key>.lengths   list<int32>     [U]

The manifest (`_manifest.json`) adds: the model's feature set (after transforms), the dedup
plan, the standardization statistics, batch size, counts and the click rate.

Parallelism: a split is `batches_per_split` consecutive batches, fixed by the data and the
config, never by the number of workers, so the output is the same whatever `--workers`:
`local` runs splits on a process pool, `ray` on Ray Data; shards are listed in split order.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from recd_core.config import FeatureSet, PreprocessConfig
from recd_core.dedup.unique import DedupPlan, unique_rows, unique_runs, unique_sessions
from recd_core.dedup.unique import list_array as _lists
from recd_core.dedup.unique import list_parts as _list_parts
from recd_core.dpp.batch_store import Batch, decode_batch
from recd_core.dpp.transforms import (
    dense_stats,
    model_spec,
    pre_standardize,
    transform_dense,
    transform_ids,
)
from recd_core.errors import BadInput
from recd_core.lineage import check_reads, record
from recd_core.runtime import die_with_parent
from recd_core.schema import SIDE_ROW, events_schema, feature_set_of, sessions_checked
from recd_core.warehouse import Warehouse

_F32 = pa.list_(pa.float32())
_I64 = pa.list_(pa.int64())
_I32 = pa.list_(pa.int32())


class PreprocessError(BadInput, ValueError):
    """A samples partition or config DPP cannot work with (names the file and column)."""


@dataclass(frozen=True)
class Prepared:
    """What every batch of a run needs: raw and model feature sets, plan, statistics."""

    raw: FeatureSet
    model: FeatureSet
    groups: dict[str, list[str]]
    stats: dict[str, dict]
    cfg: PreprocessConfig
    dedup_method: str = "runs"  # resolved: session | runs | hash

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


def check_samples_schema(warehouse: Warehouse, ds: str) -> FeatureSet:
    """Every file of the clustered partition readable, with every column of its feature set,
    typed as recd writes it; returns the feature set. Errors name the file and the column."""
    raw = None
    files = warehouse.files("samples", ds, layout="clustered")
    schemas = warehouse.file_schemas("samples", ds, layout="clustered")
    for path in files:
        try:
            path, schema = next(schemas)
        except (pa.ArrowException, OSError) as e:
            raise PreprocessError(f"{path}: not a readable Parquet file ({e})") from None
        if raw is None:
            try:
                raw = feature_set_of(schema)
            except ValueError as e:
                raise PreprocessError(f"{path}: {e}") from None
        for field in events_schema(raw):
            if field.name not in schema.names:
                raise PreprocessError(f"{path}: column {field.name!r} is missing")
            actual = schema.field(field.name).type
            if actual != field.type:
                raise PreprocessError(
                    f"{path}: column {field.name!r} is {actual}, expected {field.type}"
                )
    if raw is None:
        raise PreprocessError("the samples partition holds no files")
    return raw


def prepare(
    table: pa.Table,
    raw: FeatureSet,
    cfg: PreprocessConfig,
    stats: dict | None = None,
    dense: pa.Table | None = None,
) -> Prepared:
    """Check the config against the data; measure the dedup plan (on `table`, the first
    batches) and, unless given, the standardization statistics (on `dense`, the whole
    partition's dense columns; default `table`)."""
    from recd_core.dedup.unique import plan_dedup

    for name in cfg.transforms:
        if name not in {f.name for f in raw.features}:
            raise PreprocessError(
                f"config: transforms name feature {name!r}, which the samples do not have"
            )
    missing = [f.name for f in raw.features if f.name not in table.column_names] + [
        c for c in ("label",) if c not in table.column_names
    ]
    if missing:
        raise PreprocessError(f"samples lack column(s) {missing}")
    if stats is None:
        stats = {}
        for f in raw.features:
            t = cfg.transform_for(f)
            if f.kind == "dense" and t.standardize:
                col = (dense if dense is not None else table)[f.name]
                stats[f.name] = dense_stats(pre_standardize(dense_matrix(col, f.dim), t))
    model = FeatureSet(
        name=raw.name,
        user_key=raw.user_key,
        item_key=raw.item_key,
        features=[model_spec(f, cfg.transform_for(f)) for f in raw.features],
    )
    groups = {}
    if cfg.mode == "dedup":
        plan = plan_dedup(table, raw, cfg.dedup, cfg.batch_size)
        groups = {g: fs for g, fs in plan.groups.items() if fs}
    return Prepared(
        raw, model, groups, stats, cfg, resolve_method(cfg.dedup.method, table.schema, raw, groups)
    )


def resolve_method(
    method: str, schema: pa.Schema, raw: FeatureSet, groups: dict[str, list[str]]
) -> str:
    """`session` only where it is exact: ingest checked the sessions and every grouped
    feature is user-side (the checked ones)."""
    user = {f.name for f in raw.by_side("user")}
    session_ok = sessions_checked(schema) and all(set(fs) <= user for fs in groups.values())
    if method == "auto":
        return "session" if session_ok else "runs"
    if method == "session" and not session_ok:
        raise PreprocessError(
            "dedup method 'session' needs samples whose ingest checked sessions (check_sessions) "
            "and user-side groups only; use 'auto', 'runs' or 'hash'"
        )
    return method


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
    rows: pa.Table,
    keep: np.ndarray,
    prep: Prepared,
    batch_size: int,
    side: pa.Table | None = None,
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
        dense_matrix(col, spec.dim), prep.cfg.transform_for(spec), prep.stats.get(spec.name)
    )


def feature_ids(col, prep: Prepared, name: str) -> tuple[np.ndarray, np.ndarray]:
    """An id feature's column as the model's ids (hashed, truncated): flat values, lengths."""
    spec = prep.raw[name]
    values, lengths = _list_parts(col)
    return transform_ids(values, lengths, spec, prep.cfg.transform_for(spec))


# -- a partition ----------------------------------------------------------------------------------
MIN_SCALED_BATCH = 256  # `min_steps_per_pass` halves the batch size down to this


def scaled_batch_size(rows: int, cfg: PreprocessConfig) -> int:
    """The batch size a day of `rows` rows is cut into: `batch_size`, halved while a pass
    over the training rows would have fewer than `min_steps_per_pass` steps."""
    size, steps = cfg.batch_size, cfg.min_steps_per_pass
    train_rows = rows * (1 - cfg.validation_fraction)
    while steps is not None and size // 2 >= MIN_SCALED_BATCH and train_rows / size < steps:
        size //= 2
    return size


def batch_ranges(num_rows: int, batch_size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + batch_size, num_rows)) for lo in range(0, num_rows, batch_size)]


def split_ranges(
    num_rows: int, cfg: PreprocessConfig, row_group_rows: int | None = None
) -> list[tuple[int, int]]:
    """Splits of whole batches: fixed by the data and the config, not by the workers. With
    `row_group_rows` (the partition's row-group size) a split covers whole row groups when
    the batch size divides it, so no row group is decoded twice."""
    step = cfg.batch_size * cfg.batches_per_split
    if row_group_rows and row_group_rows % cfg.batch_size == 0:
        step = row_group_rows * max(1, round(step / row_group_rows))
    return [(lo, min(lo + step, num_rows)) for lo in range(0, num_rows, step)]


def process_split(
    wh_uri: str,
    ds: str,
    lo: int,
    hi: int,
    prep_json: str,
    out_path: str,
    valid_path: str | None = None,
    valid_rows: np.ndarray | None = None,
    pin: tuple | None = None,
) -> dict:
    """Transform rows [lo, hi) into one shard file, and the split's validation rows
    (`valid_rows`: a mask over [lo, hi)) into `valid_path` (runs in a worker: local pool or
    Ray), reading the samples at the version the stage pinned (`pin`)."""
    t0 = time.perf_counter()
    prep = Prepared.from_json(prep_json)
    wh = Warehouse(wh_uri).adopt(pin)
    rows, side = read_split(wh, ds, lo, hi, prep)
    mask = np.zeros(rows.num_rows, bool)
    if valid_path is not None and valid_rows is not None:
        mask = np.asarray(valid_rows, bool)
    n_batches = _write_batches(wh, out_path, rows, ~mask, prep, side)
    n_valid = _write_batches(wh, valid_path, rows, mask, prep, side) if mask.any() else 0
    return {
        "batches": n_batches,
        "samples": int((~mask).sum()),
        "valid_batches": n_valid,
        "valid_samples": int(mask.sum()),
        "seconds": time.perf_counter() - t0,
    }


def read_split(
    wh: Warehouse, ds: str, lo: int, hi: int, prep: Prepared
) -> tuple[pa.Table, pa.Table | None]:
    """Rows [lo, hi) for encoding, and the grouped columns as stored once per session run
    where dedup can use them (session method, normalized partition): the rows then carry
    `_side_row` instead of the grouped columns, which are never decoded per sample. Otherwise
    whole rows and None (baseline mode reads whole rows, as a pipeline without RecD does)."""
    grouped = [k for ks in prep.groups.values() for k in ks]
    normalized = wh.normalized_columns("samples", ds, layout="clustered")
    if not (prep.dedup_method == "session" and grouped and set(grouped) <= set(normalized)):
        return wh.read_range("samples", ds, lo, hi, layout="clustered"), None
    stored = wh.read_range_normalized("samples", ds, lo, hi, layout="clustered")
    rows, index = stored.rows, pa.array(stored.index, pa.int32())
    others = [c for c in normalized if c not in grouped]  # per-sample user-side, e.g. dense
    if others:
        taken = stored.side.select(others).take(index)
        for c in others:
            rows = rows.append_column(taken.schema.field(c), taken[c])
    return rows.append_column(SIDE_ROW, index), stored.side.select(grouped)


def _write_batches(
    wh: Warehouse,
    path: str,
    rows: pa.Table,
    keep: np.ndarray,
    prep: Prepared,
    side: pa.Table | None = None,
) -> int:
    """Encode the kept rows into one Arrow IPC file, a record batch per batch; the number
    of batches."""
    opts = ipc.IpcWriteOptions(
        compression=None if prep.cfg.compression == "none" else prep.cfg.compression
    )
    n_batches = 0
    with contextlib.ExitStack() as stack:
        writer = None
        for rb in encode_batches(rows, keep, prep, prep.cfg.batch_size, side):
            if writer is None:  # no batch, no file: the manifest lists the files written
                sink = stack.enter_context(wh.fs.open_output_stream(path))
                writer = stack.enter_context(ipc.new_file(sink, rb.schema, options=opts))
            writer.write_batch(rb)
            n_batches += 1
    return n_batches


def validation_rows(warehouse: Warehouse, ds: str, cfg: PreprocessConfig) -> np.ndarray | None:
    """Which rows of the partition are validation (a mask in partition order): the latest
    `validation_fraction` of the rows by time (`validation_by: time`), or of each user's
    rows (`user`). None when the fraction is 0 or nothing would be left to train on."""
    if cfg.validation_fraction <= 0:
        return None
    cols = ["ts", "event_id"] + (["user_id"] if cfg.validation_by == "user" else [])
    t = warehouse.read("samples", ds, cols, layout="clustered")
    if t.num_rows < 2:
        return None
    ts, eid = np.asarray(t["ts"], np.int64), np.asarray(t["event_id"], np.int64)
    group = np.asarray(t["user_id"], np.int64) if cfg.validation_by == "user" else np.zeros_like(ts)
    order = np.lexsort((eid, ts, group))  # by group, then time (event id breaks ties)
    g = group[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    counts = np.diff(np.r_[starts, g.size])
    rank = np.arange(g.size) - np.repeat(starts, counts)
    keep = np.repeat(np.ceil(counts * (1 - cfg.validation_fraction)).astype(np.int64), counts)
    mask = np.zeros(g.size, bool)
    mask[order] = rank >= keep
    return mask if 0 < mask.sum() < mask.size else None


def preprocess(
    warehouse: Warehouse,
    ds: str,
    cfg: PreprocessConfig,
    stats_from: str | None = None,
    progress=None,
    features: FeatureSet | None = None,
) -> dict:
    """Run DPP for one day from one version of its samples (pinned for the whole stage,
    however the splits are spread), refused when they are stale or, given the config's
    `features`, were built with another feature set (lineage.py); returns the summary
    (`dpp.*`)."""
    name = warehouse.partition_name("samples", ds, layout="clustered")
    with warehouse.pinned("samples", ds, layout="clustered"):
        reads = [name]
        if stats_from:
            reads.append(warehouse.partition_name("batches", stats_from, mode=cfg.mode))
        inputs, stored = check_reads(warehouse, "preprocess", reads, features)
        lineage = record("preprocess", inputs, cfg, stored)
        return _preprocess(warehouse, ds, cfg, stats_from, progress, lineage)


def _preprocess(
    warehouse: Warehouse,
    ds: str,
    cfg: PreprocessConfig,
    stats_from: str | None,
    progress,
    lineage: dict,
) -> dict:
    t0 = time.perf_counter()
    info = warehouse.info("samples", ds, layout="clustered")
    raw = check_samples_schema(warehouse, ds)
    asked = cfg.batch_size
    cfg = cfg.model_copy(update={"batch_size": scaled_batch_size(info.rows, cfg)})
    try:
        dense_cols = [f.name for f in raw.features if f.kind == "dense"]
        # statistics need the dense columns only; the dedup profile the first batches
        dense = (
            warehouse.read("samples", ds, columns=dense_cols, layout="clustered")
            if dense_cols
            else None
        )
        profile_rows = min(info.rows, cfg.dedup.profile_batches * cfg.batch_size)
        head = warehouse.read_range("samples", ds, 0, profile_rows, layout="clustered")
    except (pa.ArrowException, OSError) as e:
        raise PreprocessError(f"cannot read samples/layout=clustered/ds={ds}: {e}") from None
    stats = (
        warehouse.manifest("batches", stats_from, mode=cfg.mode)["prepared"]["stats"]
        if stats_from
        else None
    )
    prep = prepare(head, raw, cfg, stats, dense)
    splits = split_ranges(
        info.rows, cfg, warehouse.row_group_rows("samples", ds, layout="clustered")
    )
    valid = validation_rows(warehouse, ds, cfg)
    with warehouse.writing("batches", ds, mode=cfg.mode) as w:
        paths = [w.path(f"shard-{i:05d}.arrow") for i in range(len(splits))]
        valid_paths: list[str | None] = [None] * len(splits)
        if valid is not None:
            valid_paths = [w.path(f"valid-{i:05d}.arrow") for i in range(len(splits))]
        args = [
            (
                warehouse.uri,
                ds,
                lo,
                hi,
                prep.to_json(),
                p,
                v,
                None if valid is None else valid[lo:hi],
                warehouse.pin_token("samples", ds, layout="clustered"),
            )
            for (lo, hi), p, v in zip(splits, paths, valid_paths, strict=True)
        ]
        results = run_splits(args, cfg, progress)
        # exactly the files written: a split may hold no training or no validation rows
        # (one long session, small row groups), and then writes no file of that kind
        for p, v, r in zip(paths, valid_paths, results, strict=True):
            for path, n in ((p, r["batches"]), (v, r["valid_batches"])):
                if path is not None and n:
                    w.add_file(path.rsplit("/", 1)[-1])
        samples = sum(r["samples"] for r in results)
        valid_samples = sum(r["valid_samples"] for r in results)
        w.rows = samples + valid_samples
        w.extra = {
            "format": "recd.batches/2 (see recd_core/dpp/preprocess.py)",
            "mode": cfg.mode,
            "batch_size": cfg.batch_size,
            "batch_size_asked": asked,  # what training asks for (`min_steps_per_pass`)
            "batches": sum(r["batches"] for r in results),
            "samples": samples,
            "batches_per_shard": [r["batches"] for r in results],
            "validation": {
                "by": cfg.validation_by,
                "fraction": cfg.validation_fraction,
                "batches": sum(r["valid_batches"] for r in results),
                "samples": valid_samples,
            },
            "prepared": json.loads(prep.to_json()),
            "lineage": lineage,
        }
    seconds = time.perf_counter() - t0
    work = sum(r["seconds"] for r in results)
    return {
        "dpp.mode": cfg.mode,
        "dpp.samples": samples + valid_samples,
        "dpp.validation_samples": valid_samples,
        "dpp.batches": w.extra["batches"],
        "dpp.samples_per_s": (samples + valid_samples) / seconds if seconds > 0 else 0.0,
        "dpp.worker_samples_per_s": (samples + valid_samples) / work if work > 0 else 0.0,
        "dpp.bytes_out": w.info.bytes,
        "dpp.seconds": seconds,
        "dpp.workers": cfg.workers,
        "dpp.engine": cfg.engine,
        "dpp.dedup_groups": {g: len(k) for g, k in prep.groups.items()},
        "dpp.dedup_method": prep.dedup_method if prep.groups else None,
    }


def run_splits(args: list[tuple], cfg: PreprocessConfig, progress=None) -> list[dict]:
    if cfg.engine == "ray":
        from recd_core.ray_cluster import ordered_map

        return list(ordered_map(process_split, args, cfg.workers))
    if cfg.workers == 1:
        out = []
        for a in args:
            out.append(process_split(*a))
            if progress:
                progress("split", 1)
        return out
    import multiprocessing as mp
    from concurrent.futures import ThreadPoolExecutor

    pool = (
        ThreadPoolExecutor(cfg.workers)
        if cfg.executor == "thread"
        else ProcessPoolExecutor(
            cfg.workers,
            mp_context=mp.get_context("spawn"),
            initializer=die_with_parent,
            initargs=(os.getpid(),),
        )
    )
    with pool:
        futures = [pool.submit(process_split, *a) for a in args]
        out = []
        for f in futures:  # in split order
            out.append(f.result())
            if progress:
                progress("split", 1)
        return out


def make_batch(rows: pa.Table, features: FeatureSet, plan: DedupPlan | None) -> Batch:
    """A slice of samples as one training batch in memory, through DPP's own encode and
    decode (ids hashed into their tables, dense values as they are; `plan=None` is the
    baseline, every feature per sample; unique rows found by hashing, any row order): what
    tests and benchmarks build batches with, without writing them to the warehouse."""
    from recd_core.config import DedupConfig, TransformSpec

    groups = {g: fs for g, fs in plan.groups.items() if fs} if plan else {}
    cfg = PreprocessConfig(
        mode="dedup" if groups else "baseline",
        default_dense=TransformSpec(),
        dedup=DedupConfig(method="hash"),
    )
    prep = Prepared(features, features, groups, {}, cfg, dedup_method="hash")
    return decode_batch(encode_batch(rows, prep), features, groups)
