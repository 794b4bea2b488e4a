"""One day of the pipeline, in-process: the stages in order, each through its public function.

Stages talk only through the warehouse and their summaries (DESIGN.md section 1). Today
the data plane runs: synthesize logs for the day if none exist, ingest, generate both
layouts. Preprocessing, training and evaluation join as they land.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from recd_core.config import PipelineConfig, SynthConfig
from recd_core.datagen import generate
from recd_core.ingest import ingest
from recd_core.synth import synthesize
from recd_core.warehouse import Warehouse


def logs_for_day(logs: Path, ds: str) -> Path:
    return logs / f"ds={ds}"


def ensure_logs(logs: Path, ds: str, pipeline: PipelineConfig) -> dict:
    """Generate the day's synthetic logs unless some already exist."""
    day = logs_for_day(logs, ds)
    if day.is_dir() and any(day.iterdir()):
        return {"synth.skipped": True}
    cfg = SynthConfig(
        **{**pipeline.synth.model_dump(), "start_date": dt.date.fromisoformat(ds), "days": 1}
    )
    return synthesize(pipeline.features, cfg, logs)


def run_day(
    warehouse: Warehouse, ds: str, logs: Path, pipeline: PipelineConfig, progress=None
) -> dict:
    summary: dict = {"run.ds": ds, "run.warehouse": warehouse.uri}
    summary.update(ensure_logs(logs, ds, pipeline))
    if progress:
        progress("synth", 1)
    summary.update(
        ingest(
            logs_for_day(logs, ds),
            warehouse,
            ds,
            pipeline.features,
            pipeline.ingest,
            pipeline.generate,
        )
    )
    if progress:
        progress("ingest", 1)
    summary.update(generate(warehouse, ds, pipeline.generate, layouts=("clustered", "shuffled")))
    if progress:
        progress("generate", 1)
    return summary
