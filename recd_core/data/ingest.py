"""`recd ingest`: validate raw logs into `events/ds=D`, every rejected row into `quarantine/ds=D`.

Checks run on whole Arrow columns, never a Python loop over rows (data/checks.py lists
them; parsing is data/sources.py's, the event-id and session checks data/day_checks.py's).

The last two are day-wide; the others run file by file. Ingest streams: a file's clean rows
are written to staging as soon as it is parsed, and the day-wide checks run on ~45 bytes of
keys a row (see `ingest`), so memory does not grow with the day's rows.

A row is rejected for its first failing check, in schema order; `rows_in == rows_ok +
rows_quarantined` always holds. If the rejected fraction exceeds `max_quarantine_fraction`
the quarantine is still written (for inspection) but the events partition is not published.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recd_core.config import FeatureSet, IngestConfig, ParquetWrite
from recd_core.data.checks import DayWindow, validate
from recd_core.data.day_checks import (
    Drop,
    Part,
    duplicate_events,
    inconsistent_sessions,
    positions,
    published_ids,
    redelivered_events,
    user_hashes,
)
from recd_core.data.movielens import read_movielens
from recd_core.data.parquet_events import read_parquet_events
from recd_core.data.raw_bytes import FileRefused, ReadLimits, SourceError, path_text
from recd_core.data.sources import (
    SMALL_FILE,
    SMALL_FILES,
    Parsed,
    Rejects,
    raw_files_lines,
    raw_lines,
    read_json_files,
    read_json_lines,
    rows_as_json,
    sniff,
)
from recd_core.errors import GateFailed
from recd_core.lineage import EXECUTION_FIELDS, logs_digest, record
from recd_core.ray_cluster import ordered_map
from recd_core.schema import events_schema, mark_sessions_checked
from recd_core.warehouse import Warehouse, validate_ds


class QuarantineExceeded(GateFailed):
    """Too many rows were rejected: the events partition was not published; `summary` holds
    the day's counts."""


def list_source_files(source: Path) -> tuple[dict[Path, str], dict[str, str], dict[str, str]]:
    """The source's files to read, in name order, each with its format (`jsonl`, `parquet`);
    the ones refused, with why; the ones ignored, with why. Every file is named: a file is read where it lies inside the source directory and
    its content is JSON lines or Parquet (`sources.sniff`: any name, any case, rotated
    suffixes); a symlink that leads out of it (to `/etc/passwd`, another day) or a file of
    another format is refused (a quarantine record each: it counts toward the gate);
    hidden and marker files (`.x`, `_SUCCESS`) are ignored, and named in the summary."""
    if not source.exists():
        raise SourceError(f"source not found: {source}")
    if source.is_file():
        kind, why = sniff(source)
        if kind is None:
            raise SourceError(f"{source}: {why}")
        return {source: kind}, {}, {}
    root = os.path.realpath(source)
    found = []  # (parts of the path under source, path, inside the source once resolved)
    # os.walk, not Path.rglob: a day of 4,000 files was 0.8 s of pathlib objects
    for dirpath, dirnames, filenames in os.walk(source, followlinks=True):
        real_dir = os.path.realpath(dirpath)
        rel_dir = os.path.relpath(dirpath, source)
        dir_parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        if not _within(real_dir, root):  # a linked directory leading out: its files refused
            dirnames.clear()
        for name in filenames:
            full = os.path.join(dirpath, name)
            real = os.path.realpath(full) if os.path.islink(full) else os.path.join(real_dir, name)
            found.append(([*dir_parts, name], Path(full), _within(real, root)))
    files, refused, ignored = {}, {}, {}
    for parts, p, inside in sorted(found, key=lambda f: f[0]):
        if any(part.startswith((".", "_")) for part in parts):
            if p.is_file():
                ignored[path_text(p)] = "a hidden or marker file ('.' or '_'): not read"
            continue
        if not inside:
            refused[path_text(p)] = "a symlink that leads out of the source directory: not read"
        elif p.is_file():
            kind, why = sniff(p)
            if kind is None:
                refused[path_text(p)] = f"{why}: not read"
            else:
                files[p] = kind
    if not files and not refused:
        raise SourceError(
            f"no input files (JSON lines, gzip or zstd of them, or Parquet) under {source}"
        )
    return files, refused, ignored


