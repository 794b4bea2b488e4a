"""`recd generate`: a day's events -> training samples, in RecD's layout or the baseline's.

  clustered  the rows of a session contiguous; sessions ordered by user, then start time
             (RecD). Consecutive rows repeat the same user-side values, so Parquet's
             compression sees the repeats within a page, and every training batch of
             contiguous rows holds many duplicates.
  shuffled   a seeded random order (the usual training-data layout: the baseline).

Both are Parquet (zstd, dictionary encoding, tunable row groups). Where ingest checked the
sessions, the clustered layout is stored session-normalized (`normalize_sessions`): each
data file's row group keeps the per-sample columns and a `_side_row` index, and its side
file's row group the user-side features once per session run (warehouse.py's module doc);
readers through the warehouse get whole rows, DPP's dedup reads the runs as stored. The
summary reports the partition's bytes, the dedup profile at the configured batch size and
the storage lower bound: the bytes of the same samples with each session's user-side
features stored once (a per-session table plus a per-sample table, written with the same
options, in one row group per 65,536 sessions).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recd_core.config import FeatureSet, GenerateConfig
from recd_core.dedup.unique import batch_factors, combine_hashes, row_hashes, unique_sessions
from recd_core.errors import BadInput
from recd_core.leftovers import owned_tempdir
from recd_core.lineage import check_reads, record
from recd_core.ray_cluster import ordered_map, ray_session
from recd_core.schema import SIDE_ROW, feature_set_of, sessions_checked
from recd_core.stored_files import open_parquet, read_batches
from recd_core.warehouse import Warehouse

LAYOUTS = ("clustered", "shuffled")


def session_clustered_order(table: pa.Table, user_key: str) -> np.ndarray:
    """Row order: by user, then session start time, then session, then time within it."""
    sid = np.asarray(table["session_id"])
    ts = np.asarray(table["ts"])
    user = np.asarray(table[user_key])
    eid = np.asarray(table["event_id"])
    by_session = np.lexsort((ts, sid))
    s_sorted = sid[by_session]
    first = np.concatenate([[True], s_sorted[1:] != s_sorted[:-1]])
    group = np.cumsum(first) - 1
    start = ts[by_session][first][group]  # session start, per row in by_session order
    session_start = np.empty_like(ts)
    session_start[by_session] = start
    return np.lexsort((eid, ts, sid, session_start, user))


def layout_order(table: pa.Table, features: FeatureSet, layout: str, seed: int) -> np.ndarray:
    if layout == "clustered":
        return session_clustered_order(table, features.user_key)
    if layout == "shuffled":
        return np.random.default_rng(seed).permutation(table.num_rows)
    raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


def write_samples(
    warehouse: Warehouse, ds: str, layout: str, samples: pa.Table, cfg: GenerateConfig
):
    """Publish `samples/layout=<layout>/ds=<ds>` with the layout's Parquet options; the
    committed writer (its `info`: files, rows, bytes)."""
    opts = parquet_options(cfg, samples.schema, layout)
    with warehouse.writing("samples", ds, layout=layout) as w:
        w.write(samples, max_rows_per_file=cfg.max_rows_per_file, **opts)
    return w


def parquet_options(cfg: GenerateConfig, schema: pa.Schema, layout: str) -> dict:
    list_dict = cfg.list_dictionary if cfg.list_dictionary is not None else layout != "clustered"
    is_list = [pa.types.is_list(f.type) for f in schema]
    return {
        **cfg.options(),
        "use_dictionary": True
        if list_dict
        else [f.name for f, lst in zip(schema, is_list, strict=True) if not lst],
    }


class _Bound:
    """The storage lower bound, measured as the clustered rows stream by: each session's
    user-side features once (a per-session table) plus the per-sample rest, written with the
    layout's options to byte-counting sinks (nothing is kept)."""

    def __init__(self, schema: pa.Schema, user_cols: list[str], cfg: GenerateConfig):
        self.user_cols, self.cfg, self.last_session = user_cols, cfg, None
        self.pending: list[list[pa.Table]] = [[], []]
        meta = schema.metadata  # the feature set travels in the footer, as in the samples
        sessions = pa.schema(
            [schema.field("session_id"), *(schema.field(c) for c in user_cols)], metadata=meta
        )
        per_sample = pa.schema([f for f in schema if f.name not in user_cols], metadata=meta)
        self.sinks = [pa.MockOutputStream(), pa.MockOutputStream()]
        self.writers = [
            self._writer(sink, sch)
            for sink, sch in zip(self.sinks, (sessions, per_sample), strict=True)
        ]

    def _writer(self, sink, schema: pa.Schema) -> pq.ParquetWriter:
        opts = parquet_options(self.cfg, schema, "clustered")
        opts.pop("row_group_size")
        return pq.ParquetWriter(sink, schema, **opts)

    def add(self, clustered: pa.Table) -> None:
        sid = np.asarray(clustered["session_id"])
        first = np.concatenate([[sid[0] != self.last_session], sid[1:] != sid[:-1]])
        self.last_session = sid[-1]
        sessions = clustered.select(["session_id", *self.user_cols]).filter(pa.array(first))
        self._write(0, sessions)
        self._write(1, clustered.drop_columns(self.user_cols))

    def _write(self, i: int, rows: pa.Table | None) -> None:
        """Write whole row groups, as one `write_table` of all the rows would; keep the rest
        for the next call (None: flush)."""
        rgs = self.cfg.row_group_size
        pending = self.pending[i] = [*self.pending[i], *([rows] if rows is not None else [])]
        n = sum(t.num_rows for t in pending)
        cut = n if rows is None else n // rgs * rgs
        if cut == 0:
            return
        table = pa.concat_tables(pending)
        # one chunk: Arrow's writer also cuts a row group at every chunk boundary
        self.writers[i].write_table(table.slice(0, cut).combine_chunks(), row_group_size=rgs)
        self.pending[i] = [table.slice(cut)] if cut < n else []

    def bytes(self) -> int:
        for i, w in enumerate(self.writers):
            self._write(i, None)
            w.close()
        return int(sum(s.size() for s in self.sinks))


