"""One day of the pipeline, in-process: the stages in order, each through its public function.

Stages talk only through the warehouse and their summaries (DESIGN.md section 1): synthesize
logs for the day if none exist, ingest, generate both layouts, train (dedup, baseline or
both arms on the same batches). preprocess (DPP) and train each arm. Evaluation joins when it lands.
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
    warehouse: Warehouse,
    ds: str,
    logs: Path,
    pipeline: PipelineConfig,
    modes: tuple[str, ...] = ("dedup",),
    progress=None,
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
    from recd_core.dpp import preprocess  # torch loads only when a run trains
    from recd_core.train import train

    for mode in modes:
        prep = preprocess(warehouse, ds, pipeline.preprocess.model_copy(update={"mode": mode}))
        summary.update(
            {
                f"{k}.{mode}" if len(modes) > 1 else k: prep[k]
                for k in ("dpp.samples_per_s", "dpp.bytes_out")
            }
        )
        result = train(warehouse, ds, pipeline.train.model_copy(update={"mode": mode}))
        keys = (
            "train.samples_per_s",
            "train.loss",
            "train.steps",
            "train.peak_mem_bytes",
            "train.model_uri",
        )
        summary.update({f"{k}.{mode}" if len(modes) > 1 else k: result[k] for k in keys})
        if progress:
            progress(f"train {mode}", 1)
    if len(modes) > 1:
        summary["train.speedup"] = (
            summary["train.samples_per_s.dedup"] / summary["train.samples_per_s.baseline"]
        )
    return summary
