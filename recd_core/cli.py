"""`recd`: one command per stage. I/O and argument parsing live here;
the work is done by the stage modules. Every command prints a readable summary, writes
`--summary PATH` JSON with the contract keys, records an MLflow run when a tracking URI is
set (`recd --tracking-uri URI <command>` or MLFLOW_TRACKING_URI), and exits non-zero with a
one-line reason and the exit code of `recd_core.errors` (2 bad input, 3 a failed quality
gate, 4 an unusable tracking server).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

import pyarrow.fs as pafs
import typer
from rich.console import Console
from rich.table import Table

from recd_core.config import PipelineConfig, ServeConfig
from recd_core.config_files import load_pipeline_config, parse_config
from recd_core.errors import BadInput, GateFailed, RecdError, TrackingError, classify
from recd_core.lineage import status
from recd_core.mlops.tracking import RunRecord, Tracker
from recd_core.orchestration.graph import ARMS, COMPARISON, pipeline_graph
from recd_core.orchestration.runner import run_graph
from recd_core.orchestration.schedule import training_day_or_default
from recd_core.orchestration.stage_args import field_option, override_fields, stage_options
from recd_core.orchestration.stages import run_stage
from recd_core.orchestration.trainjob import TrainJobConfig, flag_options, stage_trainjob
from recd_core.report import console, print_decision, print_summary, progress, write_summary
from recd_core.runtime import follower
from recd_core.warehouse import Warehouse, validate_ds

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])

SummaryOpt = Annotated[Path | None, typer.Option(help="write the figures as JSON here")]
ConfigOpt = Annotated[Path | None, typer.Option(help="pipeline config YAML (default: built-in)")]
WarehouseOpt = Annotated[str, typer.Option(help="warehouse root: a directory or a URI (s3://…)")]


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
        # bounded MLflow HTTP behaviour: no retry storms against a dead server
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        ctx.obj = Tracker(tracking_uri, experiment)


def _run(
    ctx: typer.Context, command: str, summary_path: Path | None, fn, tracked: bool = False
) -> dict:
    """Run the body of a command that is not a stage (run, compare, bench); map expected
    failures to a one-line reason and an exit code; record the run in MLflow when a tracking
    URI is set (`RunRecord`, as a stage's): opened before the work, so a pipeline's stages
    nest under it (`tracked=True` hands the body the `RunRecord`), closed FINISHED or FAILED
    with the summary's figures and its `artifacts` files."""

    tracker = ctx.find_root().obj
    params = {k: v for k, v in ctx.params.items() if k != "summary"}
    record = None

    def failed(err: RecdError) -> None:
        write_summary(summary_path, {**err.summary, "status": "failed", "error": str(err)})
        if record is not None:
            record.fail(str(err), err.summary)
        _fail(command, str(err), err.exit_code)

    if tracker is not None:
        try:
            record = RunRecord.open(tracker, command, params)
        except TrackingError as e:
            failed(e)
    try:
        summary = {"status": "ok", **(fn(record) if tracked else fn())}
        if record is not None:
            summary = record.close(summary)
    except Exception as e:  # noqa: BLE001 - the taxonomy decides; the rest re-raised
        err = classify(e)
        if err is None:
            raise
        failed(err)
    write_summary(summary_path, summary)
    print_summary(f"recd {command}", summary)
    return summary


def _pipeline(config: Path | None, dataset: str = "synthetic") -> PipelineConfig:
    return load_pipeline_config(config, dataset=dataset)


def _stage(ctx: typer.Context, name: str, summary_path: Path | None, **args) -> dict:
    """`recd <stage>`: the stage itself, run as every orchestrator runs it
    (`stages.run_stage`, the same arguments: the options given, unset ones left to the
    stage and the config), with a progress bar, the summary printed and written, and the
    failure's one-line reason and exit code. With a tracking URI the stage records a run of
    its own."""

    tracker = ctx.find_root().obj
    args = {k: v for k, v in args.items() if v is not None}
    if tracker is not None:
        args |= {"tracking_uri": tracker.uri, "experiment": tracker.experiment}

    try:
        summary = run_stage(name, args, progress=None if follower() else progress)
    except RecdError as e:
        if not follower():
            write_summary(summary_path, {**e.summary, "status": "failed", "error": str(e)})
        _fail(name, str(e), e.exit_code)
    if follower():  # one of torchrun's ranks > 0: rank 0 writes and prints the summary
        print(f"recd {name}: rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} done")
        return summary
    write_summary(summary_path, summary)
    print_summary(f"recd {name}", summary)
    return summary


# what each stage command does; its options are generated from `StageArgs`
STAGE_COMMANDS = {
    "synth": """Generate raw impression logs with session structure (deterministic per seed),
    for the days that have none (a day with logs is kept). A preset sizes the workload;
    `--samples-per-day`, `--users` and `--items` resize it without a config file. Days are
    written a file at a time, so memory does not grow with the day's size.""",
    "ingest": """Validate raw logs into events/ds=D; rejected rows go to quarantine/ds=D with
    reasons (`--source`: one day's files; `--logs`: the run's days, as the pipelines give it).""",
    "generate": """Write training samples in the session-clustered (RecD) and shuffled
    (baseline) layouts.""",
    "preprocess": """DPP: transform samples/layout=clustered/ds=D into batches/mode=<mode>/ds=D;
    in dedup mode once per unique value (IKJT).""",
    "train": """Train the DLRM on the preprocessed batches/mode=<mode>/ds=D (dedup: IKJT,
    baseline: KJT); resumes from the run's latest checkpoint. --batch-size must match
    preprocessing.""",
    "evaluate": """Score the evaluation day's clustered samples (--eval-ds, default the day
    after --ds) with the model trained on --ds: NE, AUC, log loss, calibration.""",
}


def _option_param(o, default=None, help: str | None = None) -> inspect.Parameter:
    """A `stage_args.Option` as a typer option (a flag pair for a bool)."""
    flag = f"{o.flag}/--no-{o.flag[2:]}" if o.annotation is bool else o.flag
    option = typer.Option(flag, help=help or o.help, show_default=False)
    return inspect.Parameter(
        o.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[o.annotation, option],
    )


def _stage_command(name: str, text: str) -> None:
    """`recd <name>`, its options generated from the stage's arguments
    (`stage_args.stage_options`: name, type, default and help declared once, in
    `StageArgs`), as the component `python -m components.<name>` takes them."""

    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("ctx", keyword, annotation=typer.Context)]
    for o in stage_options(name, wiring=False):
        params.append(_option_param(o, inspect.Parameter.empty if o.required else o.default))
    params.append(inspect.Parameter("summary", keyword, default=None, annotation=SummaryOpt))

    def command(ctx: typer.Context, summary: Path | None = None, **args) -> None:
        _stage(ctx, name, summary, **args)

    command.__signature__ = inspect.Signature(params)
    command.__doc__ = f"{text}\n\n    The `{name}` stage of the pipelines, with the same arguments."
    app.command(name)(command)


