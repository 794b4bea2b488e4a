"""`recd ingest`: validate raw logs into `events/ds=D`, every rejected row into `quarantine/ds=D`.

Checks run on whole Arrow columns, never a Python loop over rows:

  parse      JSON syntax, UTF-8, object shape, types (data/sources.py)
  required   every envelope column and every `required` feature present and non-null
  ids        sparse ids, list elements, event_id, session_id, ts non-negative
  label      0 or 1
  lists      no null elements, length <= max_length
  dense      finite; dim > 1 lists of exactly `dim` values
  unique     event_id appears once per day (a redelivered event is quarantined)

A row is rejected for its first failing check, in schema order; `rows_in == rows_ok +
rows_quarantined` always holds. If the rejected fraction exceeds `max_quarantine_fraction`
the quarantine is still written (for inspection) but the events partition is not published.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recd_core.config import ENVELOPE_COLUMNS, FeatureSet, GenerateConfig, IngestConfig
from recd_core.dedup.unique import rows_equal_to
from recd_core.errors import GateFailed
from recd_core.schema import events_schema, mark_sessions_checked
from recd_core.data.sources import (
    Parsed,
    Rejects,
    SourceError,
    read_json_lines,
    read_parquet_events,
)
from recd_core.warehouse import Warehouse, validate_ds

EVENT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson", ".ndjson.gz", ".parquet")


class QuarantineExceeded(GateFailed):
    """Too many rows were rejected: the events partition was not published; `summary` holds
    the day's counts."""


@dataclass
class Check:
    field: str
    bad: np.ndarray  # bool per row
    reason: pa.Array | str


def _with_value(prefix: str, values: pa.Array, suffix: str = "") -> pa.Array:
    """`prefix + str(value) + suffix`, vectorized (the reason names the offending value)."""
    as_text = pc.cast(values, pa.string()).fill_null("null")
    return pc.binary_join_element_wise(prefix, as_text, suffix, "")


def _list_rows_where(col: pa.Array, bad_values: pa.Array) -> np.ndarray:
    """Rows of a list column with at least one element flagged in `bad_values`."""
    flags = np.asarray(pc.fill_null(bad_values, True), bool)
    out = np.zeros(len(col), bool)
    if flags.any():
        parents = np.asarray(pc.list_parent_indices(col))
        out[parents[flags]] = True
    return out


def semantic_checks(table: pa.Table, features: FeatureSet) -> list[Check]:
    checks: list[Check] = []
    specs = {f.name: f for f in features.features}
    for name in table.column_names:
        col = table[name].combine_chunks()
        spec = specs.get(name)
        required = spec is None or spec.required
        nulls = np.asarray(col.is_null(), bool)
        if required:
            checks.append(Check(name, nulls, f"missing required field {name!r}"))
        if spec is None and name in ENVELOPE_COLUMNS:
            if name == "label":
                bad = (
                    np.asarray(pc.invert(pc.is_in(col, pa.array([0, 1], pa.int8()))), bool) & ~nulls
                )
                checks.append(
                    Check(name, bad, _with_value("field 'label': must be 0 or 1, got ", col))
                )
            else:
                bad = np.asarray(pc.less(col, 0).fill_null(False), bool)
                checks.append(
                    Check(name, bad, _with_value(f"field {name!r}: negative value ", col))
                )
            continue
        if spec is None:
            continue
        if spec.kind == "sparse":
            bad = np.asarray(pc.less(col, 0).fill_null(False), bool)
            checks.append(Check(name, bad, _with_value(f"field {name!r}: negative id ", col)))
        elif spec.is_list:
            flat = pc.list_flatten(col)
            checks.append(
                Check(
                    name,
                    _list_rows_where(col, pc.is_null(flat)),
                    f"field {name!r}: null list element",
                )
            )
            checks.append(
                Check(
                    name,
                    _list_rows_where(col, pc.less(flat, 0)),
                    f"field {name!r}: negative id in list",
                )
            )
            lengths = pc.list_value_length(col)
            bad = np.asarray(pc.greater(lengths, spec.max_length).fill_null(False), bool)
            msg = _with_value(
                f"field {name!r}: length ", lengths, f" exceeds max_length {spec.max_length}"
            )
            checks.append(Check(name, bad, msg))
        elif spec.kind == "dense" and spec.dim == 1:
            bad = np.asarray(pc.invert(pc.is_finite(col)).fill_null(False), bool)
            checks.append(
                Check(name, bad, _with_value(f"field {name!r}: not a finite number: ", col))
            )
        else:
            lengths = pc.list_value_length(col)
            bad = np.asarray(pc.not_equal(lengths, spec.dim).fill_null(False), bool)
            checks.append(
                Check(
                    name,
                    bad,
                    _with_value(f"field {name!r}: expected {spec.dim} values, got ", lengths),
                )
            )
            flat = pc.list_flatten(col)
            nonfinite = pc.invert(pc.is_finite(flat))
            checks.append(
                Check(name, _list_rows_where(col, nonfinite), f"field {name!r}: value not finite")
            )
    return checks