class _Profile:
    """Per-batch dedup factors of one output file's rows, accumulated bucket by bucket.
    Batches are `batch_size` consecutive rows of the whole layout, wherever files and buckets
    cut: the rows before the file's first batch boundary (`head`) and after its last (`tail`)
    are kept as hashes for `merge_profiles` to join with the neighbouring files'."""

    def __init__(self, features: list[str], user_cols: list[str], batch_size: int, start: int):
        self.features, self.user_cols, self.bs = features, user_cols, batch_size
        self.head_left = -start % batch_size  # rows until the first batch boundary
        keys = [*features, "user_group"]
        self.head: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        self.pending = {k: np.zeros(0, np.uint64) for k in keys}
        self.factors: dict[str, list[np.ndarray]] = {k: [] for k in keys}

    def add(self, rows: pa.Table) -> None:
        hashes = {f: row_hashes(rows[f]) for f in self.features}
        hashes["user_group"] = combine_hashes([hashes[c] for c in self.user_cols], rows.num_rows)
        take = min(self.head_left, rows.num_rows)
        self.head_left -= take
        for k, h in hashes.items():
            self.head[k].append(h[:take])
            h = np.concatenate([self.pending[k], h[take:]])
            full = h.size // self.bs * self.bs
            self.factors[k].append(batch_factors(h[:full], self.bs))
            self.pending[k] = h[full:]

    def piece(self) -> dict:
        """What `merge_profiles` needs of this file: its head and tail hashes, the factors of
        the batches in between, and whether the head reached a batch boundary."""
        return {
            "head": {k: np.concatenate([np.zeros(0, np.uint64), *v]) for k, v in self.head.items()},
            "factors": {
                k: np.concatenate(v) if v else np.zeros(0) for k, v in self.factors.items()
            },
            "tail": self.pending,
            "closed": self.head_left == 0,
        }