for _name, _text in STAGE_COMMANDS.items():
    _stage_command(_name, _text)


RUN_ARGS = ("warehouse", "ds", "eval_ds", "logs", "config", "synthesize")  # a run's own


def _graph_params(warehouse: str, logs: str, exclude: tuple[str, ...] = ()) -> list:
    """`recd run` / `recd compare`'s options, generated from `StageArgs` as the stages' are:
    the run's arguments (`RUN_ARGS`, with these commands' defaults) and every config
    override (`stage_args.override_fields`), which the runner hands to the stages that
    take it."""

    defaults = {"warehouse": warehouse, "logs": logs, "ds": None}
    helps = {
        "ds": "the training day (default: the day before yesterday, UTC, so that its "
        "evaluation day, yesterday, is over)",
        "logs": "raw logs root; days without logs are synthesized",
    }
    params = []
    for name in (*RUN_ARGS, *(n for n in override_fields() if n not in exclude)):
        o = field_option(name)
        if name == "ds":
            o = dataclasses.replace(o, annotation=str | None, required=False)
        params.append(_option_param(o, defaults.get(name, o.default), helps.get(name)))
    return params


def _graph_command(
    name: str, doc: str, params: list, own_params: list, body, decision: bool = True
) -> None:
    """`recd <name>`: `params` (`_graph_params`: the run's arguments), the command's own
    (`own_params`), `--summary`; `body(handle, args, **own)` runs the graph with the run's
    arguments given (None: unset); with `decision`, the registry's decision is printed."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    names = {p.name for p in params}

    def command(ctx: typer.Context, summary: Path | None = None, **given) -> None:
        args = {k: v for k, v in given.items() if k in names and v is not None}
        own = {k: v for k, v in given.items() if k not in names}
        result = _run(ctx, name, summary, lambda h: body(h, args, **own), tracked=True)
        if decision:
            print_decision(result)

    command.__signature__ = inspect.Signature(
        [
            inspect.Parameter("ctx", keyword, annotation=typer.Context),
            *params,
            *own_params,
            inspect.Parameter("summary", keyword, default=None, annotation=SummaryOpt),
        ]
    )
    command.__doc__ = doc
    app.command(name)(command)


def _run_graph(graph, args: dict, handle, out: Path | None, accelerated=None) -> dict:
    """`graph` run in this process by the local runner with the run's `args`; the result:
    finish's merged summary (every stage's contract keys; an arm's suffixed with its mode).
    The comparison's chart is also copied under `out`, when there is one, whether the
    quality gate passed or not."""

    config = Path(args["config"]) if args.get("config") else None
    if handle is not None:
        handle.tracker.log_config(handle.run_id, _pipeline(config))
    args = {
        **args,
        "ds": training_day_or_default(args.get("ds")),
        "pipeline": graph.name,
        "tracking_uri": handle.tracker.uri if handle else None,
        **({"experiment": handle.tracker.experiment} if handle else {}),
    }
    try:
        with progress("run", len(graph.tasks)) as advance:
            done = run_graph(graph, args, handle.run_id if handle else None, advance, accelerated)
    except GateFailed as e:
        _copy_chart(e.summary, out)
        raise
    result = {k: v for k, v in done["finish"].items() if k != "status"}
    _copy_chart(result, out)
    return result


def _copy_chart(result: dict, out: Path | None) -> None:
    """The compare stage's chart (in the warehouse) also under `out`, when asked."""

    src = result.get("compare.chart")
    if not src or out is None:
        return
    fs, path = pafs.FileSystem.from_uri(src if "://" in src else Path(src).resolve().as_uri())
    out.mkdir(parents=True, exist_ok=True)
    with fs.open_input_stream(path) as f:
        (out / Path(path).name).write_bytes(f.read())