def first_failure(n: int, checks: list[Check]) -> tuple[np.ndarray, pa.Array, pa.Array]:
    """Per row: rejected?, the field and the reason of its first failing check."""
    bad = np.zeros(n, bool)
    fields = pa.nulls(n, pa.string())
    reasons = pa.nulls(n, pa.string())
    for c in reversed(checks):  # earlier checks overwrite later ones
        if not c.bad.any():
            continue
        mask = pa.array(c.bad)
        reason = c.reason if isinstance(c.reason, pa.Array) else pa.scalar(c.reason)
        reasons = pc.if_else(mask, reason, reasons)
        fields = pc.if_else(mask, pa.scalar(c.field), fields)
        bad |= c.bad
    return bad, fields, reasons


def validate(parsed: Parsed, features: FeatureSet) -> tuple[Parsed, Rejects]:
    """Split parsed rows into valid ones and rejects (with reasons)."""
    t = parsed.table
    bad, fields, reasons = first_failure(t.num_rows, semantic_checks(t, features))
    rejects = Rejects()
    if bad.any():
        where = np.flatnonzero(bad)
        take = pa.array(where)
        rejects.add(
            parsed.source,
            parsed.lines[where],
            fields.take(take),
            reasons.take(take),
            parsed.raw_rows(where),
        )
        parsed = parsed.subset(np.flatnonzero(~bad))
    return parsed, rejects


def drop_duplicate_events(parts: list[Parsed]) -> tuple[list[Parsed], Rejects]:
    """Quarantine every repeat of an event_id after its first appearance (file, then line)."""
    rejects = Rejects()
    if not parts:
        return parts, rejects
    eids = np.concatenate([np.asarray(p.table["event_id"]) for p in parts])
    order = np.argsort(eids, kind="stable")
    ids_sorted = eids[order]
    new_group = np.concatenate([[True], ids_sorted[1:] != ids_sorted[:-1]])
    if new_group.all():
        return parts, rejects
    first_pos = np.maximum.accumulate(np.where(new_group, np.arange(eids.size), 0))
    first_of = np.empty_like(order)
    first_of[order] = order[first_pos]
    repeat = np.zeros(eids.size, bool)
    repeat[order[~new_group]] = True
    part_of = np.concatenate([np.full(p.table.num_rows, i) for i, p in enumerate(parts)])
    lines = np.concatenate([p.lines for p in parts])
    out, start = [], 0
    for p in parts:
        n = p.table.num_rows
        rep = repeat[start : start + n]
        if rep.any():
            where = np.flatnonzero(rep)
            reasons = [  # a loop over the repeats only
                f"duplicate event_id {eids[start + w]} "
                f"(first seen at {parts[part_of[f]].source}:{lines[f]})"
                for w, f in zip(where, first_of[start + where], strict=True)
            ]
            rejects.add(
                p.source, p.lines[where], ["event_id"] * where.size, reasons, p.raw_rows(where)
            )
            p = p.subset(np.flatnonzero(~rep))
        out.append(p)
        start += n
    return out, rejects


