"""The pipeline's stages as orchestrator tasks: one definition, run in-process by an Airflow
worker, as a pod of the components image (Airflow's KubernetesPodOperator, Kubeflow), or by
hand (`python -m components.<stage>`).

Every stage takes one `StageArgs` (plain values an orchestrator can template) and returns
a JSON-safe summary (the contract keys), which becomes the task's XCom / output metadata.
Stages talk only through the warehouse and these summaries. With a tracking URI, `start`
opens the pipeline's MLflow run and every stage records a child run under it.

    start -> synth -> ingest -> generate -> preprocess(arm) -> train(arm) -> evaluate(arm)
          -> register (first arm: challenger, champion by NE) -> finish
          or, with both arms, -> compare (table, chart, quality gate) -> finish

`days` > 1 (the comparison DAG) runs each stage over consecutive training days
ds .. ds+days-1, each evaluated on its next day.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from recd_core.config import PipelineConfig, load_pipeline_config
from recd_core.tracking import Tracker
from recd_core.warehouse import Warehouse

STAGES = (
    "start",
    "synth",
    "ingest",
    "generate",
    "preprocess",
    "train",
    "evaluate",
    "register",
    "finish",
)


class StageArgs(BaseModel):
    """One stage invocation. Strings from templates are coerced (`days: "2"` -> 2)."""

    model_config = ConfigDict(extra="forbid")

    warehouse: str
    ds: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")  # the (first) training day
    days: int = Field(default=1, ge=1, le=31)
    logs: str | None = None  # raw JSON-lines logs root; missing days synthesized if `synthesize`
    synthesize: bool = True
    config: str | None = None  # pipeline YAML; the built-in synthetic config if unset
    # overrides the config's synth preset
    preset: Literal["small", "default", "standard"] | None = None
    batch_size: int | None = Field(default=None, gt=0)  # overrides DPP's and training's
    mode: Literal["dedup", "baseline"] = "dedup"
    model_uri: str | None = None  # evaluate: the trained model(s), ';'-joined over days
    tracking_uri: str | None = None
    experiment: str = "recd"
    parent_run_id: str | None = None
    pipeline: str = "recd"  # the parent run's name
    register_run_id: str | None = None  # register: the train run that logs the model
    # train: the model to start from (a model directory, `<warehouse>/models/<run>` or
    # `models:/<name>@<alias>`); default: the champion when the config's train.warm_start
    init_from: str | None = None

    def training_days(self) -> list[str]:
        first = dt.date.fromisoformat(self.ds)
        return [(first + dt.timedelta(days=k)).isoformat() for k in range(self.days)]

    def eval_day(self, day: str) -> str:
        return (dt.date.fromisoformat(day) + dt.timedelta(days=1)).isoformat()

    def all_days(self) -> list[str]:
        days = self.training_days()
        return [*days, self.eval_day(days[-1])]

    def pipeline_config(self) -> PipelineConfig:
        from recd_core.config import SYNTH_PRESETS, SynthConfig

        cfg = load_pipeline_config(self.config)
        update = {}
        if self.preset:
            update["synth"] = SynthConfig(
                **{**cfg.synth.model_dump(), **SYNTH_PRESETS[self.preset]}
            )
        if self.batch_size:
            update["preprocess"] = cfg.preprocess.model_copy(update={"batch_size": self.batch_size})
            update["train"] = cfg.train.model_copy(update={"batch_size": self.batch_size})
        return cfg.model_copy(update=update)

    def tracker(self) -> Tracker | None:
        return Tracker(self.tracking_uri, self.experiment) if self.tracking_uri else None


class StageFailed(Exception):
    """A stage could not do its work for a reason the input explains (bad input, a failed
    quality gate): retrying will not help. `code` is the CLI's exit code for it."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _per_day(args: StageArgs, fn: Callable[[str], dict]) -> dict:
    """Run `fn` per training day. One day: its summary. Several: each under `days.<ds>`,
    and at the top the first day's labels (mode, ...) with the mean of every number."""
    days = args.training_days()
    if len(days) == 1:
        return fn(days[0])
    per = {d: fn(d) for d in days}
    first = per[days[0]]
    out: dict = {k: v for k, v in first.items() if isinstance(v, str | bool)}
    for k, v in first.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            vals = [s.get(k) for s in per.values()]
            if all(isinstance(x, int | float) for x in vals):
                out[k] = sum(vals) / len(vals)
    return {**out, "days": per}