def _trainjob_params() -> list[inspect.Parameter]:
    """`recd run`'s train stage across machines, as a Kubeflow Trainer TrainJob
    (`orchestration.trainjob.TrainJobConfig`, a flag a field)."""

    return [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=default,
            annotation=Annotated[list[kind] | None if many else kind, typer.Option(help=text)],
        )
        for name, kind, default, text, many in flag_options()
    ]


def _run_body(handle, args: dict, mode: str, out: Path | None, **node) -> dict:

    arms = ARMS if mode == "both" else (mode,)
    graph = pipeline_graph(arms, register=True, compare=mode == "both", name="recd run")
    trainjob = TrainJobConfig.from_flags(node)
    across = stage_trainjob(trainjob) if trainjob.nodes > 1 else None
    return _run_graph(graph, args, handle, out, across)


_graph_command(
    "run",
    """The daily graph in-process: ingest, generate, DPP, train, evaluate on the next day;
    with a tracking URI also register the model and decide the champion by NE. `--mode both`
    runs both arms on the same samples and compares them (exit 3 when they differ). Every
    config override (--epochs, --nproc, ...) goes to the stages that take it. `--nodes N
    --image IMG ...`: train runs across N machines as a Kubeflow Trainer TrainJob
    (orchestration/trainjob.py), the rest here.""",
    _graph_params("data/default/warehouse", "data/default/logs", exclude=("mode",)),
    [
        inspect.Parameter(
            "mode",
            inspect.Parameter.KEYWORD_ONLY,
            default="dedup",
            annotation=Annotated[
                Literal["dedup", "baseline", "both"], typer.Option(help="training arm(s)")
            ],
        ),
        inspect.Parameter(
            "out",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                Path | None, typer.Option(help="also copy the comparison chart here (--mode both)")
            ],
        ),
        *_trainjob_params(),
    ],
    _run_body,
)


