"""The environment every Airflow process of the tests runs in: its own home, the repository's
DAG folder, and the recd settings the DAG files read (a warehouse, logs and MLflow store
under `root`, the small preset's config). `recd` keyword arguments add `RECD_<NAME>` values."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DAGS = REPO / "dags" / "airflow"


def airflow_env(home: Path, root: Path, **recd) -> dict:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "RECD_WAREHOUSE": str(root / "wh"),
        "RECD_LOGS": str(root / "logs"),
        "RECD_COMPARE_ROOT": str(root / "compare"),
        "RECD_TRACKING_URI": f"sqlite:///{root}/mlflow.db",
        "RECD_CONFIG": str(REPO / "tests/configs/small.yaml"),  # days of seconds
    }
    env.update({f"RECD_{k.upper()}": str(v) for k, v in recd.items()})
    return env
