"""
### recd_daily_retrain

Every day, once the day's logs are complete, retrain the DLRM on the previous day and judge
it on this one (the graph `recd_core.orchestration.graph.DAILY`; `recd run` runs the same one
locally; its tasks are tabled below, from the graph).

Keyed by the data interval: the run for interval [D, D+1) trains on D-1 and evaluates on D,
so re-running a day replaces that day's partitions (idempotent) and records a new MLflow run.
"""

from airflow.sdk import dag
from recd_tasks import SETTINGS, build, default_args

from recd_core.orchestration.graph import DAILY

TRAIN_DAY = "{{ macros.ds_add(ds, -1) }}"


@dag(
    dag_id=DAILY.name,
    schedule=SETTINGS.schedule or None,
    start_date=SETTINGS.start,
    catchup=False,
    max_active_runs=1,
    default_args=default_args(),
    tags=["recd"],
    doc_md=__doc__ + "\n" + DAILY.table(),
)
def recd_daily_retrain():
    build(
        DAILY,
        {
            "warehouse": SETTINGS.warehouse,
            "logs": SETTINGS.logs,
            "ds": TRAIN_DAY,
            "config": SETTINGS.config,
            "synthesize": SETTINGS.synthesize,
            "tracking_uri": SETTINGS.tracking_uri,
            "pipeline": "recd_daily_retrain {{ ds }}",
        },
    )


recd_daily_retrain()