def _compare_body(handle, args: dict, out: Path) -> dict:

    return _run_graph(COMPARISON, args, handle, out)


_graph_command(
    "compare",
    """The comparison graph in-process (the `recd_dedup_vs_baseline` DAG): both arms on the
    same data, a table, a PNG chart (the warehouse's reports/compare/, MLflow, --out), and
    exit 3 when the arms' next-day NE or AUC differ beyond the configured tolerance.""",
    _graph_params("data/compare/warehouse", "data/compare/logs", exclude=("mode",)),
    [
        inspect.Parameter(
            "out",
            inspect.Parameter.KEYWORD_ONLY,
            default=Path("build/compare"),
            annotation=Annotated[Path, typer.Option(help="also copy the chart here")],
        )
    ],
    _compare_body,
    decision=False,  # the compare stage printed its table
)


@app.command("bench")
def bench_cmd(
    ctx: typer.Context,
    preset: Annotated[
        Literal["small", "default", "standard"], typer.Option(help="synthetic workload size")
    ] = "standard",
    out: Annotated[Path, typer.Option(help="where the bench writes its data and report")] = Path(
        "build/bench"
    ),
    movielens: Annotated[
        Path | None, typer.Option(help="MovieLens directory to benchmark too")
    ] = None,
    quality: Annotated[
        bool, typer.Option(help="model quality next to references (LR, the oracle)")
    ] = True,
    quality_days: Annotated[
        int, typer.Option(min=0, help="days of the warm-started week (0: no week)")
    ] = 7,
    train: Annotated[bool, typer.Option(help="training speed, dedup vs baseline")] = True,
    seeds: Annotated[
        int,
        typer.Option(
            min=1, help="fits of ours and of the best reference per MovieLens split (a spread)"
        ),
    ] = 1,
    kept: Annotated[
        Path | None,
        typer.Option(
            help="where each MovieLens model's figures are kept as it finishes, and reused "
            "while its rows and code are unchanged (default: <out>/kept)"
        ),
    ] = None,
    summary: SummaryOpt = None,
):
    """The headline ratios measured side by side (storage, ingestion, DPP, training) and the
    model's quality next to references on the same data."""
    from recd_core.bench.run import run_bench

    def body():
        return run_bench(
            preset,
            out,
            movielens,
            train=train,
            quality=quality,
            quality_days=quality_days,
            seeds=seeds,
            kept=kept,
        )

    _run(ctx, "bench", summary or out / "bench.json", body)


@app.command("status")
def status_cmd(
    ctx: typer.Context,
    warehouse: WarehouseOpt = "data/default/warehouse",
    ds: Annotated[str, typer.Option(help="the day: YYYY-MM-DD")] = "",
    config: ConfigOpt = None,
    summary: SummaryOpt = None,
):
    """Every partition of a day and the models trained on it: write id, what it was built
    from, and whether it is fresh, stale (an input rewritten since, the config's feature set
    differs) or unknown (no lineage recorded); lineage.py says how it is judged. A day with
    no partition is an error (exit 2), not an empty table."""

    def body():
        validate_ds(ds)
        rows = status(Warehouse(warehouse), ds, _pipeline(config).features if config else None)
        if not rows:  # not "ok" over an empty table: the day has nothing to judge
            raise BadInput(
                f"no partition of {ds} in {warehouse}: nothing was ingested, generated, "
                "preprocessed or trained for that day there"
            )
        table = Table(title=f"recd status {ds}", title_justify="left")
        for col in ("partition", "write id", "written", "rows", "built from", "state"):
            table.add_column(col, overflow="fold")
        colour = {"fresh": "green", "stale": "red", "damaged": "red", "unknown": "yellow"}
        for r in rows:
            built = ", ".join(
                [
                    *(f"{k} @{v}" for k, v in (r.get("inputs") or {}).items()),
                    *([f"logs {r['logs']}"] if r.get("logs") else []),
                ]
            )
            state = f"[{colour[r['state']]}]{r['state']}[/]" + (f": {r['why']}" if r["why"] else "")
            table.add_row(
                r["partition"],
                str(r.get("write_id") or "-"),
                str(r.get("written_at") or "-"),
                f"{r.get('rows') or 0:,}",
                built or "-",
                state,
            )
        Console(stderr=True, width=max(console.width, 160)).print(table)
        counts = {
            s: sum(r["state"] == s for r in rows) for s in ("fresh", "stale", "unknown", "damaged")
        }
        # the rows by partition: in the --summary JSON, not printed twice
        return {
            **{f"status.{k}": v for k, v in counts.items()},
            "partitions": {r["partition"]: r for r in rows},
        }

    _run(ctx, "status", summary, body)


