"""
### recd_daily_retrain

Every day, retrain the DLRM on the last complete days and judge it (the graph
`recd_core.orchestration.graph.DAILY`; `recd run` runs the same one locally; its tasks are
tabled below, from the graph).

**Which days.** The timetable is declared here (a cron trigger, UTC), so Airflow's
`create_cron_data_intervals` setting cannot change it. A run that starts at T (the end of
its data interval) reads only days that are over by T: it scores on the last complete day
and trains on the day before (`recd_core/orchestration/schedule.py`): the run of
2026-11-25 00:00 trains on 2026-11-23 and scores on 2026-11-24. `wait_for_logs` then waits
until the log producer has marked both days complete (`_SUCCESS` in `<logs>/ds=<day>/`),
failing with the missing days after `RECD_LOGS_WAIT_HOURS`. Catch-up and backfill run one
day at a time, in order, each warm-started from the champion the day before left. Without
catch-up a manual run can go beside a scheduled run still waiting for its logs.

**Parameters** (a manual run): `ds` (the training day; empty: from the run's time), `config`
(a pipeline config YAML), `mode` (the arm: dedup or baseline), and under "Config
overrides" each value the config holds that a run may change (`epochs`, `nproc`,
`sharding`, ...; empty: the config's).

**Operations.** Every task has an execution timeout (training's from the config's
`train.timeout_minutes`), the run a `dagrun_timeout`; a failed run and a run past its
deadline (`RECD_DEADLINE_HOURS` after it was queued: a Deadline Alert) go to the notifier
(`RECD_NOTIFIER`, default: an ERROR line in the log). Re-running a day replaces its
partitions (idempotent) and records a new MLflow run.
"""

from airflow.sdk import Param, dag
from airflow.timetables.trigger import CronTriggerTimetable
from recd_tasks import SETTINGS, build, dag_options, override_args, override_params

from recd_core.orchestration.graph import DAILY
from recd_core.orchestration.schedule import training_day
from recd_core.orchestration.stage_args import param_schema

# an explicit `ds` wins; else the days are over when the run starts (a manual run without
# a logical date: its run_after)
TRAIN_DAY = "{{ params.ds or recd_training_day(data_interval_end or dag_run.run_after) }}"


@dag(
    dag_id=DAILY.name,
    description="Daily DLRM retraining on the last complete day, deduplicated (RecD)",
    schedule=CronTriggerTimetable(SETTINGS.schedule, timezone="UTC") if SETTINGS.schedule else None,
    start_date=SETTINGS.start,
    catchup=SETTINGS.catchup,
    # catch-up runs the missed days in order, one at a time (each warm-starts from the day
    # before's champion); otherwise a second run may go beside the scheduled one, so a manual
    # run of a past day does not queue behind a run waiting hours for today's logs (a
    # scheduled run comes once a day, and waits RECD_LOGS_WAIT_HOURS at most)
    max_active_runs=1 if SETTINGS.catchup else 2,
    tags=["recd"],
    doc_md=__doc__ + "\n" + DAILY.table(),
    user_defined_macros={"recd_training_day": training_day},
    params={
        # nullable, so the trigger form starts with nothing to type (a date picker for ds)
        "ds": Param(
            None,
            format="date",
            **param_schema("ds", nullable=True)
            | {"description": "training day YYYY-MM-DD (empty: from the run's time)"},
        ),
        "config": Param(SETTINGS.config or None, **param_schema("config", nullable=True)),
        "mode": Param("dedup", **param_schema("mode")),
        **override_params(exclude=("mode",)),
    },
    **dag_options(DAILY.name),
)
def recd_daily_retrain():
    build(
        DAILY,
        {
            "warehouse": SETTINGS.warehouse,
            "logs": SETTINGS.logs,
            "ds": TRAIN_DAY,
            "config": "{{ params.config or '' }}",
            "mode": "{{ params.mode }}",
            "synthesize": SETTINGS.synthesize,
            "tracking_uri": SETTINGS.tracking_uri,
            # the kind, the day and how it was started (manual, scheduled, backfill)
            # (an enum, written `DagRunType.MANUAL`: shown as `manual`)
            "pipeline": "recd_daily_retrain "
            + TRAIN_DAY
            + " {{ dag_run.run_type | string | replace('DagRunType.', '') | lower }}",
            **override_args(exclude=("mode",)),
        },
    )


recd_daily_retrain()
