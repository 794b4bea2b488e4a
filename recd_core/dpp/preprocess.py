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

Batch format (Arrow IPC, never pickle): a shard file `shard-NNNNN.arrow` per split, a
record batch per training batch, laid out as dpp/encode.py draws it.

The manifest (`_manifest.json`) adds: the model's feature set (after transforms), the dedup
plan, the standardization statistics, batch size, counts and the click rate.

Parallelism: a split is `batches_per_split` consecutive batches, fixed by the data and the
config, never by the number of workers, so the output is the same whatever `--workers`:
`local` runs splits on a process pool, `ray` on Ray Data; shards are listed in split order.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from recd_core.config import FeatureSet, PreprocessConfig
from recd_core.dedup.unique import DedupPlan, plan_dedup, session_plan
from recd_core.dpp.encode import Prepared, dense_matrix, encode_batches
from recd_core.dpp.transforms import dense_stats, model_spec, pre_standardize
from recd_core.errors import BadInput
from recd_core.lineage import check_reads, record
from recd_core.ray_cluster import ordered_map
from recd_core.runtime import die_with_parent
from recd_core.schema import SIDE_ROW, events_schema, feature_set_of, sessions_checked
from recd_core.warehouse import Warehouse


class PreprocessError(BadInput, ValueError):
    """A samples partition or config DPP cannot work with (names the file and column)."""


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
    plan: DedupPlan | None = None,
) -> Prepared:
    """Check the config against the data; unless given, measure the dedup plan (on `table`,
    the first batches) and the standardization statistics (on `dense`, the whole
    partition's dense columns; default `table`)."""

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
        plan = plan or plan_dedup(table, raw, cfg.dedup, cfg.batch_size)
        groups = {g: fs for g, fs in plan.groups.items() if fs}
    return Prepared(
        raw, model, groups, stats, cfg, resolve_method(cfg.dedup.method, table.schema, raw, groups)
    )


def _plan_and_head(
    warehouse: Warehouse, ds: str, cfg: PreprocessConfig, raw: FeatureSet, profile_rows: int
) -> tuple[DedupPlan | None, pa.Table]:
    """What `prepare` reads of the first batches, and no more: where ingest checked the
    sessions, the dedup plan from their session ids alone (`session_plan`); the first
    batches' whole rows only where the plan must measure the features; otherwise the
    partition's schema (an empty table: the checks and the method need nothing else)."""
    schema = warehouse.read_schema("samples", ds, layout="clustered")
    measure = cfg.mode == "dedup" and cfg.dedup.groups is None
    plan = None
    if measure and sessions_checked(schema) and "session_id" in schema.names:
        ids = warehouse.read_range(
            "samples", ds, 0, profile_rows, columns=["session_id"], layout="clustered"
        )
        plan = session_plan(np.asarray(ids["session_id"]), raw, cfg.dedup, cfg.batch_size)
    if measure and plan is None:
        return None, warehouse.read_range("samples", ds, 0, profile_rows, layout="clustered")
    return plan, schema.empty_table()


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
        plan, head = _plan_and_head(warehouse, ds, cfg, raw, profile_rows)
    except (pa.ArrowException, OSError) as e:
        raise PreprocessError(f"cannot read samples/layout=clustered/ds={ds}: {e}") from None
    stats = (
        warehouse.manifest("batches", stats_from, mode=cfg.mode)["prepared"]["stats"]
        if stats_from
        else None
    )
    prep = prepare(head, raw, cfg, stats, dense, plan)
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
        # each split's own (a worker's): the run's repeats of the figure (compare.py)
        "dpp.parts_samples_per_s": [
            (r["samples"] + r["valid_samples"]) / r["seconds"] for r in results if r["seconds"] > 0
        ],
        "dpp.bytes_out": w.info.bytes,
        "dpp.kept": w.kept is not None,  # built from the same samples: unchanged
        "dpp.seconds": seconds,
        "dpp.workers": cfg.workers,
        "dpp.engine": cfg.engine,
        "dpp.dedup_groups": {g: len(k) for g, k in prep.groups.items()},
        "dpp.dedup_method": prep.dedup_method if prep.groups else None,
    }


def run_splits(args: list[tuple], cfg: PreprocessConfig, progress=None) -> list[dict]:
    if cfg.engine == "ray":
        return list(ordered_map(process_split, args, cfg.workers))
    if cfg.workers == 1:
        out = []
        for a in args:
            out.append(process_split(*a))
            if progress:
                progress("split", 1)
        return out

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