def _serve_command() -> None:
    """`recd serve`, its limits' options generated from `ServeConfig` (declared once there)."""

    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("ctx", keyword, annotation=typer.Context),
        inspect.Parameter(
            "model",
            keyword,
            default="models:/recd-dlrm@champion",
            annotation=Annotated[
                str,
                typer.Option(
                    help="a registered model (models:/NAME@ALIAS, needs --tracking-uri) "
                    "or a trained model (<warehouse>/models/<run>, a directory)"
                ),
            ],
        ),
        inspect.Parameter(
            "host",
            keyword,
            default="127.0.0.1",
            annotation=Annotated[
                str, typer.Option(help="address to listen on (0.0.0.0 in a container)")
            ],
        ),
        inspect.Parameter(
            "port",
            keyword,
            default=5001,
            annotation=Annotated[int, typer.Option(help="port to listen on")],
        ),
        inspect.Parameter("config", keyword, default=None, annotation=ConfigOpt),
    ]
    for name, f in ServeConfig.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        is_bool = f.annotation is bool
        built_in = (
            str(f.default).lower()
            if is_bool
            else "from the others"
            if f.default is None
            else f"{f.default:,}"
        )
        option = typer.Option(
            f"{flag}/--no-{flag[2:]}" if is_bool else flag,
            help=f"{f.description} (default: the config's serve.{name}, built in {built_in})",
        )
        params.append(
            inspect.Parameter(
                name, keyword, default=None, annotation=Annotated[f.annotation | None, option]
            )
        )

    def command(
        ctx: typer.Context, model: str, host: str, port: int, config: Path | None, **limits
    ) -> None:
        """Serve a model over HTTP with MLflow's scoring protocol (`/invocations`,
        dataframe_split or dataframe_records; sample rows, or ranking requests: the user side
        once, its `candidates` listed), bounded: requests past the limits are refused
        with 413 or 503, a bad value with a one-line 400 naming the row and field
        (serving/app.py). Stops on SIGTERM after the requests in flight."""
        import uvicorn

        from recd_core.serving.app import build_app, load_served, log_to_stderr
        from recd_core.serving.batching import set_up_scoring

        tracker = ctx.find_root().obj
        try:
            base = _pipeline(config).serve
            cfg = parse_config(
                ServeConfig,
                {**base.model_dump(), **{k: v for k, v in limits.items() if v is not None}},
                "recd serve",
            )
            if model.startswith(("models:/", "runs:/")):
                if tracker is None:
                    raise BadInput(
                        f"--model {model}: a registered model needs --tracking-uri "
                        "(or MLFLOW_TRACKING_URI)"
                    )
                import mlflow

                tracker.check()
                mlflow.set_tracking_uri(tracker.uri)
            served = load_served(model)
        except Exception as e:  # noqa: BLE001 - the taxonomy decides; the rest re-raised
            err = classify(e)
            if err is None:
                raise
            _fail("serve", str(err), err.exit_code)
        threads = set_up_scoring(cfg)
        print_summary(
            "recd serve",
            {
                "serve.model": served.uri,
                "serve.url": f"http://{host}:{port}",
                **{f"serve.{k}": v for k, v in cfg.model_dump().items()},
                "serve.queue_rows": cfg.rows_held,
                "serve.max_in_flight": cfg.requests_held,
                "serve.threads": threads,
            },
        )
        log_to_stderr()
        uvicorn.run(
            build_app(served, cfg),
            host=host,
            port=port,
            log_level="info",
            timeout_graceful_shutdown=int(cfg.timeout_s),
        )

    command.__signature__ = inspect.Signature(params)
    command.__doc__ = inspect.getdoc(command)
    app.command("serve")(command)


_serve_command()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
