"""When a day's raw logs are complete: a marker file the log producer writes last.

    <logs>/ds=2026-11-24/
        part-0000.jsonl.gz
        part-0001.jsonl.gz
        _SUCCESS            written once every file of the day is in place

Ingest never reads names starting with `_`, so the marker is never taken for logs. A
scheduled run waits for the markers of every day it reads (Airflow: the `wait_for_logs`
sensor) instead of trusting the clock: late files and a slow exporter are the norm.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

MARKER = "_SUCCESS"


def marker_path(logs: str | Path, ds: str, marker: str = MARKER) -> Path:
    return Path(logs) / f"ds={ds}" / marker


def mark_complete(logs: str | Path, ds: str, marker: str = MARKER) -> Path:
    """Declare `ds`'s logs complete (what a log producer does after its last file)."""
    path = marker_path(logs, ds, marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dt.datetime.now(dt.UTC).isoformat() + "\n")
    return path


def incomplete_days(logs: str | Path, days: list[str], marker: str = MARKER) -> list[str]:
    """The days among `days` whose logs are not marked complete, in order."""
    return [d for d in days if not marker_path(logs, d, marker).is_file()]
