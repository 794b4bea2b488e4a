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
from recd_core.orchestration.nodes import NODE_OPTIONS, RDZV_PORT
from recd_core.orchestration.schedule import training_day
from recd_core.orchestration.stage_args import stage_args, stage_options
from recd_core.orchestration.stages import run_stage, with_upstream
from recd_core.report import print_summary, write_summary
from recd_core.runtime import follower, launched_rank


def parser(stage: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m components.{stage}",
        description=f"recd stage {stage}: {STAGES[stage].doc}",
    )
    for o in stage_options(stage):
        # not `required=` here: a value may come from --args-json; StageArgs validates
        p.add_argument(o.flag, dest=o.name, default=None, help=o.help)
    p.add_argument("--args-json", help="further arguments as one JSON object (flags win)")
    for source in PULLED_FROM:  # the summaries stages take arguments from (graph.Pull)
        p.add_argument(f"--{source}-json", help=f"{source}'s summary (JSON)")
    p.add_argument("--upstream-item", action="append", default=[],
                   help="finish, compare: one upstream stage's summary (repeatable)")  # fmt: skip
    p.add_argument("--upstream-json", help="finish, compare: upstream summaries, a JSON list")
    p.add_argument("--output-metadata", type=Path, help="write the stage's summary JSON here")
    p.add_argument(
        "--executor-input",
        help="Kubeflow: the executor input (`{{$}}`); the "
        "stage's typed outputs are written as it asks (components/_kfp.py)",
    )
    for name, kind, default, text in NODE_OPTIONS:  # a stage run across machines
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=text)
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


NODE_FLAGS = tuple(f"--{name.replace('_', '-')}" for name, *_ in NODE_OPTIONS)


def _without_node_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in NODE_FLAGS:
            skip = True
        elif not a.startswith(tuple(f"{f}=" for f in NODE_FLAGS)):
            out.append(a)
    return out


def run_node(stage: str, argv: list[str], ns: dict, args: dict) -> int:
    """This machine's node of a stage run across `ns["nodes"]` machines: torchrun starting
    its processes, each running this component with the same arguments; node 0 publishes
    its address in the warehouse for the others, which wait for it (orchestration/nodes.py).
    Its exit status is torchrun's."""
    from recd_core.orchestration.nodes import (
        NodeGroup,
        await_master,
        node_torchrun,
        published_master,
        rendezvous_key,
    )
    from recd_core.warehouse import Warehouse

    wh = Warehouse(args["warehouse"])
    channel = ns["rendezvous"] or "run"
    group = NodeGroup(ns["nodes"], ns["node_rank"], ns["nproc_per_node"], channel)
    key = rendezvous_key(channel, args.get("mode") or "dedup", args["ds"])
    rest = [*_without_node_flags(argv), *(["--ds", args["ds"]] if "--ds" not in argv else [])]
    program = ["-m", f"components.{stage}", *rest]
    if group.node_rank == 0:
        with published_master(wh, key) as addr:
            return node_torchrun(group, addr, RDZV_PORT, program)[0]
    return node_torchrun(group, *await_master(wh, key), program)[0]


def main(stage: str, argv: list[str] | None = None) -> int:
    _stop_on_sigterm()
    argv = sys.argv[1:] if argv is None else argv
    ns = vars(parser(stage).parse_args(argv))
    node = {name: ns.pop(name) for name, *_ in NODE_OPTIONS}
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
        if node["nodes"] > 1 and launched_rank() is None:  # this machine's node: torchrun
            return run_node(stage, argv, node, args)
        ups = (json.loads(upstream) if upstream else []) + items
        summary = run_stage(stage, args, ups or None)
        if follower():  # rank 0 writes the outputs; a node's first process says it is done
            if os.environ.get("LOCAL_RANK") == "0":
                write_summary(out, {"status": "ok", "stage": stage, "rank": launched_rank()})
            print(f"recd {stage}: rank {launched_rank()} of {os.environ['WORLD_SIZE']} done")
            return 0
        if executor_input:
            write_outputs(stage, executor_input, stage_args(stage, args), summary, ups)
    except RecdError as e:
        print(f"recd {stage}: error: {e}", file=sys.stderr)
        if not follower():  # as `recd <stage> --summary` does: the failure, its code
            write_summary(out, {**e.summary, "status": "failed", "stage": stage,
                                "error": str(e), "exit_code": e.exit_code})  # fmt: skip
        return e.exit_code
    write_summary(out, summary)
    print_summary(f"recd {stage}", summary)  # what `recd <stage>` prints, in the task log
    return 0
