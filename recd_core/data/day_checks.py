"""The day-wide checks of ingest, on ~45 bytes of keys a row (`Part`) rather than the rows:
an event id twice in the day (`duplicate_events`), an event already published on a nearby
day (`redelivered_events`: a redelivery is quarantined on the later ingest), and a session
whose user-side values differ between its rows (`inconsistent_sessions`). Each names the
rows it rejects (`Drop`); ingest writes them to the quarantine with the file and line."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from recd_core.data.sources import Parsed
from recd_core.dedup.unique import group_hashes
from recd_core.lineage import write_ids
from recd_core.warehouse import Warehouse


@dataclass
class Part:
    """What the day-wide checks keep of one parsed source once its clean rows are written:
    ~45 bytes a row, so a day's memory is its keys, not its rows.

    `file` is the staging events file holding the rows (None when there were none); `raw`
    returns the original bytes of given line numbers (re-reading the source: only rows the
    day-wide checks reject are ever looked up), None for Parquet (rows go to the quarantine
    as JSON)."""

    source: str
    lines: np.ndarray  # 1-based line (row) per clean row, in file order (of the unit's text)
    event_id: np.ndarray
    session_id: np.ndarray
    ts: np.ndarray
    user: np.ndarray  # uint64: a hash of the row's user-side values
    raw: Callable[[np.ndarray], pa.Array] | None
    # text lines -> (file name or names, their lines in those files): `Parsed.where`
    where: Callable[[np.ndarray], tuple] = None
    file: str | None = None

    @classmethod
    def of(cls, parsed: Parsed, user: np.ndarray, raw) -> Part:
        t = parsed.table
        key = lambda c: np.asarray(t[c], np.int64)  # noqa: E731
        return cls(
            parsed.source,
            parsed.lines,
            key("event_id"),
            key("session_id"),
            key("ts"),
            user,
            raw,
            parsed.where,
        )

    def place(self, row: int) -> str:
        """`file:line` of one clean row."""
        names, lines = self.where(self.lines[[row]])
        name = names if isinstance(names, str) else names[0].as_py()
        return f"{name}:{lines[0]}"


def user_hashes(table: pa.Table, user_cols: list[str]) -> np.ndarray:
    """What the session check compares: a hash of each row's user-side values (none
    without the check: hashing them is a fifth of a file's parse time)."""
    if not user_cols or not table.num_rows:
        return np.zeros(table.num_rows, np.uint64)
    return group_hashes(table, user_cols)


@dataclass
class Drop:
    """Rows of one part the day-wide checks reject (indices into the part's clean rows)."""

    rows: list[int]
    fields: list[str]
    reasons: list[str]


def duplicate_events(parts: list[Part]) -> dict[int, Drop]:
    """Every repeat of an event_id after its first appearance (file, then line)."""
    drops: dict[int, Drop] = {}
    if not parts:
        return drops
    eids = np.concatenate([p.event_id for p in parts])
    order = np.argsort(eids, kind="stable")
    ids_sorted = eids[order]
    new_group = np.concatenate([[True], ids_sorted[1:] != ids_sorted[:-1]])
    if new_group.all():
        return drops
    first_pos = np.maximum.accumulate(np.where(new_group, np.arange(eids.size), 0))
    first_of = np.empty_like(order)
    first_of[order] = order[first_pos]
    part_of, row_of = positions(parts)
    for g in np.sort(order[~new_group]):  # a loop over the repeats only
        f = first_of[g]
        where = parts[part_of[f]].place(int(row_of[f]))
        d = drops.setdefault(int(part_of[g]), Drop([], [], []))
        d.rows.append(int(row_of[g]))
        d.fields.append("event_id")
        d.reasons.append(f"duplicate event_id {eids[g]} (first seen at {where})")
    return drops


def redelivered_events(
    parts: list[Part], drops: dict[int, Drop], published: dict[str, np.ndarray]
) -> int:
    """Add to `drops` every event already published on another day of the window
    (`published`: each such day's event ids, sorted); how many there were."""
    found = 0
    for day in sorted(published, reverse=True):  # the latest publication first
        ids = published[day]
        if not ids.size:
            continue
        for k, part in enumerate(parts):
            pos = np.searchsorted(ids, part.event_id)
            hit = np.flatnonzero(ids[np.minimum(pos, ids.size - 1)] == part.event_id)
            d = drops.setdefault(k, Drop([], [], []))
            taken = set(d.rows)
            for r in hit.tolist():  # a loop over the redelivered rows only
                if r in taken:
                    continue
                d.rows.append(r)
                d.fields.append("event_id")
                d.reasons.append(
                    f"redelivered: event_id {part.event_id[r]} was published on ds={day}"
                )
                found += 1
            if not d.rows:
                del drops[k]
    return found


def published_ids(
    warehouse: Warehouse, ds: str, days: int
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The event ids published on each of the `days` days before `ds`, and after it, that
    has events (sorted), and the days before's write ids (the events partition's peers).

    Both sides, so an event is published once whichever of two days is ingested first (a
    backfill, a late day): the first publication keeps it, the other day quarantines it.
    Only the days before are peers in the lineage: a later day as a peer would make each
    of two days stale whenever the other is rerun, for ever."""

    first = dt.date.fromisoformat(ds)
    around = [(first + dt.timedelta(days=k)).isoformat() for k in range(-days, days + 1) if k]
    ids, inputs = {}, {}
    for day in around:
        if not warehouse.exists("events", day):
            continue
        with warehouse.pinned("events", day):
            if day < ds:
                inputs.update(write_ids(warehouse, "events", [day]))
            col = warehouse.read("events", day, columns=["event_id"])["event_id"]
            ids[day] = np.sort(np.asarray(col, np.int64))
    return ids, inputs


def inconsistent_sessions(
    parts: list[Part], dropped: dict[int, Drop]
) -> tuple[np.ndarray, np.ndarray]:
    """Events whose user-side values differ from their session's first event (by time, then
    event_id), among the rows not `dropped` already: user features are a snapshot taken at
    session start, which is what lets every later stage deduplicate by session.

    Compared by a 64-bit hash of the values (a collision, ~2^-64 per event, would let one
    inconsistent event through). Returns (rows, their reference rows), day-wide indices."""
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    offsets = _offsets(parts)
    keep = np.ones(offsets[-1], bool)
    for k, d in dropped.items():
        keep[offsets[k] + np.asarray(d.rows, np.int64)] = False
    idx = np.flatnonzero(keep)
    sid, ts, eid, user = (
        np.concatenate([getattr(p, c) for p in parts])[idx]
        for c in ("session_id", "ts", "event_id", "user")
    )
    n = idx.size
    order = np.lexsort((eid, ts, sid))
    first = np.concatenate([[True], sid[order][1:] != sid[order][:-1]])
    ref = np.empty(n, np.int64)
    ref[order] = order[np.maximum.accumulate(np.where(first, np.arange(n), 0))]
    bad = np.flatnonzero(user != user[ref])
    return idx[bad], idx[ref[bad]]


def _offsets(parts: list[Part]) -> np.ndarray:
    """Where each part's rows start among the day's rows (and, last, the day's row count)."""
    return np.cumsum([0] + [p.event_id.size for p in parts])


def positions(parts: list[Part]) -> tuple[np.ndarray, np.ndarray]:
    """Per day-wide row: its part, and its row within the part."""
    offsets = _offsets(parts)
    part_of = np.repeat(np.arange(len(parts)), np.diff(offsets))
    row_of = np.arange(part_of.size) - offsets[part_of]
    return part_of, row_of
