"""What a stage leaves for Kubeflow beside its summary: the typed outputs of
`graph.outputs(stage)`, written as the KFP executor contract asks (each artifact's file at
the local path its URI maps to, and their metadata in the executor output file), so the
run's lineage, its Metrics and its Markdown report show in the Kubeflow UI.

    dataset  a JSON pointer to the day's warehouse partition(s); metadata: their URIs,
             rows and bytes (the data stays in the warehouse: no copy into the pipeline root)
    model    a JSON pointer to the trained model (`<warehouse>/models/<run>`); its metadata
    metrics  the summary's figures (numbers only)
    markdown both arms side by side (compare, the comparison's finish), else the run's
             headline figures (the daily finish)

The image needs no kfp: the contract is plain JSON (`{{$}}`, the executor input, in;
`outputs.outputFile` out).
"""

from __future__ import annotations

import json
from pathlib import Path

from recd_core.data.logs_root import logs_for_day
from recd_core.mlops.compare import markdown as comparison_markdown
from recd_core.mlops.tracking import HEADLINE, headline_rank
from recd_core.orchestration.graph import ARMS, OUTPUT_NAMES, STAGES, outputs
from recd_core.orchestration.stage_args import StageArgs
from recd_core.orchestration.stages import open_warehouse, stage_days
from recd_core.orchestration.summaries import merge

# where the KFP launcher mounts a remote pipeline root in the pod (kfp.dsl.types.artifact_types)
_MOUNTS = {"gs://": "/gcs/", "s3://": "/s3/", "minio://": "/minio/"}
# a gathering stage's Metrics and report show the headline figures (`tracking.HEADLINE`);
# the stages' own Metrics hold the detail


def local_path(uri: str) -> Path:
    """The file an output artifact's URI is written through (KFP's mapping)."""
    for prefix, mount in _MOUNTS.items():
        if uri.startswith(prefix):
            return Path(mount + uri[len(prefix) :])
    return Path(uri)


def _figures(summary: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in summary.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _datasets(stage: str, args: StageArgs, table: str) -> tuple[dict, dict]:
    """(pointer, metadata) of the partitions `stage` wrote to `table` on its days."""
    days = stage_days(stage, args)
    if table == "logs":
        uris = [str(logs_for_day(args.logs, d)) for d in days]
        return {"partitions": uris}, {"uris": uris, "days": days}
    wh = open_warehouse(args)
    parts, rows, nbytes = [], 0, 0
    for day in days:
        for keys in wh.keys_on(table, day):
            m = wh.manifest(table, day, **keys)
            parts.append(
                {
                    "uri": wh.partition_uri(table, day, **keys),
                    "ds": day,
                    **keys,
                    "rows": m["rows"],
                    "bytes": m["bytes"],
                }
            )
            rows, nbytes = rows + m["rows"], nbytes + m["bytes"]
    meta = {"uris": [p["uri"] for p in parts], "days": days, "rows": rows, "bytes": nbytes}
    return {"partitions": parts}, meta


def _report(args: StageArgs, summary: dict, upstream: list[dict]) -> str:
    """Both arms side by side where the upstream summaries hold both, else the headline."""
    days = {"run.ds": args.ds, "run.eval_ds": args.eval_day(args.training_days()[-1])}
    merged = merge(upstream, {**days, **summary})
    if all(f"eval.ne.{arm}" in merged for arm in ARMS):
        return comparison_markdown(merged)
    rows = [(k, merged[k]) for k in (*HEADLINE, "registry.decision") if merged.get(k) is not None]
    lines = [
        f"### recd: trained {days['run.ds']}, scored {days['run.eval_ds']}",
        "",
        "| | |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def write_outputs(
    stage: str, executor_input: str, args: StageArgs, summary: dict, upstream: list[dict]
) -> dict:
    """Write `stage`'s typed outputs for the executor input `executor_input` (JSON); return
    the executor output written."""
    spec = json.loads(executor_input)["outputs"]
    given = spec.get("artifacts", {})
    written: dict = {}
    for name, kind in outputs(stage).items():
        if name not in given:  # an executor input of another shape: nothing to fill
            continue
        artifact = dict(given[name]["artifacts"][0])
        if kind == "dataset":
            table = next((t for t, n in OUTPUT_NAMES.items() if n == name), name)
            content, meta = _datasets(stage, args, table)
            text = json.dumps(content, indent=1)
        elif kind == "model":
            uri = (summary.get("train.model_uris") or "").split(";")[-1]
            meta = {
                "model_uri": uri,
                "framework": "pytorch",
                "mode": args.mode,
                **{k: v for k, v in _figures(summary).items() if k.startswith("train.")},
            }
            text = json.dumps({"model_uri": uri}, indent=1)
        elif kind == "metrics":
            meta, text = _figures(summary), ""
            if STAGES[stage].gathers:  # per arm too: `eval.ne.baseline`
                meta = {k: v for k, v in meta.items() if headline_rank(k) is not None}
        else:
            text = _report(args, summary, upstream)
            meta = {}
        path = local_path(artifact["uri"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        artifact["metadata"] = {**artifact.get("metadata", {}), **meta}
        written[name] = {"artifacts": [artifact]}
    out = {"artifacts": written}
    target = Path(spec["outputFile"])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out))
    return out
