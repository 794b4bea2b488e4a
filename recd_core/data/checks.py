"""The checks a row of events passes, on whole Arrow columns, never a Python loop over rows:

  parse      JSON syntax, UTF-8, object shape, types (data/sources.py)
  required   every envelope column and every `required` feature present and non-null
  ids        sparse ids, list elements, event_id, session_id, ts non-negative; the ids of a
             feature with `hash: false` (row indices) below its table_size
  label      0 or 1
  lists      no null elements, length <= max_length
  dense      finite; dim > 1 lists of exactly `dim` values
  unique     event_id appears once per day (a repeat is quarantined), and not in the
             events published on the `dedup_window_days` days before (a redelivery,
             quarantined naming the day it was first published on)
  day        ts within the partition's day, give or take the tolerances (`ts_before_day_s`,
             `ts_after_day_s`); rows inside them but off the day are kept and counted
  sessions   user-side values equal the session's first event's (`check_sessions`)

`unique` and `sessions` are day-wide and run in data/ingest.py; the others are here. A row
is rejected for its first failing check, in schema order (`first_failure`). Ingest
runs them on every file (`validate`), serving on every request (the same checks: a scored
row is an event).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recd_core.config import ENVELOPE_COLUMNS, FeatureSet, IngestConfig
from recd_core.data.sources import Parsed, Rejects

DAY_MS = 86_400_000


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


def _any(values) -> bool:
    """Whether any value of a boolean (chunked) array is true; nulls count as false."""
    return bool(pc.any(values).as_py())


def _bounds(col) -> tuple:
    """(min, max) of a column in one pass; (None, None) where it has no values."""
    found = pc.min_max(col)
    return found["min"].as_py(), found["max"].as_py()


def _below(col, bound) -> bool:
    low = pc.min(col).as_py()
    return low is not None and low < bound


def _outside(col, low: float, high: float) -> bool:
    """Whether a value of `col` is below `low` or above `high` (one pass)."""
    lo, hi = _bounds(col)
    return lo is not None and (lo < low or hi > high)


def semantic_checks(table: pa.Table, features: FeatureSet) -> list[Check]:
    """The failing checks of `table` (a check no row fails is left out). Each check first
    asks a whole-column question (a minimum, a null count): a clean file costs a few
    aggregates a column, and per-row flags are computed only where a check fails."""
    checks: list[Check] = []
    specs = {f.name: f for f in features.features}
    for name in table.column_names:
        col = table[name]
        spec = specs.get(name)
        required = spec is None or spec.required
        if required and col.null_count:
            checks.append(
                Check(name, np.asarray(col.is_null(), bool), f"missing required field {name!r}")
            )
        if spec is None and name in ENVELOPE_COLUMNS:
            if name == "label":
                if _outside(col, 0, 1):
                    col = col.combine_chunks()
                    known = np.asarray(pc.is_in(col, pa.array([0, 1], pa.int8())), bool)
                    bad = ~known & ~np.asarray(col.is_null(), bool)
                    checks.append(
                        Check(name, bad, _with_value("field 'label': must be 0 or 1, got ", col))
                    )
            elif _below(col, 0):
                col = col.combine_chunks()
                bad = np.asarray(pc.less(col, 0).fill_null(False), bool)
                checks.append(
                    Check(name, bad, _with_value(f"field {name!r}: negative value ", col))
                )
            continue
        if spec is None:
            continue
        # an unhashed feature's ids are row indices (FeatureSpec.hash)
        size = spec.table_size or 0
        beyond = f" not below table_size {size} (its ids are row indices: hash false)"
        if spec.kind == "sparse":
            lo, hi = _bounds(col)
            if lo is not None and lo < 0:
                col = col.combine_chunks()
                bad = np.asarray(pc.less(col, 0).fill_null(False), bool)
                checks.append(Check(name, bad, _with_value(f"field {name!r}: negative id ", col)))
            if not spec.hash and hi is not None and hi > size - 1:
                col = col.combine_chunks()
                bad = np.asarray(pc.greater_equal(col, size).fill_null(False), bool)
                msg = _with_value(f"field {name!r}: id{beyond}, got ", col)
                checks.append(Check(name, bad, msg))
        elif spec.is_list:
            flat = pc.list_flatten(col)
            lo, hi = _bounds(flat)
            too_big = not spec.hash and hi is not None and hi > size - 1
            negative = lo is not None and lo < 0
            longest = pc.max(pc.list_value_length(col)).as_py()
            if not (flat.null_count or negative or too_big or (longest or 0) > spec.max_length):
                continue
            col = col.combine_chunks()
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
            if too_big:
                rows = _list_rows_where(col, pc.greater_equal(flat, size))
                checks.append(Check(name, rows, f"field {name!r}: id in list{beyond}"))
            lengths = pc.list_value_length(col)
            bad = np.asarray(pc.greater(lengths, spec.max_length).fill_null(False), bool)
            msg = _with_value(
                f"field {name!r}: length ", lengths, f" exceeds max_length {spec.max_length}"
            )
            checks.append(Check(name, bad, msg))
        elif spec.kind == "dense" and spec.dim == 1:
            if _any(pc.invert(pc.is_finite(col))):
                col = col.combine_chunks()
                bad = np.asarray(pc.invert(pc.is_finite(col)).fill_null(False), bool)
                checks.append(
                    Check(name, bad, _with_value(f"field {name!r}: not a finite number: ", col))
                )
        else:
            lengths = pc.list_value_length(col)
            flat = pc.list_flatten(col)
            wrong_length = _outside(lengths, spec.dim, spec.dim)
            if not (wrong_length or _any(pc.invert(pc.is_finite(flat)))):
                continue
            col = col.combine_chunks()
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


@dataclass(frozen=True)
class DayWindow:
    """Where a day's events may be stamped (ms since the epoch, UTC): the day itself, and
    around it the tolerated `lo`..`hi` (late arrivals before, clock skew after)."""

    ds: str
    start: int
    end: int
    lo: int
    hi: int

    @classmethod
    def of(cls, ds: str, cfg: IngestConfig) -> DayWindow:
        start = int(np.datetime64(ds, "ms").astype(np.int64))
        return cls(
            ds,
            start,
            start + DAY_MS,
            start - cfg.ts_before_day_s * 1000,
            start + DAY_MS + cfg.ts_after_day_s * 1000,
        )


def day_check(table: pa.Table, window: DayWindow) -> tuple[list[Check], int]:
    """Rows stamped beyond the window's tolerances (a check), and how many rows are off the
    day at all (kept or not)."""
    if not table.num_rows:
        return [], 0
    ts = np.asarray(table["ts"].fill_null(window.start), np.int64)
    off = int(((ts < window.start) | (ts >= window.end)).sum())
    if not off:
        return [], 0
    bad = (ts < window.lo) | (ts >= window.hi)
    if not bad.any():
        return [], off
    words = np.full(ts.size, None, object)
    for i in np.flatnonzero(bad):  # a loop over the rejected rows only
        h = (ts[i] - (window.start if ts[i] < window.start else window.end)) / 3_600_000
        words[i] = (
            f"field 'ts': {abs(h):.1f} h {'before' if h < 0 else 'after'} ds={window.ds}, "
            "beyond the tolerance (ingest.ts_before_day_s / ts_after_day_s)"
        )
    return [Check("ts", bad, pa.array(words, pa.string()))], off


def validate(
    parsed: Parsed, features: FeatureSet, window: DayWindow | None = None
) -> tuple[Parsed, Rejects]:
    """Split parsed rows into valid ones and rejects (with reasons); with a `window`, count
    the rows off the day (`Parsed.out_of_day`) and reject those beyond its tolerances."""
    t = parsed.table
    checks = semantic_checks(t, features)
    off = 0
    if window is not None:
        late, off = day_check(t, window)
        checks += late
    bad, fields, reasons = first_failure(t.num_rows, checks)
    rejects = Rejects()
    if bad.any():
        where = np.flatnonzero(bad)
        take = pa.array(where)
        rejects.add(
            *parsed.where(parsed.lines[where]),
            fields.take(take),
            reasons.take(take),
            parsed.raw_rows(where),
        )
        parsed = parsed.subset(np.flatnonzero(~bad))
    parsed.out_of_day = off
    return parsed, rejects
