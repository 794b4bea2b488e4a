"""`recd`: one command per stage. I/O and argument parsing live here;
the work is done by the stage modules. Every command prints a readable summary, writes
`--summary PATH` JSON with the contract keys, records an MLflow run when a tracking URI is
set (`recd --tracking-uri URI <command>` or MLFLOW_TRACKING_URI), and exits non-zero with a
one-line reason and the exit code of `recd_core.errors` (2 bad input, 3 a failed quality
gate, 4 an unusable tracking server).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import sys
import warnings
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from recd_core.config import (
    GenerateConfig,
    IngestConfig,
    PipelineConfig,
    load_feature_set,
    load_pipeline_config,
    synth_config,
)
from recd_core.errors import BadInput, GateFailed, RecdError, TrackingError, classify
from recd_core.report import console, print_summary, progress, write_summary
from recd_core.warehouse import PartitionNotFound, Warehouse, validate_ds

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])

SummaryOpt = Annotated[Path | None, typer.Option(help="write the figures as JSON here")]
ConfigOpt = Annotated[Path | None, typer.Option(help="pipeline config YAML (default: built-in)")]
WarehouseOpt = Annotated[str, typer.Option(help="warehouse root: a directory or a URI (s3://…)")]
DsOpt = Annotated[str, typer.Option(help="the partition date, YYYY-MM-DD")]


class Preset(StrEnum):
    small = "small"
    default = "default"
    standard = "standard"


class Format(StrEnum):
    events = "events"
    movielens = "movielens"


class LayoutChoice(StrEnum):
    clustered = "clustered"
    shuffled = "shuffled"
    both = "both"


def _fail(command: str, message: str, code: int) -> None:
    console.print(f"[red]recd {command}: error:[/red] {message}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


@app.callback()
def _root(
    ctx: typer.Context,
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            envvar="MLFLOW_TRACKING_URI",
            help="MLflow tracking URI (http://…, sqlite:///…); off if unset",
        ),
    ] = None,
    experiment: Annotated[str, typer.Option(help="MLflow experiment name")] = "recd",
):
    """Options for every command: where the run record goes."""
    if tracking_uri:
        from recd_core.mlops.tracking import Tracker

        # bounded MLflow HTTP behaviour: no retry storms against a dead server
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        ctx.obj = Tracker(tracking_uri, experiment)


def _run(
    ctx: typer.Context, command: str, summary_path: Path | None, fn, tracked: bool = False
) -> dict:
    """Run a command body; map expected failures to a one-line reason and an exit code;
    record the run in MLflow when a tracking URI is set: opened before the work (so a
    pipeline's stages nest under it: `tracked=True` hands the body a `RunHandle`), closed
    FINISHED or FAILED with the summary's figures and its `artifacts` files."""
    from recd_core.mlops.tracking import RunHandle

    tracker = ctx.find_root().obj
    params = {k: v for k, v in ctx.params.items() if k != "summary"}
    run_id = None

    def failed(err: RecdError) -> None:
        summary = {**err.summary, "status": "failed", "error": str(err)}
        write_summary(summary_path, summary)
        if run_id is not None:
            with contextlib.suppress(TrackingError):
                tracker.finish(run_id, summary)
        _fail(command, str(err), err.exit_code)

    if tracker is not None:
        try:
            tracker.check()
            run_id = tracker.start(command, params)
        except TrackingError as e:
            failed(e)

    handle = RunHandle(tracker, run_id) if run_id is not None else None
    try:
        summary = fn(handle) if tracked else fn()
    except Exception as e:  # noqa: BLE001 - the taxonomy decides; the rest re-raised
        err = classify(e)
        if err is None:
            raise
        failed(err)
    summary = {"status": "ok", **summary}
    if run_id is not None:
        summary["mlflow.run_id"] = run_id
        try:
            tracker.finish(run_id, summary)
        except TrackingError as e:
            write_summary(summary_path, summary)
            _fail(command, f"the stage succeeded but {e}", 4)
    write_summary(summary_path, summary)
    print_summary(f"recd {command}", summary)
    return summary


def _pipeline(config: Path | None, dataset: str = "synthetic") -> PipelineConfig:
    return load_pipeline_config(config, dataset=dataset)


@app.command()
def synth(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option(help="directory for OUT/ds=YYYY-MM-DD/*.jsonl.gz")],
    start_date: Annotated[str, typer.Option(help="first day, YYYY-MM-DD")] = "2026-11-01",
    days: Annotated[int, typer.Option(min=1)] = 1,
    preset: Preset = Preset.small,
    samples_per_day: Annotated[
        int | None, typer.Option(min=1, help="impressions a day (default: the preset's)")
    ] = None,
    users: Annotated[int | None, typer.Option(min=1, help="users (default: the preset's)")] = None,
    items: Annotated[int | None, typer.Option(min=2, help="items (default: the preset's)")] = None,
    mean_session_length: Annotated[float | None, typer.Option(min=1.0)] = None,
    seed: int | None = None,
    features: Annotated[str, typer.Option(help="feature set name or YAML")] = "synthetic",
    summary: SummaryOpt = None,
):
    """Generate raw impression logs with session structure (deterministic per seed).

    A preset sizes the workload; `--samples-per-day`, `--users` and `--items` resize it
    without a config file. Days are written a file at a time, so memory does not grow with
    the day's size."""
    from recd_core.data.synth import synthesize

    def body():
        try:
            start = dt.date.fromisoformat(validate_ds(start_date))
        except ValueError:
            raise BadInput(f"--start-date must be YYYY-MM-DD, got {start_date!r}") from None
        cfg = synth_config(
            preset.value,
            samples_per_day=samples_per_day,
            users=users,
            items=items,
            mean_session_length=mean_session_length,
            seed=seed,
            start_date=start,
            days=days,
        )
        fs = load_feature_set(features)
        with progress("synth", cfg.days * cfg.samples_per_day) as advance:
            return {
                "synth.preset": preset.value,
                **synthesize(fs, cfg, out, advance),
                "synth.out": str(out),
            }

    _run(ctx, "synth", summary, body)


