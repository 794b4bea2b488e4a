"""Stage summaries, the only thing stages hand each other besides the warehouse: an
upstream summary's keys pulled into a stage's arguments (`with_upstream`, per
`graph.Stage.pulls`), the run's summaries merged into the pipeline's (`merge`: an arm's
keys suffixed with its mode), and a summary made plain JSON for XCom and output metadata
(`json_safe`)."""

from __future__ import annotations

import json
import math

from recd_core.orchestration.graph import STAGES


def with_upstream(stage: str, args: dict, summaries: dict[str, str | dict | None]) -> dict:
    """Fill the arguments `stage` takes from upstream summaries (`graph.Stage.pulls`), given
    as {upstream stage: its summary, a dict or JSON}: e.g. the pipeline's MLflow run from
    start's, the trained model(s) and the train run from train's. Given arguments win."""
    out = dict(args)
    for pull in STAGES[stage].pulls if stage in STAGES else ():
        raw = summaries.get(pull.stage)
        summary = json.loads(raw) if isinstance(raw, str) and raw else (raw or {})
        if summary.get(pull.key) is not None:
            out.setdefault(pull.arg, summary[pull.key])
    return out


def merge(upstream: list[dict], base: dict) -> dict:
    """The pipeline run's summary: each stage's contract keys; an arm's keys suffixed with
    its mode (`train.samples_per_s.dedup`), the first (dedup) arm's also unsuffixed; each
    stage's MLflow run as `mlflow.run_id.<stage>[.<mode>]`."""
    out = dict(base)
    for s in upstream:
        if not s:
            continue
        mode = s.get("train.mode") or s.get("dpp.mode")
        if s.get("stage") and s.get("mlflow.run_id"):
            out[f"mlflow.run_id.{s['stage']}" + (f".{mode}" if mode else "")] = s["mlflow.run_id"]
        for k, v in s.items():
            if k in ("status", "stage", "mlflow.run_id") or isinstance(v, dict):
                continue
            if mode:
                out[f"{k}.{mode}"] = v
                if mode == "dedup" or k not in out:
                    out[k] = v
            else:
                out.setdefault(k, v)
    return out


def json_safe(obj):
    """A summary as XCom / output metadata can carry it: plain JSON, NaN and inf as null."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, str | bool | int | float | type(None)):
        return obj
    if hasattr(obj, "item"):  # numpy scalars
        return json_safe(obj.item())
    return str(obj)
