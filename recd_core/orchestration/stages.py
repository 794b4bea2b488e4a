"""The pipeline's stages: one function each, run the same way by every runner (the local
runner behind `recd run`, an Airflow worker in-process, a pod of the components image for
Airflow's KubernetesPodOperator or Kubeflow, or by hand: `python -m components.<stage>`).
Which stages exist and how they connect is `recd_core.orchestration.graph`; this module is what they do.

Every stage takes one `StageArgs` (stage_args.py: plain values an orchestrator can template) and returns
a JSON-safe summary (the contract keys), which becomes the task's XCom / output metadata.
Stages talk only through the warehouse and these summaries. With a tracking URI, `start`
opens the pipeline's MLflow run and every stage records a child run under it.

`days` > 1 (the comparison DAG) runs each stage over consecutive training days
ds .. ds+days-1, each evaluated on its next day.

One run per day and arm, however it is started (a manual run beside the scheduled one, a
retry, a rerun): a stage builds a day's partition one run at a time (`Warehouse.exclusive`
per stage and day), and a build from exactly the inputs, config and code of the live
version keeps it (warehouse.py); training then finds the same run key and waits for, then
uses, the model the other run trains (train.py); registering a model already registered
adds no version (mlops/registry.py). The second run ends with the first's figures.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import tempfile
from collections.abc import Callable
from pathlib import Path

from recd_core.data.generate import generate
from recd_core.data.ingest import ingest
from recd_core.data.logs_root import eval_oracle, logs_for_day
from recd_core.data.synth import synthesize_missing
from recd_core.errors import BadInput, GateFailed, classify
from recd_core.mlops.compare import chart, print_table, quality_gap, ratios
from recd_core.mlops.tracking import RunRecord, Tracker
from recd_core.modeling.evaluate import evaluate
from recd_core.orchestration.graph import ARM_LAYOUT, ARMS, STAGES
from recd_core.orchestration.overlay import pipeline_config
from recd_core.orchestration.stage_args import StageArgs, own_options, stage_args
from recd_core.orchestration.summaries import json_safe, merge
from recd_core.report import answer
from recd_core.runtime import follower, peak_rss, reset_peak_rss, rss
from recd_core.warehouse import PartitionNotFound, Warehouse

Advance = Callable[[str, int], None]  # a progress bar's `advance(label, n)`


def open_warehouse(args: StageArgs) -> Warehouse:
    if not args.warehouse:
        raise BadInput("no --warehouse given")
    return Warehouse(args.warehouse)


def tracker_of(args: StageArgs) -> Tracker | None:
    """The MLflow tracker of `args.tracking_uri`; None (tracking off) when unset."""
    return Tracker(args.tracking_uri, args.experiment) if args.tracking_uri else None


def _per_day(args: StageArgs, fn: Callable[[str], dict], days: list[str] | None = None) -> dict:
    """Run `fn` per day (default: the training days). One day: its summary. Several: each
    under `days.<ds>`, and at the top the first day's labels (mode, ...) with the mean of
    every number."""
    days = args.training_days() if days is None else days
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


def _start(args: StageArgs, advance: Advance) -> dict:
    tracker = tracker_of(args)
    if tracker is None:
        return {"mlflow.run_id": None}
    tracker.check()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    run_id = tracker.start(
        "pipeline",
        {**args.model_dump(exclude_none=True), "mode": ""},
        run_name=f"{args.pipeline} · started {started} UTC",  # runs told apart in the table
        pipeline=args.pipeline,
    )
    try:  # a config that cannot be read fails the run it opened, with the reason
        tracker.log_config(run_id, pipeline_config(args))
    except Exception as e:
        err = classify(e) or e
        RunRecord(tracker, run_id).fail(f"start: {err}", {"failed_stage": "start"})
        raise
    return {"mlflow.run_id": run_id}


def _logs(args: StageArgs) -> str:
    """The raw logs root: a local path (a mounted volume in pods), never a URI."""
    if not args.logs:
        raise BadInput("no --logs root given")
    if "://" in args.logs:
        raise BadInput(
            f"--logs {args.logs}: raw logs are read as files; mount them (a volume) "
            "and give the path"
        )
    return args.logs


def _synth(args: StageArgs, advance: Advance) -> dict:
    """The days of `days_of` that have no logs (the pipelines: every day of the run,
    synthesized together so the users' click histories carry over into the evaluation day)."""

    logs = _logs(args)
    if not args.synthesize:
        return {"synth.days": 0, "synth.rows": 0}
    cfg = pipeline_config(args)
    summary = synthesize_missing(logs, args.data_days(), cfg.features, cfg.synth, advance)
    return {**summary, "synth.out": logs}


def _ingest(args: StageArgs, advance: Advance) -> dict:
    """The days of `days_of`, each from `<logs>/ds=<day>/`, or the one day --ds from
    `source`."""

    days = args.data_days()
    if args.source and (len(days) != 1 or args.days_of != "training"):
        raise BadInput(
            "--source holds one day's logs: give --ds of that day, no --days or "
            "--days-of (or --logs, the root of every day's logs)"
        )
    if args.source:
        sources = {days[0]: args.source}
    else:
        logs = _logs(args)
        sources = {day: logs_for_day(logs, day) for day in days}
    cfg, wh = pipeline_config(args), open_warehouse(args)
    out = {}
    for day, src in sources.items():
        with wh.exclusive(f"ingest/ds={day}"):  # module doc: one build of a day at a time
            out[day] = ingest(src, wh, day, cfg.features, cfg.ingest, cfg.generate, advance)
    first = out[days[0]]
    return {**first, "ingest.days": {d: s["ingest.rows_ok"] for d, s in out.items()}}


def _layouts(choice: str) -> tuple[str, ...]:
    """generate's `layout` argument as the layouts it writes: `both` is every arm's."""
    return tuple(ARM_LAYOUT[arm] for arm in ARMS) if choice == "both" else (choice,)


def _generate(args: StageArgs, advance: Advance) -> dict:
    """The days of `days_of`: training days in both layouts (each arm's, and the storage
    figure), evaluation days clustered only (every model scores the same rows); `layout`
    chooses otherwise."""

    cfg, wh = pipeline_config(args), open_warehouse(args)
    training = args.training_days()

    def one(day: str) -> dict:
        layouts = _layouts(args.layout or ("both" if day in training else "clustered"))
        with wh.exclusive(f"generate/ds={day}"):
            s = generate(wh, day, cfg.generate, layouts, advance, cfg.features)
        per_layout = s.get("layouts", {layouts[0]: s})  # one layout: its figures at the top
        for arm, layout in ARM_LAYOUT.items():
            if layout in per_layout:
                s[f"storage.bytes.{arm}"] = per_layout[layout]["storage.bytes"]
        return s

    return _per_day(args, one, args.data_days())


def _preprocess(args: StageArgs, advance: Advance) -> dict:
    from recd_core.dpp.preprocess import preprocess

    cfg, wh = pipeline_config(args), open_warehouse(args)

    def one(day: str) -> dict:
        with wh.exclusive(f"preprocess/mode={cfg.preprocess.mode}/ds={day}"):
            return preprocess(
                wh,
                day,
                cfg.preprocess,
                stats_from=args.stats_from,
                progress=advance,
                features=cfg.features,
            )

    return _per_day(args, one)


def _train(args: StageArgs, advance: Advance) -> dict:
    """Train each day, warm-started from `init_from` (default: the champion, when the
    config's `train.warm_start` is on and there is one)."""
    from recd_core.mlops.starting_version import starting_model
    from recd_core.modeling.train import train

    cfg, wh = pipeline_config(args), open_warehouse(args)
    resolved = starting_model(tracker_of(args), wh, cfg, args.ds, args.mode, args.init_from)
    with resolved as (init_dir, label):
        out = _per_day(
            args,
            lambda day: train(
                wh, day, cfg.train, init_from=init_dir, init_label=label, features=cfg.features
            ),
        )
    days = out["days"].values() if "days" in out else [out]
    uris = [s["train.model_uri"] for s in days if "train.model_uri" in s]  # rank 0 saves
    return {**out, "train.model_uris": ";".join(uris)} if uris else out


def _evaluate(args: StageArgs, advance: Advance) -> dict:
    """Each training day's model scored on its evaluation day."""

    if not args.model_uri:
        raise BadInput("no --model-uri given")
    cfg, wh = pipeline_config(args), open_warehouse(args)
    uris = args.model_uri.split(";")
    if len(uris) != args.days:
        raise BadInput(f"--model-uri names {len(uris)} models for {args.days} training day(s)")
    uris = dict(zip(args.training_days(), uris, strict=True))

    def one(day: str) -> dict:
        try:
            scored = evaluate(
                wh, uris[day], args.eval_day(day), cfg.registry.eval_batch_size, trained_on=day
            )
        except PartitionNotFound:
            raise
        except FileNotFoundError as e:
            raise BadInput(f"model not found: {uris[day]} ({e.strerror or e})") from None
        return {"train.mode": args.mode, **scored, **eval_oracle(args.logs, args.eval_day(day))}

    return _per_day(args, one)


def _register(args: StageArgs, advance: Advance) -> dict:
    """Log the last day's model to the train run, register it, decide the champion."""
    from recd_core.mlops.registry import register_and_promote

    tracker = tracker_of(args)
    if tracker is None:
        return {"registry.decision": "off (no tracking URI)"}
    if not args.model_uri or not args.register_run_id:
        raise BadInput("--model-uri and --register-run-id are required")
    cfg, wh = pipeline_config(args), open_warehouse(args)
    eval_ds, uri = args.eval_day(args.training_days()[-1]), args.model_uri.split(";")[-1]
    # scored here again (seconds), so the stage needs only the train stage's outputs
    scored = evaluate(
        wh, uri, eval_ds, cfg.registry.eval_batch_size, trained_on=args.training_days()[-1]
    )
    # one registration at a time: a second run of the day finds the first's version
    with wh.exclusive(f"register-{cfg.registry.model_name}"):
        return register_and_promote(
            tracker, wh, uri, args.register_run_id, eval_ds, scored, cfg.registry
        )


def _compare(args: StageArgs, upstream: list[dict]) -> dict:
    """Both arms side by side: the table in the task log, the chart in MLflow (the pipeline
    run) and in the warehouse (`reports/compare/ds=D/`), and the quality gate."""

    cfg = pipeline_config(args)
    summary = merge(
        upstream, {"run.ds": args.ds, "run.eval_ds": args.eval_day(args.training_days()[-1])}
    )
    missing = [k for k in ("eval.ne.dedup", "eval.ne.baseline") if k not in summary]
    if missing:
        raise BadInput(f"upstream summaries lack {', '.join(missing)}")
    print_table(summary, answer)  # on standard output: the task log and `recd compare` alike
    wh = open_warehouse(args)
    with tempfile.TemporaryDirectory() as tmp:
        png = chart(summary, Path(tmp) / f"compare-{args.ds}.png")
        target = f"{wh.root}/reports/compare/ds={args.ds}"
        wh.fs.create_dir(target, recursive=True)
        with wh.fs.open_output_stream(f"{target}/{png.name}") as f:
            f.write(png.read_bytes())
        tracker = tracker_of(args)
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
        raise GateFailed(gap, out)
    return out


def _finish(args: StageArgs, upstream: list[dict]) -> dict:
    """Close the pipeline run. Its summary: the stages' figures, merged (see `merge`), and
    with both arms their ratios."""

    last = args.training_days()[-1]
    summary = merge(
        upstream,
        {
            "pipeline.ds": args.ds,
            "pipeline.days": args.days,
            "run.ds": args.ds,
            "run.eval_ds": args.eval_day(last),
            "run.warehouse": args.warehouse,
        },
    )
    if all(f"eval.ne.{arm}" in summary for arm in ARM_LAYOUT):
        summary.update(ratios(summary))
    return summary


IMPLS: dict[str, Callable[[StageArgs, Advance], dict]] = {
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


def run_stage(
    name: str,
    args: StageArgs | dict,
    upstream: list[dict] | None = None,
    progress: Callable | None = None,
) -> dict:
    """Run one stage and record it; return its summary. Every runner calls this: `recd
    <stage>`, the local runner, Airflow tasks, components.

    The MLflow record: a child run of the pipeline run (`parent_run_id`), or a run of its
    own when the stage runs alone (`recd <stage>` with a tracking URI). A failure the
    taxonomy knows (`recd_core.errors`) is raised as that `RecdError`, with a one-line
    reason; the stage's run and the pipeline's run are closed FAILED. `upstream` (compare,
    finish): the other stages' summaries. `progress`: `report.progress`, for a bar."""
    if name not in STAGES:
        raise BadInput(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    args = stage_args(name, args)
    tracker = None if follower() else tracker_of(args)  # a torchrun rank > 0: rank 0 records
    stage = STAGES[name]
    record = None
    if tracker is not None and not stage.run_edge:
        params = args.model_dump(exclude_none=True)
        if not (stage.per_arm or stage.gathers):  # data stages serve both arms
            params["mode"] = ""
        record = RunRecord.open(tracker, name, params, args.parent_run_id, run_label(name, args))
    bar = progress(name, None) if progress else contextlib.nullcontext(lambda label, n=1: None)
    # the training run's CPU, memory (and GPU) over time: its System metrics tab
    watch = record.system_metrics() if record and stage.accelerated else contextlib.nullcontext()
    start_rss = rss() if reset_peak_rss() else None  # this stage's own peak, not the process's
    try:
        with bar as advance, watch:
            if name in UPSTREAM_IMPLS:
                summary = UPSTREAM_IMPLS[name](args, upstream or [])
            else:
                summary = IMPLS[name](args, advance)
    except Exception as e:
        err = classify(e)
        runs = [r for r in (record and record.run_id, args.parent_run_id) if r]
        if tracker is not None and runs:  # this stage's run and the pipeline's
            said = {**(err.summary if err else {}), "failed_stage": name}
            RunRecord(tracker, runs[0]).fail(f"{name}: {err or e}", said, tuple(runs[1:]))
        if err is not None and err is not e:
            raise err from None
        raise
    if start_rss is not None:  # the process's memory: the stage's and what it holds before
        summary = {
            **summary,
            f"{name}.start_rss_bytes": start_rss,
            f"{name}.peak_rss_bytes": peak_rss(),
        }
    summary = {"status": "ok", "stage": name, **json_safe(summary)}
    if record is not None and stage.per_arm:
        record.tracker.log_inputs(record.run_id, stage_inputs(args, stage))
        summary |= _record_model(record, args, stage, summary)
    if tracker is not None and name == "finish" and args.parent_run_id:
        return RunRecord(tracker, args.parent_run_id).close(summary)  # the pipeline's run
    return record.close(summary) if record else summary


def _record_model(record, args: StageArgs, stage, summary: dict) -> dict:
    """The model in MLflow: the stage that trains it logs it as a LoggedModel of its run
    (the Models tab, one per arm); a stage that scores it links its `eval.*` figures to it."""
    from recd_core.mlops import versions
    from recd_core.mlops.pyfunc import example_rows
    from recd_core.modeling.saved import model_dir

    tracker = record.tracker
    if "models" in stage.writes:
        uri = summary["train.model_uris"].split(";")[-1]
        model_id = versions.logged_model_of(tracker, uri) if summary.get("train.reused") else None
        if model_id is not None:  # an earlier run's model, used as it is: one LoggedModel
            versions.link_output(tracker, record.run_id, model_id)
            return {"train.logged_model_id": model_id}
        example = example_rows(open_warehouse(args), args.training_days()[-1])
        with model_dir(uri) as local:
            model_id = versions.log_model(tracker, record.run_id, local, example, uri)
        return {"train.logged_model_id": model_id}
    if "models" in stage.reads and "eval.ne" in summary and args.model_uri:
        model_id = versions.logged_model_of(tracker, args.model_uri.split(";")[-1])
        if model_id:
            versions.log_model_metrics(tracker, record.run_id, model_id, summary)
    return {}


def stage_inputs(args: StageArgs, stage) -> list[dict]:
    """The warehouse partitions a per-arm stage read, for its MLflow record: a model's
    stages (evaluate, register) the evaluation days' samples, the others (DPP, train) their
    arm's data of the training days (train: its batches; DPP: its samples layout). Each
    dataset's digest is the partition's write id (lineage.py): the run names the exact
    version it read."""
    wh = open_warehouse(args)
    scoring = "models" in stage.reads
    days = [args.eval_day(d) for d in args.training_days()] if scoring else args.training_days()
    table = "samples" if scoring or "samples" in stage.reads else "batches"
    keys = (
        {"layout": "clustered"}
        if scoring
        else {"layout": ARM_LAYOUT[args.mode]}
        if table == "samples"
        else {"mode": args.mode}
    )
    out = []
    for day in days:
        if not wh.exists(table, day, **keys):
            continue
        m = wh.manifest(table, day, **keys)
        out.append(
            {
                "name": wh.partition_name(table, day, **keys),
                "uri": wh.partition_uri(table, day, **keys),
                "digest": str(m.get("write_id")),
                "rows": m["rows"],
                "context": "evaluation" if scoring else "training",
            }
        )
    return out


def stage_days(name: str, args: StageArgs) -> list[str]:
    """The days stage `name` works on: its `days_of` days (synth, ingest, generate), else
    the training days."""
    return args.data_days() if "days_of" in own_options(name) else args.training_days()


def run_label(name: str, args: StageArgs) -> str:
    """A stage run's name in MLflow's runs table: the stage, its arm, the day(s) it works
    on (a model's: trained → scored), so `ingest` of the evaluation day and of the training
    day, or the two arms' `train`, read apart."""
    stage = STAGES[name]
    days = stage_days(name, args)
    span = days[0] if len(days) == 1 else f"{days[0]}..{days[-1]}"
    if "models" in stage.reads:
        span = f"{span} → {args.eval_day(days[-1])}"
    return " ".join(x for x in (name, args.mode if stage.per_arm else "", span) if x)