class Engine(StrEnum):
    local = "local"
    ray = "ray"


@app.command("ingest")
def ingest_cmd(
    ctx: typer.Context,
    source: Annotated[Path, typer.Option(help="a log file or a directory of them")],
    warehouse: WarehouseOpt,
    ds: DsOpt,
    format: Format = Format.events,  # noqa: A002
    max_quarantine_fraction: Annotated[float | None, typer.Option(min=0.0, max=1.0)] = None,
    engine: Annotated[
        Engine | None, typer.Option(help="parse files here (threads) or on Ray Data")
    ] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="parallel parsers")] = None,
    config: ConfigOpt = None,
    summary: SummaryOpt = None,
):
    """Validate raw logs into events/ds=D; rejected rows go to quarantine/ds=D with reasons."""
    from recd_core.data.ingest import ingest

    def body():
        pipe = _pipeline(config, "movielens" if format == Format.movielens else "synthetic")
        overrides = {"max_quarantine_fraction": max_quarantine_fraction, "workers": workers,
                     "engine": engine.value if engine else None}  # fmt: skip
        cfg = IngestConfig(**{**pipe.ingest.model_dump(), "format": format.value,
                              **{k: v for k, v in overrides.items() if v is not None}})  # fmt: skip
        wh = Warehouse(warehouse)
        with progress("ingest", None) as advance:
            return ingest(source, wh, ds, pipe.features, cfg, pipe.generate, advance)

    _run(ctx, "ingest", summary, body)


