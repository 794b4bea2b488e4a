"""Which days a scheduled run works on: only days that are over when it starts.

A run trains on day T and scores the model on T+1, so both must be complete: a run that
starts at `run_start` (Airflow's data interval end, Kubeflow's scheduled time) reads the
last day that ended by then as its evaluation day and the day before as its training day.

    run starts 2026-11-25 00:00 (or any time that day)
        evaluation day 2026-11-24 (ended 2026-11-25 00:00)
        training day   2026-11-23

Every scheduler's runs derive their days here, so the rule is stated once.
"""

from __future__ import annotations

import datetime as dt


def last_complete_day(run_start: dt.datetime) -> dt.date:
    """The last UTC day that ended at or before `run_start` (naive times are UTC)."""
    if run_start.tzinfo is not None:
        run_start = run_start.astimezone(dt.UTC).replace(tzinfo=None)
    return run_start.date() - dt.timedelta(days=1)


def training_day(run_start: dt.datetime | str, days: int = 1) -> str:
    """The first training day (`--ds`) of a run of `days` training days starting at
    `run_start` (a datetime or an ISO-8601 string): its last training day's evaluation day is
    the last complete day."""
    if isinstance(run_start, str):
        run_start = dt.datetime.fromisoformat(run_start.replace("Z", "+00:00"))
    return (last_complete_day(run_start) - dt.timedelta(days=days)).isoformat()


def day_end(day: str) -> dt.datetime:
    """When `day` (YYYY-MM-DD, UTC) is over."""
    return dt.datetime.combine(dt.date.fromisoformat(day), dt.time(), dt.UTC) + dt.timedelta(1)


def training_day_or_default(ds: str | None, now: dt.datetime | None = None) -> str:
    """`ds`, or the schedule's training day for a run starting `now`: the day before the
    last complete day, which the model is scored on."""
    return ds or training_day(now or dt.datetime.now(dt.UTC))