def _start(args: StageArgs) -> dict:
    tracker = args.tracker()
    if tracker is None:
        return {"mlflow.run_id": None}
    tracker.check()
    run_id = tracker.start("pipeline", {**args.model_dump(exclude_none=True), "mode": ""},
                           pipeline=args.pipeline)  # fmt: skip
    tracker.log_config(run_id, args.pipeline_config())
    return {"mlflow.run_id": run_id}


def _synth(args: StageArgs) -> dict:
    from recd_core.pipeline import ensure_logs

    if not args.logs:
        raise StageFailed("no --logs root given")
    if not args.synthesize:
        return {"synth.days": 0, "synth.rows": 0}
    return ensure_logs(Path(args.logs), args.all_days(), args.pipeline_config())


def _ingest(args: StageArgs) -> dict:
    from recd_core.pipeline import ingest_day

    if not args.logs:
        raise StageFailed("no --logs root given")
    cfg, wh = args.pipeline_config(), Warehouse(args.warehouse)
    out = {day: ingest_day(wh, Path(args.logs), day, cfg) for day in args.all_days()}
    first = out[args.ds]
    return {**first, "ingest.days": {d: s["ingest.rows_ok"] for d, s in out.items()}}


def _generate(args: StageArgs) -> dict:
    from recd_core.pipeline import generate_eval_day, generate_training_day

    cfg, wh = args.pipeline_config(), Warehouse(args.warehouse)

    def one(day: str) -> dict:
        s = generate_training_day(wh, day, cfg)
        layouts = s.pop("layouts")
        s["storage.bytes.dedup"] = layouts["clustered"]["storage.bytes"]
        s["storage.bytes.baseline"] = layouts["shuffled"]["storage.bytes"]
        return s

    out = _per_day(args, one)
    generate_eval_day(wh, args.eval_day(args.training_days()[-1]), cfg)
    return out


def _preprocess(args: StageArgs) -> dict:
    from recd_core.dpp import preprocess

    cfg, wh = args.pipeline_config(), Warehouse(args.warehouse)
    prep = cfg.preprocess.model_copy(update={"mode": args.mode})
    return _per_day(args, lambda day: preprocess(wh, day, prep))


def _train(args: StageArgs) -> dict:
    """Train each day, warm-started from `init_from` (default: the champion, when the
    config's `train.warm_start` is on and there is one)."""
    from recd_core.pipeline import warm_start
    from recd_core.train import train

    cfg, wh = args.pipeline_config(), Warehouse(args.warehouse)
    tc = cfg.train.model_copy(update={"mode": args.mode})
    with warm_start(args.tracker(), cfg, args.init_from) as (init_dir, label):
        out = _per_day(args, lambda day: train(wh, day, tc, init_from=init_dir, init_label=label))
    uris = [s["train.model_uri"] for s in (out["days"].values() if "days" in out else [out])]
    return {**out, "train.model_uris": ";".join(uris)}


def _evaluate(args: StageArgs) -> dict:
    from recd_core.evaluate import evaluate
    from recd_core.pipeline import oracle_figures

    if not args.model_uri:
        raise StageFailed("no --model-uri given")
    cfg, wh = args.pipeline_config(), Warehouse(args.warehouse)
    uris = dict(zip(args.training_days(), args.model_uri.split(";"), strict=True))
    logs = Path(args.logs) if args.logs else None
    return _per_day(
        args,
        lambda day: {
            "train.mode": args.mode,
            **evaluate(wh, uris[day], args.eval_day(day), cfg.registry.eval_batch_size),
            **oracle_figures(logs, args.eval_day(day)),
        },
    )