@app.command("generate")
def generate_cmd(
    ctx: typer.Context,
    warehouse: WarehouseOpt,
    ds: DsOpt,
    layout: LayoutChoice = LayoutChoice.clustered,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="batch size of the dedup profile")
    ] = None,
    row_group_size: Annotated[int | None, typer.Option(min=1)] = None,
    engine: Annotated[
        Engine | None, typer.Option(help="spill and write files here or as Ray Data tasks")
    ] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="parallel Ray tasks")] = None,
    config: ConfigOpt = None,
    summary: SummaryOpt = None,
):
    """Write training samples in the session-clustered (RecD) or shuffled (baseline) layout."""
    from recd_core.data.generate import generate

    def body():
        cfg = _pipeline(config).generate
        overrides = {"batch_size": batch_size, "row_group_size": row_group_size,
                     "engine": engine.value if engine else None, "workers": workers}  # fmt: skip
        cfg = GenerateConfig(**{**cfg.model_dump(), **{k: v for k, v in overrides.items() if v}})
        layouts = ("clustered", "shuffled") if layout == LayoutChoice.both else (layout.value,)
        with progress("generate", len(layouts)) as advance:
            return generate(Warehouse(warehouse), ds, cfg, layouts, advance)

    _run(ctx, "generate", summary, body)


class Mode(StrEnum):
    dedup = "dedup"
    baseline = "baseline"


@app.command("preprocess")
def preprocess_cmd(
    ctx: typer.Context,
    warehouse: WarehouseOpt,
    ds: DsOpt,
    mode: Mode = Mode.dedup,
    batch_size: Annotated[int | None, typer.Option(min=1)] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="parallel workers (processes / Ray tasks)")
    ] = None,
    engine: Engine = Engine.local,
    threads: Annotated[
        bool, typer.Option(help="local workers as threads instead of processes")
    ] = False,
    stats_from: Annotated[
        str | None, typer.Option(help="use the standardization statistics of this preprocessed day")
    ] = None,
    config: ConfigOpt = None,
    summary: SummaryOpt = None,
):
    """DPP: transform samples/layout=clustered/ds=D into batches/mode=<mode>/ds=D; in dedup
    mode once per unique value (IKJT)."""
    from recd_core.dpp.preprocess import preprocess

    def body():
        base = _pipeline(config).preprocess
        overrides = {
            "mode": mode.value,
            "engine": engine.value,
            "batch_size": batch_size,
            "workers": workers,
            "executor": "thread" if threads else None,
        }
        cfg = base.model_copy(update={k: v for k, v in overrides.items() if v is not None})
        with progress("preprocess", None) as advance:
            return preprocess(
                Warehouse(warehouse), ds, cfg, stats_from=stats_from, progress=advance
            )

    _run(ctx, "preprocess", summary, body)


