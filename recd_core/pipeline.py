"""One day of the pipeline, in-process: the stages in order, each through its public function.

Stages talk only through the warehouse and their summaries:

    logs(D), logs(D+1)   synthesized when absent (the embedded default)
    ingest D, D+1        events + quarantine
    generate D           clustered and shuffled samples (storage figures of both arms)
    generate D+1         clustered samples: the evaluation day
    per arm (dedup, baseline or both, on the same samples):
        preprocess D  ->  train D (from the champion's weights: warm start)
                      ->  evaluate on D+1 (with the oracle's NE when D+1 is synthetic)
    register             the first arm's model: MLflow pyfunc, alias `challenger`
    promote              `champion` := challenger if its NE on D+1 is no worse than the
                         champion's NE on D+1 (registry.py)

With a tracking run (`RunHandle`) each arm becomes a child run holding the contract keys of
its side (`storage.bytes` of its layout, `dpp.samples_per_s`, `train.samples_per_s`,
`eval.ne`, `eval.auc`, ...), nested under the command's run, which holds the whole summary.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from recd_core.config import PipelineConfig, SynthConfig
from recd_core.datagen import generate
from recd_core.ingest import ingest
from recd_core.synth import synthesize
from recd_core.warehouse import Warehouse

ARM_LAYOUT = {"dedup": "clustered", "baseline": "shuffled"}
ARM_KEYS = (
    "dpp.samples",
    "dpp.samples_per_s",
    "dpp.bytes_out",
    "train.samples_per_s",
    "train.loss",
    "train.steps",
    "train.peak_mem_bytes",
    "train.model_uri",
    "train.init_from",
    "train.init_reason",
    "train.val_ne",
    "train.best_step",
    "train.history",
    "eval.ne",
    "eval.auc",
    "eval.logloss",
    "eval.calibration",
)
OPTIONAL_ARM_KEYS = ("eval.oracle_ne", "eval.oracle_auc")


def logs_for_day(logs: Path, ds: str) -> Path:
    return logs / f"ds={ds}"


def next_day(ds: str) -> str:
    return (dt.date.fromisoformat(ds) + dt.timedelta(days=1)).isoformat()


def ensure_logs(logs: Path, days: list[str], pipeline: PipelineConfig) -> dict:
    """Synthesize the days that have no logs yet; consecutive missing days in one run, so
    the users' click histories carry over from one day to the next."""
    missing = sorted(
        d
        for d in set(days)
        if not (logs_for_day(logs, d).is_dir() and any(logs_for_day(logs, d).iterdir()))
    )
    runs: list[list[dt.date]] = []
    for d in map(dt.date.fromisoformat, missing):
        if runs and (d - runs[-1][-1]).days == 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    rows = 0
    for run in runs:
        cfg = SynthConfig(**{**pipeline.synth.model_dump(), "start_date": run[0], "days": len(run)})
        rows += synthesize(pipeline.features, cfg, logs)["synth.rows"]
    return {"synth.days": len(missing), "synth.rows": rows}


def ingest_day(warehouse: Warehouse, logs: Path, day: str, pipeline: PipelineConfig) -> dict:
    """Raw logs of one day -> `events/ds=day` (+ quarantine)."""
    cfg = pipeline
    return ingest(logs_for_day(logs, day), warehouse, day, cfg.features, cfg.ingest, cfg.generate)


def generate_training_day(warehouse: Warehouse, day: str, pipeline: PipelineConfig) -> dict:
    """Both layouts of a training day: clustered for the dedup arm, shuffled for the baseline."""
    return generate(
        warehouse, day, pipeline.generate, layouts=(ARM_LAYOUT["dedup"], ARM_LAYOUT["baseline"])
    )


def generate_eval_day(warehouse: Warehouse, day: str, pipeline: PipelineConfig) -> dict:
    """The evaluation day: clustered samples only (every model scores the same rows)."""
    return generate(warehouse, day, pipeline.generate, layouts=("clustered",))


def prepare_data(
    warehouse: Warehouse,
    ds: str,
    eval_ds: str,
    logs: Path,
    pipeline: PipelineConfig,
    progress=None,
    synthesize: bool = True,
) -> dict:
    """Logs -> events -> samples for the training day (both layouts) and the evaluation day.
    Days without logs are synthesized only when `synthesize` (the embedded default)."""
    summary = ensure_logs(logs, [ds, eval_ds], pipeline) if synthesize else {}
    step = progress or (lambda *_: None)
    step("synth", 1)
    summary.update(ingest_day(warehouse, logs, ds, pipeline))
    ingest_day(warehouse, logs, eval_ds, pipeline)
    step("ingest", 1)
    summary.update(generate_training_day(warehouse, ds, pipeline))
    generate_eval_day(warehouse, eval_ds, pipeline)
    step("generate", 1)
    return summary


