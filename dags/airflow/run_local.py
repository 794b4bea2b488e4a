"""Run one day of `recd_daily_retrain` through Airflow on this machine (`make run`).

`dag.test()` runs every task of a real DAG run in this process against the SQLite metadata
database in AIRFLOW_HOME (the Makefile sets it and migrates it first), with the embedded
settings of `recd_tasks.Settings`. Afterwards it prints the day's summary from the MLflow
run the pipeline recorded. Exit status: 0 when the DAG run succeeded.

    python dags/airflow/run_local.py [--date YYYY-MM-DD] [--dag recd_daily_retrain]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--date",
        help="the run's date (default: today, UTC): it trains on the day "
        "before yesterday and scores on yesterday, the last complete days",
    )
    p.add_argument("--dag", default="recd_daily_retrain")
    p.add_argument("--conf", default=None, help="JSON run conf (the comparison DAG's params)")
    a = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from airflow.dag_processing.dagbag import DagBag
    from recd_tasks import SETTINGS

    bag = DagBag(dag_folder=str(Path(__file__).parent), safe_mode=False)
    if bag.import_errors:
        for f, err in bag.import_errors.items():
            print(f"{f}: {err}", file=sys.stderr)
        return 1
    day = dt.date.fromisoformat(a.date) if a.date else dt.datetime.now(dt.UTC).date()
    logical = dt.datetime.combine(day, dt.time(), dt.UTC)
    _show_task_progress()
    dag = bag.get_dag(a.dag)
    # a Deadline Alert needs the DAG serialized by a DAG processor, which `dag.test()`
    # skips (Airflow 3.3 then fails looking its alert up): one local run is watched anyway
    dag.deadline = None
    run = dag.test(logical_date=logical, run_conf=json.loads(a.conf) if a.conf else None)
    state = str(getattr(run.state, "value", run.state))
    print_summary(a.dag, day, state, SETTINGS.tracking_uri)
    return 0 if state == "success" else 1


def _show_task_progress() -> None:
    """One line per task as `dag.test()` finishes it, with its time (Airflow's own log is
    quieted by the Makefile)."""
    import logging
    import time

    started: dict[str, float] = {}

    class Progress(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "[DAG TEST]" not in msg or "task_id=" not in msg:
                return
            task = msg.split("task_id=", 1)[1].split()[0]
            if "starting" in msg:
                started[task] = time.monotonic()
            elif "end task" in msg:
                took = time.monotonic() - started.get(task, time.monotonic())
                print(f"  {task:<12} {took:6.1f} s", file=sys.stderr, flush=True)

    logger = logging.getLogger("airflow.sdk.definitions.dag")
    logger.setLevel(logging.INFO)
    logger.addHandler(Progress())


def print_summary(dag_id: str, day: dt.date, state: str, tracking_uri: str | None) -> None:
    from recd_core.report import console
    from recd_core.report import print_summary as show

    if not tracking_uri:
        console.print(f"{dag_id} {day}: {state} (no tracking URI: figures in the task logs)")
        return
    from mlflow.tracking import MlflowClient

    from recd_core.mlops.metric_names import metric_name

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name("recd")
    runs = (
        client.search_runs(
            [exp.experiment_id],
            filter_string="tags.`recd.stage` = 'pipeline'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if exp
        else []
    )
    if not runs:
        console.print(f"{dag_id} {day}: {state}; no MLflow run found at {tracking_uri}")
        return
    m, t = runs[0].data.metrics, runs[0].data.tags
    keep = (
        "storage.bytes",
        "storage.ratio",
        "dpp.samples_per_s",
        "train.samples_per_s",
        "train.steps",
        "train.val_ne",
        "eval.ne",
        "eval.oracle_ne",
        "eval.auc",
        "eval.oracle_auc",
        "eval.calibration",
        "registry.version",
        "registry.challenger_ne",
        "registry.champion_ne",
    )
    try:
        path = client.download_artifacts(runs[0].info.run_id, "summary.json")
        summary = json.loads(Path(path).read_text())
    except Exception:  # noqa: BLE001 - a run that failed before writing it
        summary = {}
    started = summary.get("train.init_from", "?") or "scratch"  # "?": failed before training
    trained = t.get("ds") or "?"
    show(
        f"{dag_id} {day}: {state}",
        {
            "trained on": trained,
            "started from": started,
            **{k: m[metric_name(k)] for k in keep if metric_name(k) in m},
        },
    )
    if state != "success":
        console.print(f"[red]failed:[/red] {summary.get('error', 'see the task log above')}")
    elif "registry.decision" in summary:
        console.print(
            f"champion decision: {summary.get('registry.decision', '-')}"
            f" (model {summary.get('registry.model', '-')} v{summary.get('registry.version', '-')})"
            + (f": {summary['registry.reason']}" if summary.get("registry.reason") else "")
        )
    console.print(f"MLflow run {runs[0].info.run_id} [{t.get('recd.status')}]")
    console.print(
        "open the MLflow UI: make ui  (then "
        "http://127.0.0.1:5000/#/experiments?workflowType=machine_learning)"
    )


if __name__ == "__main__":
    sys.exit(main())