def _parse(
    paths: list[Path],
    kind: str,
    schema: pa.Schema,
    features: FeatureSet,
    user_cols: list[str],
    limits: ReadLimits,
    window: DayWindow | None,
    sink=None,
) -> list[tuple[Parsed, Rejects, np.ndarray, str | None, list[Path]]]:
    """One parse unit's work (a source file, or a run of small JSON-lines files read as one
    text), in a parsing thread (or a Ray task): read, validate, hash the user-side values
    for the session check, and with a `sink` write the clean rows as the unit's events file
    (its name; None when the rows are left to the caller). Per text parsed: those four and
    the files behind it. A file refused as a whole comes back as no rows and one
    quarantine record saying why."""
    shared = [f.name for f in features.by_side("user")]  # a session's: parsed once
    texts: list[tuple[Path | list[Path], tuple[Parsed, Rejects] | None]] = []
    if len(paths) > 1:
        parsed, rejects, kept, alone = read_json_files(paths, schema, shared, limits)
        texts = [(kept, (parsed, rejects))] if kept else []
        texts += [([p], None) for p in alone]
    else:
        texts = [(paths, None)]
    out = []
    for files, done in texts:
        try:
            if done is not None:
                parsed, rejects = done
            elif kind == "parquet":
                parsed, rejects = read_parquet_events(files[0], schema, limits)
            else:
                parsed, rejects = read_json_lines(files[0], schema, shared, limits)
        except FileRefused as e:
            out.append(
                (*refused_file(path_text(files[0]), str(e), schema), _no_rows(), None, files)
            )
            continue
        parsed, bad = validate(parsed, features, window)
        rejects.extend(bad)
        user = user_hashes(parsed.table, user_cols)
        file = sink(parsed.table, len(out)) if sink and parsed.table.num_rows else None
        out.append((parsed, rejects, user, file, files))
    return out


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def parse_units(files: dict[Path, str]) -> list[tuple[list[Path], str]]:
    """The source files as parse units, in file order: each file alone, except runs of
    consecutive small JSON-lines files (`sources.SMALL_FILE` each, `SMALL_FILES` together),
    which are read as one text: a thousand one-line files cost about what one file of a
    thousand lines does, not a thousand parses and Parquet files."""
    units: list[tuple[list[Path], str]] = []
    run: list[Path] = []
    run_bytes = 0
    for path, kind in files.items():
        size = path.stat().st_size if kind == "jsonl" else SMALL_FILE + 1
        if size <= SMALL_FILE and run_bytes + size <= SMALL_FILES:
            run.append(path)
            run_bytes += size
            continue
        if run:
            units.append((run, "jsonl"))
        run, run_bytes = ([path], size) if size <= SMALL_FILE else ([], 0)
        if not run:
            units.append(([path], kind))
    if run:
        units.append((run, "jsonl"))
    return units


def _no_rows() -> np.ndarray:
    return np.zeros(0, np.uint64)


def refused_file(source: str, reason: str, schema: pa.Schema) -> tuple[Parsed, Rejects]:
    """A file refused whole: no rows, and one quarantine record (line 0: the whole file,
    no bytes kept) with the reason."""
    rejects = Rejects()
    rejects.add(source, [0], [None], [f"file refused: {reason}"], [b""])
    parsed = Parsed(schema.empty_table(), source, np.zeros(0, np.int64), None)
    parsed.refused = reason
    return parsed, rejects


def _parse_columns(*args) -> list[tuple[Parsed, Rejects, np.ndarray, None, list[Path]]]:
    """`_parse` as a Ray task: the rows without the raw-line lookup (the driver re-attaches
    it), so the result travels as Arrow tables and arrays; the driver writes the rows."""
    return [
        (dataclasses.replace(parsed, raw=None), rejects, user, None, files)
        for parsed, rejects, user, _, files in _parse(*args)
    ]