def _register(args: StageArgs) -> dict:
    """Log the last day's model to the train run, register it, decide the champion."""
    from recd_core.evaluate import evaluate
    from recd_core.registry import register_and_promote

    tracker = args.tracker()
    if tracker is None:
        return {"registry.decision": "off (no tracking URI)"}
    if not args.model_uri or not args.register_run_id:
        raise StageFailed("--model-uri and --register-run-id are required")
    cfg, wh = args.pipeline_config(), Warehouse(args.warehouse)
    eval_ds, uri = args.eval_day(args.training_days()[-1]), args.model_uri.split(";")[-1]
    # scored here again (seconds), so the stage needs only the train stage's outputs
    ne = evaluate(wh, uri, eval_ds, cfg.registry.eval_batch_size)["eval.ne"]
    return register_and_promote(tracker, wh, uri, args.register_run_id, eval_ds, ne, cfg.registry)


def _compare(args: StageArgs, upstream: list[dict]) -> dict:
    """Both arms side by side: the table in the task log, the chart in MLflow (the pipeline
    run) and in the warehouse (`reports/compare/ds=D/`), and the quality gate."""
    import tempfile

    from recd_core.compare import chart, quality_gap, ratios, table_rows

    cfg = args.pipeline_config()
    summary = merge(
        upstream, {"run.ds": args.ds, "run.eval_ds": args.eval_day(args.training_days()[-1])}
    )
    missing = [k for k in ("eval.ne.dedup", "eval.ne.baseline") if k not in summary]
    if missing:
        raise StageFailed(f"upstream summaries lack {', '.join(missing)}")
    for label, d, b, gain in table_rows(summary):
        print(f"{label:<26} dedup {d:>14,.4f}   baseline {b:>14,.4f}   {gain}")
    wh = Warehouse(args.warehouse)
    with tempfile.TemporaryDirectory() as tmp:
        png = chart(summary, Path(tmp) / f"compare-{args.ds}.png")
        target = f"{wh.root}/reports/compare/ds={args.ds}"
        wh.fs.create_dir(target, recursive=True)
        with wh.fs.open_output_stream(f"{target}/{png.name}") as f:
            f.write(png.read_bytes())
        tracker = args.tracker()
        if tracker is not None and args.parent_run_id:
            tracker.client().log_artifact(args.parent_run_id, str(png))
    gap = quality_gap(
        summary, cfg.registry.compare_ne_tolerance, cfg.registry.compare_auc_tolerance
    )
    out = {
        "compare.chart": f"{wh.uri.rstrip('/')}/reports/compare/ds={args.ds}/{png.name}",
        "compare.quality_ok": gap is None,
        **ratios(summary),
    }
    if gap:
        raise StageFailed(gap, 3)
    return out


def _finish(args: StageArgs, upstream: list[dict]) -> dict:
    """Close the pipeline run. Its summary: the stages' figures, merged (see `merge`)."""
    return merge(upstream, {"pipeline.ds": args.ds, "pipeline.days": args.days})


IMPLS: dict[str, Callable[[StageArgs], dict]] = {
    "start": _start,
    "synth": _synth,
    "ingest": _ingest,
    "generate": _generate,
    "preprocess": _preprocess,
    "train": _train,
    "evaluate": _evaluate,
    "register": _register,
}
# the stages that work on other stages' summaries
UPSTREAM_IMPLS: dict[str, Callable[[StageArgs, list[dict]], dict]] = {
    "compare": _compare,
    "finish": _finish,
}


def with_upstream(
    args: dict, start: str | dict | None = None, train: str | dict | None = None
) -> dict:
    """Fill the arguments that come from upstream summaries (orchestrators that pass whole
    outputs, e.g. Kubeflow): the pipeline's MLflow run from `start`'s, the trained model(s)
    and the train run from `train`'s."""
    out = dict(args)
    s = json.loads(start) if isinstance(start, str) and start else (start or {})
    t = json.loads(train) if isinstance(train, str) and train else (train or {})
    if s.get("mlflow.run_id"):
        out.setdefault("parent_run_id", s["mlflow.run_id"])
    if t.get("train.model_uris"):
        out.setdefault("model_uri", t["train.model_uris"])
        if t.get("mlflow.run_id"):
            out.setdefault("register_run_id", t["mlflow.run_id"])
    return out


