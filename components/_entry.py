"""What every component entrypoint does: typed arguments (generated from `StageArgs`, as
`recd <stage>`'s options are, so the orchestrators, the command line and the library cannot
drift apart), one stage call, the stage's summary written as the output-metadata file the
orchestrator reads and printed as `recd <stage>` prints it, and a one-line reason with the exit code of `recd_core.errors` (2 bad input,
3 quality gate, 4 tracking) on failure."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from components._kfp import write_outputs
from recd_core.errors import BadInput, RecdError
from recd_core.orchestration.graph import PULLED_FROM, STAGES
from recd_core.orchestration.schedule import training_day
from recd_core.orchestration.stage_args import stage_args, stage_options
from recd_core.orchestration.stages import run_stage
from recd_core.orchestration.summaries import with_upstream
from recd_core.orchestration.trainjob import TrainJobConfig, flag_options, stage_trainjob
from recd_core.report import print_summary, write_summary
from recd_core.runtime import follower, launched_rank


def parser(stage: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m components.{stage}", description=f"recd stage {stage}: {STAGES[stage].doc}"
    )
    for o in stage_options(stage):
        # not `required=` here: a value may come from --args-json; StageArgs validates
        p.add_argument(o.flag, dest=o.name, default=None, help=o.help)
    p.add_argument("--args-json", help="further arguments as one JSON object (flags win)")
    for source in PULLED_FROM:  # the summaries stages take arguments from (graph.Pull)
        p.add_argument(f"--{source}-json", help=f"{source}'s summary (JSON)")
    p.add_argument(
        "--upstream-item",
        action="append",
        default=[],
        help="finish, compare: one upstream stage's summary (repeatable)",
    )
    p.add_argument("--upstream-json", help="finish, compare: upstream summaries, a JSON list")
    p.add_argument("--output-metadata", type=Path, help="write the stage's summary JSON here")
    p.add_argument(
        "--executor-input",
        help="Kubeflow: the executor input (`{{$}}`); the "
        "stage's typed outputs are written as it asks (components/_kfp.py)",
    )
    for name, kind, default, text, many in flag_options():  # train across machines
        flag = f"--{name.replace('_', '-')}"
        p.add_argument(
            flag, type=kind, default=default, help=text, **({"action": "append"} if many else {})
        )
    p.add_argument(
        "--scheduled-time",
        help="a recurring run's scheduled time (ISO 8601): "
        "without --ds, the days are the last complete ones before it",
    )
    return p


def _unresolved(value: str | None) -> bool:
    """An orchestrator placeholder left as it was (a one-off run has no schedule time)."""
    return not value or value.startswith("{{")


def _stop_on_sigterm() -> None:
    """Exit at once on SIGTERM (143), cleaning up as on any exit. A pod's `command` replaces
    the image's tini entrypoint, and Python as PID 1 would otherwise ignore SIGTERM until
    the kubelet's SIGKILL, grace period later."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():  # signals: main thread only
        signal.signal(signal.SIGTERM, stop)


def main(stage: str, argv: list[str] | None = None) -> int:
    _stop_on_sigterm()
    argv = sys.argv[1:] if argv is None else argv
    ns = vars(parser(stage).parse_args(argv))
    node_flags = {name: ns.pop(name) for name, *_ in flag_options()}
    out, upstream = ns.pop("output_metadata"), ns.pop("upstream_json")
    executor_input, scheduled = ns.pop("executor_input"), ns.pop("scheduled_time")
    extra = ns.pop("args_json")
    sources = {source: ns.pop(f"{source}_json") for source in PULLED_FROM}
    items = [json.loads(i) for i in ns.pop("upstream_item") if i and i != "{}"]
    args = {
        **json.loads(extra or "{}"),
        **{k: v for k, v in ns.items() if v not in (None, "", "None")},
    }
    args = with_upstream(stage, args, sources)
    try:
        if not args.get("ds") and not _unresolved(scheduled):
            try:
                args["ds"] = training_day(scheduled, int(args.get("days") or 1))
            except ValueError:
                raise BadInput(f"--scheduled-time {scheduled!r} is not an ISO 8601 time") from None
        ups = (json.loads(upstream) if upstream else []) + items
        node = TrainJobConfig.from_flags(node_flags)
        if node.nodes > 1 and launched_rank() is None:  # across machines: a TrainJob's nodes
            if not STAGES[stage].accelerated:
                raise BadInput(f"--nodes {node.nodes}: only the train stage runs across machines")
            summary = stage_trainjob(node)(stage, args, ups or None)
        else:
            summary = run_stage(stage, args, ups or None)
        if follower():  # rank 0 writes the outputs and the summary
            print(f"recd {stage}: rank {launched_rank()} of {os.environ['WORLD_SIZE']} done")
            return 0
        if executor_input:
            write_outputs(stage, executor_input, stage_args(stage, args), summary, ups)
    except RecdError as e:
        print(f"recd {stage}: error: {e}", file=sys.stderr)
        if not follower():  # as `recd <stage> --summary` does: the failure, its code
            write_summary(
                out,
                {
                    **e.summary,
                    "status": "failed",
                    "stage": stage,
                    "error": str(e),
                    "exit_code": e.exit_code,
                },
            )
        return e.exit_code
    write_summary(out, summary)
    print_summary(f"recd {stage}", summary)  # what `recd <stage>` prints, in the task log
    return 0