def _write_events(
    w, schema: pa.Schema, options: dict, index: int, table: pa.Table, part: int = 0
) -> str:
    """Source file `index`'s clean rows as one events file in the partition's staging,
    written by its parsing thread: both cores parse and write (the writing thread alone
    wrote ~2 s of the standard day's ~6.5 s). Its name."""
    name = f"events-{index:05d}-{part}-{w.write_id}.parquet"
    pq.write_table(table.cast(schema), f"{w.staging}/{name}", filesystem=w.fs, **options)
    return name


def _ordered(fn, items: list, threads: int) -> Iterator:
    """`map(fn, items)` on `threads` threads (gunzip and Arrow release the GIL), in order,
    at most `threads` results ahead of the consumer: memory is a few files, not a day."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _sources(
    source: Path,
    features: FeatureSet,
    cfg: IngestConfig,
    schema: pa.Schema,
    user_cols: list[str],
    window: DayWindow,
    progress,
    sink=None,
):
    """The file count, the bytes to read, and an iterator of (parsed and validated rows,
    their rejects, their user-side hashes, a re-reader of raw lines, the events file the
    parsing thread wrote them to with `sink(index, table)`, if given) per source file, in
    file order (after the files refused before reading: links out of the source, other
    formats), and the files ignored (hidden, markers) with why."""
    if cfg.format == "movielens":
        parsed, rejects, bytes_in, nfiles = read_movielens(source, features, cfg)
        parsed, bad = validate(parsed, features)
        rejects.extend(bad)
        user = user_hashes(parsed.table, user_cols)
        return nfiles, bytes_in, iter([(parsed, rejects, user, parsed.raw, None)]), {}
    files, refused, ignored = list_source_files(source)
    limits = ReadLimits(cfg.max_file_mb << 20, cfg.max_expansion_ratio)
    units = parse_units(files)
    args = [(paths, kind, schema, features, user_cols, limits, window) for paths, kind in units]
    if cfg.engine == "ray":
        parsed_files = ordered_map(_parse_columns, args, cfg.workers)
    else:
        tasks = [(*a, sink and functools.partial(sink, i)) for i, a in enumerate(args)]
        parsed_files = _ordered(lambda a: _parse(*a), tasks, cfg.workers)

    def with_raw():
        for source_name, reason in refused.items():  # links out of the source: never opened
            yield *refused_file(source_name, reason, schema), _no_rows(), None, None
        try:
            for (paths, kind), results in zip(units, parsed_files, strict=True):
                if progress:
                    progress(paths[-1].name, len(paths))
                for parsed, rejects, user, file, read in results:
                    if kind == "parquet":
                        raw = None
                    elif len(read) == 1:
                        raw = functools.partial(raw_lines, read[0], limits)
                    else:
                        raw = functools.partial(raw_files_lines, read, limits)
                    yield parsed, rejects, user, raw, file
        finally:  # a failure downstream: the parsing threads finish before staging goes
            getattr(parsed_files, "close", lambda: None)()

    nbytes = sum(p.stat().st_size for p in files)
    return len(files) + len(refused), nbytes, with_raw(), ignored


def ingest(
    source: str | Path,
    warehouse: Warehouse,
    ds: str,
    features: FeatureSet,
    cfg: IngestConfig,
    write: ParquetWrite | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> dict:
    """Run the stage; returns the summary (contract keys `ingest.*`).

    Streams: each source file is parsed, validated and written to the events partition's
    staging as it comes (its own Parquet file), keeping only the keys the day-wide checks
    need (event_id, session, time, a hash of the user-side values: ~45 bytes a row). The
    day-wide checks (redelivered events, session snapshots) then name the rows to drop,
    and only the files holding them are rewritten. Nothing is published before the gate."""
    validate_ds(ds)
    t0 = time.perf_counter()
    source = Path(source)
    base_schema = events_schema(features)
    options = (write or ParquetWrite()).options()
    file_options = {**options, "use_dictionary": _scalar_columns(base_schema)}  # the events
    options.pop("row_group_size")  # the quarantine's
    schema = mark_sessions_checked(base_schema) if cfg.check_sessions else base_schema
    user_cols = [f.name for f in features.by_side("user")] if cfg.check_sessions else []
    rejects, parts, shared_lines, out_of_day, refused = Rejects(), [], 0, 0, {}
    window_days = cfg.dedup_window_days if cfg.format == "events" else 0
    published, inputs = published_ids(warehouse, ds, window_days)
    lineage = record("ingest", {}, _shaping(cfg, write), features, logs_digest(source), inputs)
    with warehouse.writing("events", ds) as w:
        w.extra["lineage"] = lineage
        sink = functools.partial(_write_events, w, schema, file_options)
        window = DayWindow.of(ds, cfg) if cfg.format == "events" else None
        nfiles, bytes_in, stream, ignored = _sources(
            source, features, cfg, base_schema, user_cols, window, progress, sink
        )
        try:
            for parsed, bad, user, raw, file in stream:
                rejects.extend(bad)
                shared_lines += parsed.shared_lines
                out_of_day += parsed.out_of_day
                if parsed.refused:
                    refused[parsed.source] = parsed.refused
                part = Part.of(parsed, user, raw)
                if file:  # written by its parsing thread
                    w.add_file(file, parsed.table.num_rows)
                    part.file = file
                elif parsed.table.num_rows:
                    w.write(parsed.table.cast(schema), **file_options)
                    part.file = w.end_file()
                parts.append(part)
        finally:
            getattr(stream, "close", lambda: None)()
        drops = duplicate_events(parts)
        redelivered = redelivered_events(parts, drops, published)
        if cfg.check_sessions:
            bad_rows, refs = inconsistent_sessions(parts, drops)
            _blame(parts, bad_rows, refs, drops, w, user_cols)
        for k in sorted(drops):
            _drop_rows(parts[k], drops[k], w, rejects, **file_options)
        if not any(p.file for p in parts):
            w.write(schema.empty_table(), **file_options)
        quarantine = rejects.table()
        rows_q = quarantine.num_rows
        rows_ok = sum(p.event_id.size for p in parts) - sum(len(d.rows) for d in drops.values())
        rows_in = rows_ok + rows_q
        seconds = time.perf_counter() - t0
        with warehouse.writing("quarantine", ds) as q:
            q.extra["lineage"] = lineage
            q.write(quarantine.replace_schema_metadata({b"recd.ds": ds.encode()}), **options)
        fraction = rows_q / rows_in if rows_in else 0.0
        summary = {
            "ingest.rows_in": rows_in,
            "ingest.rows_ok": rows_ok,
            "ingest.rows_quarantined": rows_q,
            "ingest.rows_per_s": rows_in / seconds if seconds > 0 else 0.0,
            "ingest.quarantine_fraction": fraction,
            "ingest.files": nfiles,
            # lines whose user-side text was parsed once per session (data/shared_parse.py):
            # below rows_in where the logs' layout does not allow it (~2x slower there)
            "ingest.rows_shared_parse": shared_lines,
            "ingest.bytes_in": bytes_in,
            # off the day: kept within the tolerances, quarantined beyond them
            "ingest.rows_out_of_day": out_of_day,
            # files refused whole (one quarantine record each): too large once expanded,
            # links out of the source directory
            "ingest.files_refused": len(refused),
            "ingest.refused_files": refused,
            # hidden and marker files (`.x`, `_SUCCESS`): named, not read
            "ingest.ignored_files": ignored,
            # events already published on one of the dedup_window_days before (quarantined)
            "ingest.rows_redelivered": redelivered,
            "ingest.inputs": inputs,
            "ingest.seconds": seconds,
            "ingest.published": False,
            "ingest.top_reasons": top_reasons(quarantine),
        }
        if rows_in == 0:
            raise QuarantineExceeded(
                f"no rows in {source}: nothing to publish for ds={ds}", summary
            )
        if fraction > cfg.max_quarantine_fraction:
            raise QuarantineExceeded(
                f"{rows_q} of {rows_in} rows ({fraction:.1%}) quarantined, above the limit of "
                f"{cfg.max_quarantine_fraction:.1%}: events/ds={ds} not published; "
                f"see {warehouse.partition_path('quarantine', ds)}",
                summary,
            )
    summary["ingest.published"] = True
    summary["ingest.events_bytes"] = w.info.bytes
    summary["ingest.kept"] = w.kept is not None  # built from the same logs before: unchanged
    return summary


def _shaping(cfg: IngestConfig, write: ParquetWrite | None) -> dict:
    """The ingest settings that shape the events (lineage's config digest)."""

    return {
        "ingest": cfg.model_dump(mode="json", exclude=EXECUTION_FIELDS),
        "write": (write or ParquetWrite()).model_dump(mode="json"),
    }


def _scalar_columns(schema: pa.Schema) -> list[str]:
    """The columns the events files dictionary-encode: not the lists. Events come in log
    order, a session's rows near each other, so zstd removes a session's repeated lists
    where they stay byte-aligned; bit-packed dictionary indices hide the repeats (a standard
    file: 10.5 MB with dictionary lists, 5.5 MB without, and faster to write and read)."""
    return [f.name for f in schema if not pa.types.is_list(f.type)]


def _blame(parts, bad_rows, refs, drops, w, user_cols) -> None:
    """Name the first user-side field (in feature order) in which each inconsistent event
    differs from its session's first event, reading just those rows back from staging."""
    if bad_rows.size == 0:
        return
    part_of, row_of = positions(parts)
    needed = np.unique(np.concatenate([bad_rows, refs]))
    values: dict[int, dict] = {}
    for k in np.unique(part_of[needed]):
        mine = needed[part_of[needed] == k]
        t = w.read_file(parts[k].file, columns=user_cols)
        for g, row in zip(mine, t.take(pa.array(row_of[mine])).to_pylist(), strict=True):
            values[int(g)] = row
    for g, r in zip(bad_rows, refs, strict=True):
        field = next((c for c in user_cols if values[g][c] != values[r][c]), user_cols[0])
        part = parts[part_of[g]]
        d = drops.setdefault(int(part_of[g]), Drop([], [], []))
        d.rows.append(int(row_of[g]))
        d.fields.append(field)
        d.reasons.append(
            f"field {field!r}: differs from the first event of session "
            f"{part.session_id[row_of[g]]} (event_id {parts[part_of[r]].event_id[row_of[r]]})"
        )


def _drop_rows(part: Part, drop: Drop, w, rejects: Rejects, **parquet_options) -> None:
    """Quarantine a part's rows the day-wide checks rejected and rewrite its staging file
    without them."""
    order = np.argsort(drop.rows, kind="stable")
    rows = np.asarray(drop.rows, np.int64)[order]
    table = w.read_file(part.file)
    raw = part.raw(part.lines[rows]) if part.raw else rows_as_json(table, rows)
    rejects.add(
        *part.where(part.lines[rows]),
        [drop.fields[i] for i in order],
        [drop.reasons[i] for i in order],
        raw,
    )
    keep = np.ones(table.num_rows, bool)
    keep[rows] = False
    w.rewrite(part.file, table.filter(pa.array(keep)), **parquet_options)


def top_reasons(quarantine: pa.Table, k: int = 5) -> dict[str, int]:
    """The most frequent reasons, values stripped (`field 'x': negative id -3` -> `…: negative id`)."""
    if quarantine.num_rows == 0:
        return {}
    stem = pc.replace_substring_regex(
        quarantine["reason"], r"(-?\d+(\.\d+)?|\(.*\)|nan|inf|null)\s*$", ""
    )
    stem = pc.replace_substring_regex(stem, r"duplicate event_id \d+.*", "duplicate event_id")
    counts = pc.value_counts(stem).to_pylist()
    counts.sort(key=lambda c: -c["counts"])
    return {c["values"].strip(): c["counts"] for c in counts[:k]}