def _flat(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a scalar or list column, values in their own dtype."""
    col = col.combine_chunks()
    if pa.types.is_list(col.type):
        offsets = np.asarray(col.offsets, np.int64)
        return np.asarray(col.values.slice(offsets[0], offsets[-1] - offsets[0])), np.diff(offsets)
    return np.asarray(col), np.ones(len(col), np.int64)


def check_sessions(parts: list[Parsed], features: FeatureSet) -> tuple[list[Parsed], Rejects]:
    """Quarantine events whose user-side values differ from their session's first event
    (by time, then event_id): user features are a snapshot taken at session start, which is
    what lets every later stage deduplicate by session."""
    rejects = Rejects()
    if not parts:
        return parts, rejects
    table = pa.concat_tables([p.table for p in parts])
    n = table.num_rows
    sid, ts, eid = (np.asarray(table[c]) for c in ("session_id", "ts", "event_id"))
    order = np.lexsort((eid, ts, sid))
    first = np.concatenate([[True], sid[order][1:] != sid[order][:-1]])
    ref = np.empty(n, np.int64)
    ref[order] = order[np.maximum.accumulate(np.where(first, np.arange(n), 0))]
    bad = np.zeros(n, bool)
    blame = np.empty(n, object)
    for spec in features.by_side("user"):
        values, lengths = _flat(table[spec.name])
        differs = ~rows_equal_to(values, lengths, ref) & ~bad
        blame[differs] = spec.name
        bad |= differs
    if not bad.any():
        return parts, rejects
    out, start = [], 0
    for p in parts:
        rows = p.table.num_rows
        where = np.flatnonzero(bad[start : start + rows])
        if where.size:
            g = start + where
            reasons = [  # a loop over the rejected rows only
                f"field {blame[i]!r}: differs from the first event of session {sid[i]} (event_id {eid[ref[i]]})"
                for i in g
            ]
            rejects.add(p.source, p.lines[where], list(blame[g]), reasons, p.raw_rows(where))
            p = p.subset(np.flatnonzero(~bad[start : start + rows]))
        out.append(p)
        start += rows
    return out, rejects


def list_source_files(source: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if not source.exists():
        raise SourceError(f"source not found: {source}")
    if source.is_file():
        return [source]
    files = sorted(
        p
        for p in source.rglob("*")
        if p.is_file()
        and not any(part.startswith((".", "_")) for part in p.relative_to(source).parts)
        and p.name.endswith(suffixes)
    )
    if not files:
        raise SourceError(f"no input files ({', '.join(suffixes)}) under {source}")
    return files


def read_events(
    files: list[Path], features: FeatureSet, progress=None, threads: int = 2
) -> tuple[list[Parsed], Rejects, int]:
    """Parse and validate files, `threads` at a time (gunzip and Arrow release the GIL);
    results keep the files' order."""
    schema = events_schema(features)

    def one(path: Path) -> tuple[Parsed, Rejects]:
        reader = read_parquet_events if path.name.endswith(".parquet") else read_json_lines
        parsed, rejects = reader(path, schema)
        parsed, bad = validate(parsed, features)
        rejects.extend(bad)
        return parsed, rejects

    parts, rejects = [], Rejects()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for path, (parsed, bad) in zip(files, pool.map(one, files), strict=True):
            parts.append(parsed)
            rejects.extend(bad)
            if progress:
                progress(path.name, 1)
    return parts, rejects, sum(p.stat().st_size for p in files)


def ingest(
    source: str | Path,
    warehouse: Warehouse,
    ds: str,
    features: FeatureSet,
    cfg: IngestConfig,
    write: GenerateConfig | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> dict:
    """Run the stage; returns the summary (contract keys `ingest.*`)."""
    validate_ds(ds)
    t0 = time.perf_counter()
    source = Path(source)
    if cfg.format == "movielens":
        from recd_core.data.movielens import read_movielens

        parsed, rejects, bytes_in, nfiles = read_movielens(source, features, cfg)
        parsed, bad = validate(parsed, features)
        rejects.extend(bad)
        parts = [parsed]
    else:
        files = list_source_files(source, EVENT_SUFFIXES)
        nfiles = len(files)
        parts, rejects, bytes_in = read_events(files, features, progress)
    parts, dupes = drop_duplicate_events(parts)
    rejects.extend(dupes)
    schema = events_schema(features)
    if cfg.check_sessions:
        parts, inconsistent = check_sessions(parts, features)
        rejects.extend(inconsistent)
        schema = mark_sessions_checked(schema)

    events = (
        pa.concat_tables([p.table for p in parts]).cast(schema) if parts else schema.empty_table()
    )
    quarantine = rejects.table()
    rows_ok, rows_q = events.num_rows, quarantine.num_rows
    rows_in = rows_ok + rows_q
    seconds = time.perf_counter() - t0
    write = write or GenerateConfig()
    options = dict(compression=write.compression, compression_level=write.compression_level)
    with warehouse.writing("quarantine", ds) as w:
        w.write(quarantine.replace_schema_metadata({b"recd.ds": ds.encode()}), **options)
    fraction = rows_q / rows_in if rows_in else 0.0
    summary = {
        "ingest.rows_in": rows_in,
        "ingest.rows_ok": rows_ok,
        "ingest.rows_quarantined": rows_q,
        "ingest.rows_per_s": rows_in / seconds if seconds > 0 else 0.0,
        "ingest.quarantine_fraction": fraction,
        "ingest.files": nfiles,
        "ingest.bytes_in": bytes_in,
        "ingest.seconds": seconds,
        "ingest.published": False,
        "ingest.top_reasons": top_reasons(quarantine),
    }
    if rows_in == 0:
        raise QuarantineExceeded(f"no rows in {source}: nothing to publish for ds={ds}", summary)
    if fraction > cfg.max_quarantine_fraction:
        raise QuarantineExceeded(
            f"{rows_q} of {rows_in} rows ({fraction:.1%}) quarantined, above the limit of "
            f"{cfg.max_quarantine_fraction:.1%}: events/ds={ds} not published; "
            f"see {warehouse.partition_path('quarantine', ds)}",
            summary,
        )
    with warehouse.writing("events", ds) as w:
        w.write(events, row_group_size=write.row_group_size, **options)
    summary["ingest.published"] = True
    summary["ingest.events_bytes"] = w.info.bytes
    return summary


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
