"""
### recd_dedup_vs_baseline

Triggered by hand (`recd compare` runs the same graph, `recd_core.orchestration.graph.COMPARISON`,
locally). Both arms on the same data: the same samples, preprocessed as IKJT
(dedup) and KJT (baseline), trained, and evaluated on the next day; `compare` prints the
table, stores the chart (MLflow and `reports/compare/` in the warehouse) and fails when the
arms' NE or AUC differ beyond the configured tolerance.

Parameters: `ds` (the first training day), `days` (consecutive training days, each judged
on its next day), `preset` (synthetic workload size), `batch_size` (DPP and training).
Each preset gets its own warehouse under the compare root (`RECD_COMPARE_ROOT`) and its own
logs under `<logs>/_compare/`, so runs never mix workloads or touch the daily partitions.
"""

from airflow.sdk import Param, dag
from recd_tasks import SETTINGS, build, dag_options, override_args, override_params

from recd_core.orchestration.graph import COMPARISON
from recd_core.orchestration.stage_args import param_schema

PRESET = "{{ params.preset }}"
ROOT = f"{SETTINGS.compare_root}/{PRESET}"
LOGS = f"{SETTINGS.logs}/_compare/{PRESET}"  # raw logs stay files (the logs volume in pods)


@dag(
    dag_id=COMPARISON.name,
    description="Dedup (IKJT) and baseline (KJT) arms on the same days, side by side, gated",
    schedule=None,
    start_date=SETTINGS.start,
    catchup=False,
    tags=["recd", "benchmark"],
    doc_md=__doc__ + "\n" + COMPARISON.table(),
    params={
        "ds": Param("2026-11-01", format="date", **param_schema("ds")),
        "days": Param(1, **param_schema("days")),
        # a size whose throughput ratios stand clear of their run-to-run noise (50,000
        # samples a day, ~6 min on 2 CPUs); `small` is a smoke test: its ratios are noise
        "preset": Param(
            "default",
            **param_schema("preset")
            | {
                "description": "synthetic workload size: default (50,000 samples a day), "
                "standard (200,000); small (4,000) checks the wiring, its speed ratios are noise"
            },
        ),
        "batch_size": Param(512, **param_schema("batch_size")),
        **override_params(exclude=("batch_size", "mode")),
    },
    **dag_options(COMPARISON.name),
)
def recd_dedup_vs_baseline():
    base = {
        "warehouse": f"{ROOT}/warehouse",
        "logs": LOGS,
        "ds": "{{ params.ds }}",
        "days": "{{ params.days }}",
        "preset": "{{ params.preset }}",
        "batch_size": "{{ params.batch_size }}",
        "config": SETTINGS.config,
        "synthesize": True,  # the comparison runs on the synthetic workload of `preset`
        "tracking_uri": SETTINGS.tracking_uri,
        "pipeline": "recd_dedup_vs_baseline {{ params.ds }} x{{ params.days }} {{ params.preset }}",
        **override_args(exclude=("batch_size", "mode")),
    }
    # the warehouse is per preset (a template): no Asset can name it, and no consumer needs it
    build(COMPARISON, base, assets=False)


recd_dedup_vs_baseline()