class DeviceChoice(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@app.command("train")
def train_cmd(
    ctx: typer.Context,
    warehouse: WarehouseOpt,
    ds: DsOpt,
    mode: Mode = Mode.dedup,
    device: DeviceChoice = DeviceChoice.auto,
    nproc: Annotated[
        int, typer.Option(min=1, help="data-parallel processes (gloo on CPU, nccl on GPU)")
    ] = 1,
    batch_size: Annotated[int | None, typer.Option(min=1)] = None,
    epochs: Annotated[int | None, typer.Option(min=1)] = None,
    max_steps: Annotated[int | None, typer.Option(min=1)] = None,
    checkpoint_every: Annotated[int | None, typer.Option(min=1)] = None,
    amp: Annotated[bool, typer.Option(help="bf16 autocast on CUDA")] = False,
    init_from: Annotated[
        str | None,
        typer.Option(
            help="start from this model's weights (warm start): a model directory, "
            "<warehouse>/models/<run>, or models:/<name>@<alias> | models:/<name>/<version> "
            "(needs a tracking URI)"
        ),
    ] = None,
    train_config: Annotated[
        Path | None, typer.Option(help="TrainConfig YAML (model, optimizer, dedup plan)")
    ] = None,
    config: ConfigOpt = None,
    summary: SummaryOpt = None,
):
    """Train the DLRM on the preprocessed batches/mode=<mode>/ds=D (dedup: IKJT, baseline:
    KJT); resumes from the run's latest checkpoint. --batch-size must match preprocessing."""
    from recd_core.config import TrainConfig, load_yaml, parse_config
    from recd_core.modeling.train import train

    def body():
        base = (
            parse_config(TrainConfig, load_yaml(train_config), str(train_config))
            if train_config
            else _pipeline(config).train
        )
        overrides = {
            "mode": mode.value, "device": device.value, "amp": amp, "batch_size": batch_size,
            "epochs": epochs, "max_steps": max_steps, "checkpoint_every": checkpoint_every,
        }  # fmt: skip
        cfg = TrainConfig(
            **{**base.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
        )
        from recd_core.mlops.registry import init_model

        tracker = ctx.find_root().obj
        model_name = _pipeline(config).registry.model_name
        with init_model(tracker, init_from, model_name) as (init_dir, label):
            return train(
                Warehouse(warehouse), ds, cfg, nproc=nproc, init_from=init_dir, init_label=label
            )

    _run(ctx, "train", summary, body)


@app.command("evaluate")
def evaluate_cmd(
    ctx: typer.Context,
    warehouse: WarehouseOpt,
    model: Annotated[str, typer.Option(help="the model URI (train's train.model_uri)")],
    ds: DsOpt,
    batch_size: Annotated[int, typer.Option(min=1)] = 4096,
    summary: SummaryOpt = None,
):
    """Score samples/layout=clustered/ds=D with a trained model: NE, AUC, log loss, calibration."""
    from recd_core.modeling.evaluate import evaluate

    def body():
        try:
            return evaluate(Warehouse(warehouse), model, ds, batch_size)
        except PartitionNotFound:
            raise
        except FileNotFoundError as e:
            raise BadInput(f"model not found: {model} ({e.strerror or e})") from None

    _run(ctx, "evaluate", summary, body)


def _day_or_yesterday(ds: str | None) -> str:
    return ds or (dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)).isoformat()


RunDsOpt = Annotated[str | None, typer.Option(help="the training day (default: yesterday, UTC)")]
EvalDsOpt = Annotated[
    str | None, typer.Option(help="the evaluation day (default: the day after --ds)")
]
LogsOpt = Annotated[Path, typer.Option(help="raw logs root; days without logs are synthesized")]


def _run_graph(
    graph, warehouse: str, ds: str | None, eval_ds: str | None, logs: Path,
    config: Path | None, handle, synthesize: bool = True,
) -> dict:  # fmt: skip
    """`graph` run in this process by the local runner; the result: finish's merged summary
    (every stage's contract keys; an arm's suffixed with its mode)."""
    from recd_core.orchestration.runner import run_graph

    if handle is not None:
        handle.tracker.log_config(handle.run_id, _pipeline(config))
    args = {
        "warehouse": warehouse, "ds": _day_or_yesterday(ds), "eval_ds": eval_ds,
        "logs": str(logs), "config": str(config) if config else None, "synthesize": synthesize,
        "tracking_uri": handle.tracker.uri if handle else None, "pipeline": graph.name,
        **({"experiment": handle.tracker.experiment} if handle else {}),
    }  # fmt: skip
    with progress("run", len(graph.tasks)) as advance:
        done = run_graph(graph, args, handle.run_id if handle else None, advance)
    return {k: v for k, v in done["finish"].items() if k != "status"}


def _copy_chart(result: dict, out: Path | None) -> None:
    """The compare stage's chart (in the warehouse) also under `out`, when asked."""
    import pyarrow.fs as pafs

    src = result.get("compare.chart")
    if not src or out is None:
        return
    fs, path = pafs.FileSystem.from_uri(src if "://" in src else Path(src).resolve().as_uri())
    out.mkdir(parents=True, exist_ok=True)
    with fs.open_input_stream(path) as f:
        (out / Path(path).name).write_bytes(f.read())


def _print_decision(result: dict) -> None:
    if "registry.version" not in result:
        console.print("model registry: off (no tracking URI)")
        return
    champ = result["registry.champion_ne"]
    console.print(
        f"{result['registry.model']} v{result['registry.version']}: {result['registry.decision']}"
        f" (challenger NE {result['registry.challenger_ne']:.4f}"
        + (f" vs champion NE {champ:.4f}" if champ is not None else ", no champion yet")
        + f" on {result['run.eval_ds']})"
    )


@app.command("run")
def run_cmd(
    ctx: typer.Context,
    warehouse: WarehouseOpt = "data/default/warehouse",
    ds: RunDsOpt = None,
    eval_ds: EvalDsOpt = None,
    logs: LogsOpt = Path("data/default/logs"),
    mode: Annotated[str, typer.Option(help="training arm(s): dedup, baseline or both")] = "dedup",
    config: ConfigOpt = None,
    out: Annotated[
        Path | None, typer.Option(help="also copy the comparison chart here (--mode both)")
    ] = None,
    synthesize: Annotated[
        bool, typer.Option(help="synthesize logs for days without any (embedded default)")
    ] = True,
    summary: SummaryOpt = None,
):
    """The daily graph in-process: ingest, generate, DPP, train, evaluate on the next day;
    with a tracking URI also register the model and decide the champion by NE. `--mode both`
    runs both arms on the same samples and compares them (exit 3 when they differ)."""
    from recd_core.orchestration.graph import ARMS, pipeline_graph

    def body(handle):
        if mode not in ("dedup", "baseline", "both"):
            raise BadInput(f"--mode must be dedup, baseline or both, got {mode!r}")
        arms = ARMS if mode == "both" else (mode,)
        graph = pipeline_graph(arms, register=True, compare=mode == "both", name="recd run")
        try:
            result = _run_graph(graph, warehouse, ds, eval_ds, logs, config, handle, synthesize)
        except GateFailed as e:
            _copy_chart(e.summary, out)
            raise
        _copy_chart(result, out)
        return result

    result = _run(ctx, "run", summary, body, tracked=True)
    if mode == "both":
        from recd_core.mlops.compare import print_table

        print_table(result, console)
    _print_decision(result)


@app.command("compare")
def compare_cmd(
    ctx: typer.Context,
    warehouse: WarehouseOpt = "data/compare/warehouse",
    ds: RunDsOpt = None,
    eval_ds: EvalDsOpt = None,
    logs: LogsOpt = Path("data/compare/logs"),
    config: ConfigOpt = None,
    out: Annotated[Path, typer.Option(help="also copy the chart here")] = Path("build/compare"),
    summary: SummaryOpt = None,
):
    """The comparison graph in-process (the `recd_dedup_vs_baseline` DAG): both arms on the
    same data, a table, a PNG chart (the warehouse's reports/compare/, MLflow, --out), and
    exit 3 when the arms' next-day NE or AUC differ beyond the configured tolerance."""
    from recd_core.mlops.compare import print_table
    from recd_core.orchestration.graph import COMPARISON

    def body(handle):
        try:
            result = _run_graph(COMPARISON, warehouse, ds, eval_ds, logs, config, handle)
        except GateFailed as e:
            _copy_chart(e.summary, out)
            raise
        _copy_chart(result, out)
        return result

    print_table(_run(ctx, "compare", summary, body, tracked=True), console)


@app.command("bench")
def bench_cmd(
    ctx: typer.Context,
    preset: Preset = Preset.standard,
    out: Annotated[Path, typer.Option(help="where the bench writes its data and report")] = Path(
        "build/bench"
    ),
    movielens: Annotated[
        Path | None, typer.Option(help="MovieLens directory to benchmark too")
    ] = None,
    quality: Annotated[
        bool, typer.Option(help="model quality next to references (LR, the oracle)")
    ] = True,
    quality_days: Annotated[int, typer.Option(min=1, help="days of the warm-started week")] = 7,
    summary: SummaryOpt = None,
):
    """The headline ratios measured side by side (storage, ingestion, DPP, training) and the
    model's quality next to references on the same data."""
    from recd_core.bench.run import run_bench

    def body():
        return run_bench(preset.value, out, movielens, quality=quality, quality_days=quality_days)

    _run(ctx, "bench", summary or out / "bench.json", body)


def main() -> None:
    # Adagrad rebuilds sparse gradients internally and torch warns about invariant checks.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