def merge_profiles(pieces: list[dict], batch_size: int) -> dict[str, float]:
    """The mean per-batch factor of each feature over the files' `_Profile` pieces, in order:
    a batch that straddles files is measured on its joined hashes."""
    keys = pieces[0]["head"].keys() if pieces else ()
    out = {}
    for k in keys:
        pending, factors = np.zeros(0, np.uint64), []
        for piece in pieces:
            joined = np.concatenate([pending, piece["head"][k]])
            if not piece["closed"]:  # the file ended before the batch did
                pending = joined
                continue
            if joined.size:
                factors.append(batch_factors(joined, batch_size))
            factors.append(piece["factors"][k])
            pending = piece["tail"][k]
        factors.append(batch_factors(pending, batch_size))  # the last, partial batch
        every = np.concatenate(factors)
        out[k] = float(every.mean()) if every.size else 0.0
    return out


def _keys(warehouse: Warehouse, ds: str, user_key: str) -> pa.Table:
    """The columns the layouts' orders need: ~32 bytes a row."""
    return warehouse.read("events", ds, columns=["event_id", "ts", "session_id", user_key])


def _bucket_rows(warehouse: Warehouse, ds: str, budget_bytes: int, multiple: int) -> int:
    """Rows an output bucket may hold in memory: the budget over ~3 copies of a row (the
    bucket, its sorted copy, the writer's buffers), a multiple of the row-group size."""
    files = warehouse.files("events", ds)
    pf = open_parquet(warehouse.fs, files[0])
    if pf.metadata.num_row_groups == 0 or pf.metadata.num_rows == 0:
        return multiple
    sample = pf.read_row_group(0)
    per_row = max(sample.nbytes / max(sample.num_rows, 1), 1.0)
    return max(1, int(budget_bytes / (3 * per_row)) // multiple) * multiple


def _piece_name(file: int, bucket: int, source: int) -> str:
    return f"f{file:05d}-b{bucket:05d}-s{source:05d}.arrow"


def spill_source(
    uri: str, path: str, position: np.ndarray, file_rows: int, bucket: int, spill: str, source: int
) -> None:
    """Distribute one events file's rows to spill pieces (Arrow IPC, lz4), one per output
    file and bucket of it they land in, each row tagged with its position in the layout.
    `position`: the layout position of each of the file's rows. A task of its own on Ray."""
    fs = Warehouse(uri).fs
    writers: dict[tuple[int, int], pa.ipc.RecordBatchStreamWriter] = {}
    options = pa.ipc.IpcWriteOptions(compression="lz4")
    start = 0
    try:
        for batch in read_batches(fs, path, 65_536):
            pos = position[start : start + batch.num_rows]
            start += batch.num_rows
            file, bucket_of = pos // file_rows, pos % file_rows // bucket
            key = file * (file_rows // bucket + 1) + bucket_of
            by_key = np.argsort(key, kind="stable")  # one take, then a slice each
            batch = batch.append_column("_pos", pa.array(pos)).take(pa.array(by_key))
            _, starts = np.unique(key[by_key], return_index=True)
            ends = np.append(starts[1:], batch.num_rows)
            for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
                f, b = int(file[by_key[lo]]), int(bucket_of[by_key[lo]])
                if (f, b) not in writers:
                    sink = pa.OSFile(f"{spill}/{_piece_name(f, b, source)}", "wb")
                    writers[f, b] = pa.ipc.new_stream(sink, batch.schema, options=options)
                writers[f, b].write_batch(batch.slice(lo, hi - lo))
    finally:
        for w in writers.values():
            w.close()


def _bucket(spill: str, file: int, bucket: int, sources: int) -> pa.Table | None:
    """One bucket's rows, read back from its pieces and sorted by layout position."""
    parts = []
    for source in range(sources):
        path = Path(spill) / _piece_name(file, bucket, source)
        if path.exists():
            with pa.OSFile(str(path), "rb") as f:
                parts.append(pa.ipc.open_stream(f).read_all())
            path.unlink()
    if not parts:
        return None
    t = pa.concat_tables(parts)
    pos = np.asarray(t["_pos"])
    return t.drop_columns(["_pos"]).take(pa.array(np.argsort(pos, kind="stable")))


def write_file(
    uri: str,
    path: str | None,
    spill: str,
    file: int,
    start: int,
    rows: int,
    bucket: int,
    sources: int,
    schema: pa.Schema,
    cfg: GenerateConfig,
    layout: str,
    bound: bool,
    side_path: str | None = None,
) -> dict:
    """One output file of a layout: its rows from the spill pieces, a bucket at a time, written
    to `path` (None: not written, only measured; with `side_path`, session-normalized), the
    file's dedup-profile piece and, for the clustered order (`bound`), the file's storage
    lower bound. A task of its own on Ray."""
    features = feature_set_of(schema)
    names = [f.name for f in features.features]
    user_cols = [f.name for f in features.by_side("user")]
    profile = _Profile(names, user_cols, cfg.batch_size, start)
    measure = _Bound(schema, user_cols, cfg) if bound else None
    fs = Warehouse(uri).fs
    writer = None
    if path and side_path:
        writer = _NormalizedWriter(fs, path, side_path, schema, user_cols, cfg, layout)
    elif path:
        writer = _PlainWriter(fs, path, schema, cfg, layout)
    try:
        for b in range(-(-rows // bucket)):
            t = _bucket(spill, file, b, sources)
            if t is None:
                continue
            t = t.replace_schema_metadata(schema.metadata)
            if writer is not None:
                writer.write(t)
                profile.add(t)
            if measure is not None:
                measure.add(t)
    finally:
        if writer is not None:
            writer.close()
    return {"profile": profile.piece(), "bound": measure.bytes() if measure is not None else 0}


class _PlainWriter:
    def __init__(self, fs, path: str, schema: pa.Schema, cfg: GenerateConfig, layout: str):
        opts = parquet_options(cfg, schema, layout)
        self.rgs = opts.pop("row_group_size")
        self.writer = pq.ParquetWriter(path, schema, filesystem=fs, **opts)

    def write(self, t: pa.Table) -> None:
        self.writer.write_table(t, row_group_size=self.rgs)

    def close(self) -> None:
        self.writer.close()


class _NormalizedWriter:
    """The same row groups as `_PlainWriter`, stored session-normalized: each row group's
    per-sample columns and `_side_row` in the data file, the user-side values of each session
    run in it (a run cut by the row group starts anew) as the side file's row group."""

    def __init__(
        self,
        fs,
        path: str,
        side_path: str,
        schema: pa.Schema,
        user_cols: list[str],
        cfg: GenerateConfig,
        layout: str,
    ):
        self.user_cols, meta = user_cols, schema.metadata
        rows = pa.schema(
            [*(f for f in schema if f.name not in user_cols), pa.field(SIDE_ROW, pa.int32())],
            metadata=meta,
        )
        side = pa.schema([schema.field(c) for c in user_cols], metadata=meta)
        self.rows_schema, self.side_schema = rows, side
        opts = parquet_options(cfg, schema, layout)
        self.rgs = opts.pop("row_group_size")
        self.rows = pq.ParquetWriter(path, rows, filesystem=fs, **parquet_options_for(opts, rows))
        self.side = pq.ParquetWriter(
            side_path, side, filesystem=fs, **parquet_options_for(opts, side)
        )

    def write(self, t: pa.Table) -> None:
        for lo in range(0, t.num_rows, self.rgs):
            chunk = t.slice(lo, self.rgs).combine_chunks()
            first, run = unique_sessions(np.asarray(chunk["session_id"]))
            index = pa.array(run.astype(np.int32))
            rows = chunk.drop_columns(self.user_cols).append_column(SIDE_ROW, index)
            side = chunk.select(self.user_cols).take(pa.array(first))
            self.rows.write_table(rows.cast(self.rows_schema), row_group_size=self.rgs)
            self.side.write_table(side.cast(self.side_schema), row_group_size=max(side.num_rows, 1))

    def close(self) -> None:
        self.rows.close()
        self.side.close()


def parquet_options_for(opts: dict, schema: pa.Schema) -> dict:
    """`opts` with a per-column dictionary list narrowed to `schema`'s columns."""
    d = opts.get("use_dictionary")
    if isinstance(d, list):
        return {**opts, "use_dictionary": [c for c in d if c in schema.names] or False}
    return opts


def _write_layout(
    warehouse: Warehouse,
    ds: str,
    order: np.ndarray,
    layout: str,
    w,
    cfg: GenerateConfig,
    schema: pa.Schema,
    bucket: int,
    spill: Path,
    bound: bool,
    normalize: bool = False,
) -> list[dict]:
    """The events partition's rows in `order`, written as the layout's files (into `w`, a
    partition writer; None: measured only), in bounded memory: one pass distributes every
    events file's rows to spill pieces, then each output file is written from its pieces a
    bucket at a time (`spill_source`, `write_file`: the tasks of the Ray engine)."""
    n = order.size
    position = np.empty(n, np.int64)
    position[order] = np.arange(n)
    sources = warehouse.files("events", ds)
    counts = [open_parquet(warehouse.fs, s).metadata.num_rows for s in sources]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    file_rows = min(cfg.max_rows_per_file, max(n, 1))
    bucket = min(bucket, file_rows)
    spills = [
        (
            warehouse.uri,
            src,
            position[offsets[i] : offsets[i + 1]],
            file_rows,
            bucket,
            str(spill),
            i,
        )
        for i, src in enumerate(sources)
    ]
    files = []
    normalize = normalize and w is not None
    if normalize:
        user_cols = [f.name for f in feature_set_of(schema).by_side("user")]
        w.normalize(user_cols, SIDE_ROW, schema.names)
    for f, lo in enumerate(range(0, max(n, 1), file_rows)):
        rows = min(file_rows, n - lo)
        name = f"part-{f:05d}-{w.write_id}.parquet" if w is not None else None
        path = w.add_file(name, rows) if w is not None else None
        side = w.add_side_file(name) if normalize else None
        files.append(
            (
                warehouse.uri,
                path,
                str(spill),
                f,
                lo,
                rows,
                bucket,
                len(sources),
                schema,
                cfg,
                layout,
                bound,
                side,
            )
        )
    if cfg.engine == "ray":
        list(ordered_map(spill_source, spills, cfg.workers))
        return list(ordered_map(write_file, files, cfg.workers))
    for args in spills:
        spill_source(*args)
    return [write_file(*args) for args in files]


def generate(
    warehouse: Warehouse,
    ds: str,
    cfg: GenerateConfig,
    layouts: tuple[str, ...] = ("clustered",),
    progress=None,
    features: FeatureSet | None = None,
) -> dict:
    """Write `samples/layout=<L>/ds=<ds>` for each layout from one version of the day's
    events (pinned for the whole stage), refused when they are stale or, given the
    config's `features`, were built with another feature set (lineage.py); each layout's
    manifest records what it was built from."""
    spill = cfg.spill_dir
    if spill and not (Path(spill).is_dir() and os.access(spill, os.W_OK | os.X_OK)):
        why = "not a directory" if not Path(spill).is_dir() else "not writable"
        raise BadInput(
            f"generate.spill_dir {spill}: {why} (create it, or leave spill_dir "
            "unset for the system's temporary directory)"
        )
    name = warehouse.partition_name("events", ds)
    with warehouse.pinned("events", ds):
        inputs, stored = check_reads(warehouse, "generate", [name], features)
        lineage = record("generate", inputs, cfg, stored)
        return _generate(warehouse, ds, cfg, layouts, progress, lineage)


def _generate(
    warehouse: Warehouse,
    ds: str,
    cfg: GenerateConfig,
    layouts: tuple[str, ...],
    progress,
    lineage: dict,
) -> dict:
    """Write `samples/layout=<L>/ds=<ds>` for each layout; return the summary.

    Streams in bounded memory (`cfg.memory_budget_mb`): only the order keys (~32 bytes a
    row) are held for the whole day; rows move through spill files (`cfg.spill_dir`), a
    bucket at a time (see `_write_layout`), and every figure is accumulated as the rows pass.
    `cfg.engine == "ray"`: the spilling and the files are Ray tasks; the output is the same."""
    t0 = time.perf_counter()
    schema = warehouse.read_schema("events", ds)
    features = feature_set_of(schema)
    names = [f.name for f in features.features]
    list_features = [f.name for f in features.features if f.is_list]
    keys = _keys(warehouse, ds, features.user_key)
    sessions = int(len(np.unique(np.asarray(keys["session_id"]))))
    bucket = _bucket_rows(warehouse, ds, cfg.memory_budget_mb << 20, cfg.row_group_size)
    summary: dict = {"generate.layouts": list(layouts), "generate.engine": cfg.engine}
    per_layout: dict[str, dict] = {}
    bound = None
    ray = contextlib.nullcontext()
    if cfg.engine == "ray":
        ray = ray_session(cfg.workers)  # one instance for every map below
    # a spill directory of its own; a killed generate's are removed first (leftovers.py)
    with ray, owned_tempdir("recd-generate-", cfg.spill_dir) as tmp:
        for layout in (*layouts, *(() if "clustered" in layouts else ("bound",))):
            order = layout_order(
                keys, features, "clustered" if layout == "bound" else layout, cfg.shuffle_seed
            )
            measure = layout in ("clustered", "bound")
            writing = (
                contextlib.nullcontext()
                if layout == "bound"  # measured, not written
                else warehouse.writing("samples", ds, layout=layout)
            )
            with writing as w:
                if w is not None:
                    w.extra["lineage"] = lineage
                normalize = (
                    layout == "clustered" and cfg.normalize_sessions and sessions_checked(schema)
                )
                files = _write_layout(
                    warehouse,
                    ds,
                    order,
                    layout,
                    w,
                    cfg,
                    schema,
                    bucket,
                    Path(tmp),
                    measure,
                    normalize,
                )
            if measure:
                bound = sum(f["bound"] for f in files)
            if w is None:
                continue
            factors = merge_profiles([f["profile"] for f in files], cfg.batch_size)
            per_layout[layout] = {
                "storage.bytes": w.info.bytes,
                "storage.rows": w.info.rows,
                "storage.bytes_per_sample": w.info.bytes / max(w.info.rows, 1),
                "storage.sessions": sessions,
                "storage.files": len(w.info.files),
                "storage.kept": w.kept is not None,  # built from the same events: unchanged
                **{f"dedup.factor.{k}": factors[k] for k in names},
                # the mean over list features: where dedup saves work (transforms, pooling, the
                # history encoder); scalar ids like gender would swamp it with huge factors.
                "dedup.factor.mean": float(np.mean([factors[f] for f in list_features]))
                if list_features
                else 1.0,
                "dedup.factor.user_group": factors["user_group"],
            }
            if progress:
                progress(layout, 1)
    for stats in per_layout.values():
        stats["storage.lower_bound_bytes"] = bound
        stats["storage.bytes_over_lower_bound"] = stats["storage.bytes"] / bound if bound else 0.0
    # The requested (first) layout's figures use the contract keys at the top level.
    summary.update(per_layout[layouts[0]])
    if len(layouts) > 1:
        summary["layouts"] = per_layout
    if {"clustered", "shuffled"} <= per_layout.keys():
        summary["storage.ratio"] = (
            per_layout["shuffled"]["storage.bytes"] / per_layout["clustered"]["storage.bytes"]
        )
    summary["generate.seconds"] = time.perf_counter() - t0
    summary["generate.batch_size"] = cfg.batch_size
    summary["generate.bucket_rows"] = bucket
    return summary
