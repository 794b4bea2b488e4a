"""The raw logs root, as every reader and writer of raw logs lays it out: a directory a day,
a marker the log producer writes last, and (synthetic days only) the oracle's figures.

    <logs>/ds=2026-11-24/
        part-0000.jsonl.gz
        part-0001.jsonl.gz
        _SUCCESS            written once every file of the day is in place
        _oracle.json        `recd synth`'s days: NE, AUC, log loss of the true click
                            probabilities the labels were drawn from (real logs: none)

Ingest never reads names starting with `_`, so the marker is never taken for logs. A
scheduled run waits for the markers of every day it reads (Airflow: the `wait_for_logs`
sensor) instead of trusting the clock: late files and a slow exporter are the norm.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

MARKER = "_SUCCESS"
ORACLE_FILE = "_oracle.json"


def logs_for_day(logs: str | Path, ds: str) -> Path:
    """A day's directory under a logs root: `<logs>/ds=YYYY-MM-DD`."""
    return Path(logs) / f"ds={ds}"


def marker_path(logs: str | Path, ds: str, marker: str = MARKER) -> Path:
    return logs_for_day(logs, ds) / marker


def mark_complete(logs: str | Path, ds: str, marker: str = MARKER) -> Path:
    """Declare `ds`'s logs complete (what a log producer does after its last file)."""
    path = marker_path(logs, ds, marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dt.datetime.now(dt.UTC).isoformat() + "\n")
    return path


def incomplete_days(logs: str | Path, days: list[str], marker: str = MARKER) -> list[str]:
    """The days among `days` whose logs are not marked complete, in order."""
    return [d for d in days if not marker_path(logs, d, marker).is_file()]


def read_oracle(logs_day: str | Path) -> dict[str, float] | None:
    """The oracle figures synth wrote for a day's logs directory, or None (real logs)."""
    path = Path(logs_day) / ORACLE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def eval_oracle(logs: str | Path | None, ds: str) -> dict:
    """`eval.oracle_ne` / `eval.oracle_auc` for an evaluation day: the optimum when the day is
    synthetic (the true click probabilities its labels were drawn from); nothing for real
    logs."""
    oracle = read_oracle(logs_for_day(logs, ds)) if logs is not None else None
    if not oracle:
        return {}
    return {"eval.oracle_ne": oracle["ne"], "eval.oracle_auc": oracle["auc"]}