def run_arm(
    warehouse: Warehouse,
    ds: str,
    eval_ds: str,
    mode: str,
    pipeline: PipelineConfig,
    tracker=None,
    logs: Path | None = None,
) -> dict:
    """DPP, training (warm-started from the champion when `train.warm_start`) and next-day
    evaluation of one arm; the arm's contract figures."""
    from recd_core.dpp import preprocess  # torch loads only when a run trains
    from recd_core.evaluate import evaluate
    from recd_core.train import train

    out = {"mode": mode}
    out.update(preprocess(warehouse, ds, pipeline.preprocess.model_copy(update={"mode": mode})))
    with warm_start(tracker, pipeline) as (init_dir, label):
        cfg = pipeline.train.model_copy(update={"mode": mode})
        out.update(train(warehouse, ds, cfg, init_from=init_dir, init_label=label))
    out.update(
        evaluate(warehouse, out["train.model_uri"], eval_ds, pipeline.registry.eval_batch_size)
    )
    out.update(oracle_figures(logs, eval_ds))
    return out


def warm_start(tracker, pipeline: PipelineConfig, init_from: str | None = None):
    """Where the pipelines' training starts (a context: a registry copy is downloaded):
    `init_from` when given, else the champion when `train.warm_start` and there is one,
    else scratch with the reason."""
    from recd_core.registry import init_model

    default = "champion" if pipeline.train.warm_start else None
    return init_model(tracker, init_from or default, pipeline.registry.model_name)


def oracle_figures(logs: Path | None, eval_ds: str) -> dict:
    """`eval.oracle_ne` / `eval.oracle_auc`: the optimum on a synthetic evaluation day (the
    true click probabilities synth drew its labels from); nothing for real logs."""
    from recd_core.synth import read_oracle

    oracle = read_oracle(logs_for_day(logs, eval_ds)) if logs is not None else None
    if not oracle:
        return {}
    return {"eval.oracle_ne": oracle["ne"], "eval.oracle_auc": oracle["auc"]}


def run_day(
    warehouse: Warehouse,
    ds: str,
    logs: Path,
    pipeline: PipelineConfig,
    modes: tuple[str, ...] = ("dedup",),
    progress=None,
    run=None,
    eval_ds: str | None = None,
    register: bool = True,
    synthesize: bool = True,
) -> dict:
    """All stages for day `ds`, evaluated on `eval_ds` (default: the day after). Returns the
    summary: the first arm's figures under the contract keys, every arm's under
    `<key>.<mode>`, and with a tracking run, the registry decision."""
    eval_ds = eval_ds or next_day(ds)
    step = progress or (lambda *_: None)
    summary: dict = {"run.ds": ds, "run.eval_ds": eval_ds, "run.warehouse": warehouse.uri}
    summary.update(prepare_data(warehouse, ds, eval_ds, logs, pipeline, step, synthesize))
    layouts = summary.pop("layouts")
    arms = {}
    for mode in modes:
        arm = run_arm(warehouse, ds, eval_ds, mode, pipeline, run and run.tracker, logs)
        layout = layouts[ARM_LAYOUT[mode]]
        arms[mode] = {
            "storage.bytes": layout["storage.bytes"],
            "storage.rows": layout["storage.rows"],
            "storage.bytes_per_sample": layout["storage.bytes_per_sample"],
            **{k: arm.get(k) for k in ARM_KEYS},
            **{k: arm[k] for k in OPTIONAL_ARM_KEYS if k in arm},
        }
        if run is not None:
            arms[mode]["mlflow.run_id"] = run.child(
                "arm", {"mode": mode, "ds": ds, "eval_ds": eval_ds}, {"status": "ok", **arms[mode]}
            )
        step(f"train {mode}", 1)
    for mode, arm in arms.items():
        summary.update({f"{k}.{mode}": v for k, v in arm.items()})
    first = arms[modes[0]]
    summary.update({k: first[k] for k in (*ARM_KEYS, *OPTIONAL_ARM_KEYS) if k in first})
    if {"dedup", "baseline"} <= arms.keys():
        from recd_core.compare import ratios

        summary.update(ratios(summary))
    if run is not None and register:
        from recd_core.registry import register_and_promote

        first = arms[modes[0]]
        summary.update(
            register_and_promote(
                run.tracker,
                warehouse,
                first["train.model_uri"],
                first["mlflow.run_id"],
                eval_ds,
                first["eval.ne"],
                pipeline.registry,
            )  # fmt: skip
        )
    return summary
