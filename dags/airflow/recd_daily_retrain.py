"""
### recd_daily_retrain

Every day, once the day's logs are complete, retrain the DLRM on the previous day and judge
it on this one (the graph `recd_core.orchestration.graph.DAILY`; `recd run` runs the same one locally):

| task | does | writes |
|---|---|---|
| start | opens the MLflow run of this pipeline run | |
| synth | synthesizes logs for days without any (embedded default only) | logs |
| ingest | validates both days' raw logs; bad rows quarantined with a reason | events, quarantine |
| generate | session-clustered (and shuffled, for the storage figure) samples | samples |
| preprocess | DPP: transforms once per unique value, IKJT batches | batches |
| train | the DLRM, dedup-aware, checkpointed (a retry resumes) | models |
| evaluate | NE, AUC, log loss, calibration on the evaluation day | |
| register | MLflow model version `challenger`; `champion` if its NE is no worse | registry |
| finish | closes the MLflow run with every stage's figures | |

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
    doc_md=__doc__,
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