def run_stage(name: str, args: StageArgs | dict, upstream: list[dict] | None = None) -> dict:
    """Run one stage and record it (a child of the pipeline run); return its summary.

    Errors a retry cannot fix (bad input, quality gate, unknown partition) become
    `StageFailed` with a one-line reason; the stage's MLflow run and the pipeline's run are
    closed FAILED. `upstream` (compare, finish): the other stages' summaries."""
    from recd_core.config import ConfigError
    from recd_core.ingest import QuarantineExceeded
    from recd_core.sources import SourceError
    from recd_core.tracking import TrackingError
    from recd_core.warehouse import PartitionNotFound

    if name not in IMPLS and name not in UPSTREAM_IMPLS:
        raise StageFailed(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    if isinstance(args, dict):
        # templated values an orchestrator could not fill arrive as "" or "None": unset
        args = {k: v for k, v in args.items() if v not in (None, "", "None")}
        try:
            args = StageArgs.model_validate(args)
        except ValueError as e:
            raise StageFailed(f"bad arguments: {e}") from None
    tracker = args.tracker()
    run_id = None
    if tracker is not None and name not in ("start", "finish") and args.parent_run_id:
        params = args.model_dump(exclude_none=True)
        if name in ("synth", "ingest", "generate"):  # data stages serve both arms
            params["mode"] = ""
        run_id = tracker.start(name, params, parent_id=args.parent_run_id)
    try:
        if name in UPSTREAM_IMPLS:
            summary = UPSTREAM_IMPLS[name](args, upstream or [])
        else:
            summary = IMPLS[name](args)
    except Exception as e:
        failure = _failure(
            e,
            (ConfigError, SourceError, PartitionNotFound, ValueError),
            QuarantineExceeded,
            TrackingError,
        )
        if tracker is not None:
            for rid in (run_id, args.parent_run_id):
                if rid:
                    with contextlib.suppress(TrackingError):
                        tracker.finish(rid, {"status": "failed", "error": f"{name}: {failure}"})
        if isinstance(failure, StageFailed):
            raise failure from None
        raise
    summary = {"status": "ok", **_json_safe(summary)}
    if tracker is not None:
        if name == "finish" and args.parent_run_id:
            tracker.finish(args.parent_run_id, summary)
            summary["mlflow.run_id"] = args.parent_run_id
        elif run_id:
            tracker.finish(run_id, summary)
            summary["mlflow.run_id"] = run_id
    return summary


def _failure(e: Exception, bad_input: tuple, gate: type, tracking: type) -> Exception:
    if isinstance(e, StageFailed):
        return e
    if isinstance(e, gate):
        return StageFailed(str(e), 3)
    if isinstance(e, tracking):
        return StageFailed(str(e), 4)
    if isinstance(e, bad_input):
        return StageFailed(str(e).strip(), 2)
    return e


def merge(upstream: list[dict], base: dict) -> dict:
    """The pipeline run's summary: each stage's contract keys; an arm's keys suffixed with
    its mode (`train.samples_per_s.dedup`), the first (dedup) arm's also unsuffixed."""
    out = dict(base)
    for s in upstream:
        if not s:
            continue
        mode = s.get("train.mode") or s.get("dpp.mode")
        for k, v in s.items():
            if k in ("status", "mlflow.run_id") or isinstance(v, dict):
                continue
            if mode:
                out[f"{k}.{mode}"] = v
                if mode == "dedup" or k not in out:
                    out[k] = v
            else:
                out.setdefault(k, v)
    return out


def _json_safe(obj):
    """A summary as XCom / output metadata can carry it: plain JSON, NaN and inf as null."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, str | bool | int | float | type(None)):
        return obj
    if hasattr(obj, "item"):  # numpy scalars
        return _json_safe(obj.item())
    return str(obj)
