"""Training across machines: the `torchrun` command each machine (a pod, a host) runs so that
`nodes` of them join one run.

    node 0   torchrun --nnodes N --node-rank 0 --master-addr <node 0's name> ... -m components.train ...
    node k   the same, --node-rank k: joins node 0's rendezvous (its TCPStore)

The rendezvous is torchrun's static one, node 0 hosting it: the node ranks are the pods'
indices, so rank 0 (which writes the model, the summary and the MLflow record) is always on
node 0, the pod whose output the orchestrator reads. Every rank runs the same stage with the
same arguments; the others do their share and report themselves done (`runtime.follower`).

Node 0's address: its pod's name under the chart's headless Service (Airflow names the
pods), or, where pods have no stable names (Kubeflow's steps), published by node 0 in the
warehouse every node shares (`published_master`, `await_master`):

    <warehouse>/_rendezvous/<run>-<arm>-<day>.json   {"addr": node 0's IP, "port": 29400}

A whole pipeline on several machines (`recd run --nodes N --node-rank K --rendezvous ID`, the
chart's CronJob as an Indexed Job): node 0 runs the pipeline, and each accelerated stage as
torchrun's node 0 (`Host`); the other nodes run no stage of their own, they join every
training run node 0 announces on the run's channel, with its arguments, until it says the
pipeline is over (`follow`):

    <warehouse>/_rendezvous/<ID>/run.json    {"id": "<attempt>-<n>", "addr", "port", "nodes",
                                              "per_node", "stage", "argv": [the stage's]}
    <warehouse>/_rendezvous/<ID>/done.json   node 0's pipeline succeeded: the others exit 0

A node 0 that fails leaves the others following: its retry (the Job's next pod for index 0)
announces a new attempt, which they join."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from recd_core.errors import BadInput, RecdError, of_exit
from recd_core.leftovers import write_atomically

RDZV_PORT = 29400  # torchrun's usual rendezvous port


def torchrun_command(nodes: int, per_node: int, node_rank: int | str, master: str,
                     port: int = RDZV_PORT) -> list[str]:  # fmt: skip
    """`torchrun` starting this node's `per_node` processes of a run of `nodes` machines,
    joined at `master:port` (node 0's address); the program and its arguments follow."""
    return ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
            f"--node-rank={node_rank}", f"--master-addr={master}", f"--master-port={port}"]  # fmt: skip


class NoRendezvous(RecdError):
    """Node 0 did not publish its address in time (exit 1, retryable: it may start late)."""


def _published(wh, key: str) -> str:
    return f"{wh.root}/_rendezvous/{key}.json"


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", part)


def rendezvous_key(run: str, mode: str, ds: str) -> str:
    """One training run's rendezvous: the orchestrator's run id, the arm and the day."""
    return "-".join(_safe(part) for part in (run, mode, ds))


@contextlib.contextmanager
def published_master(wh, key: str, port: int = RDZV_PORT):
    """Node 0's address (this host's), published in the warehouse for its peers while the
    run lasts: for orchestrators whose pods have no stable names (Kubeflow's steps). Removed
    at the end, whatever the end, so a retry's peers wait for the retry's address."""
    addr = socket.gethostbyname(socket.gethostname())
    path = _published(wh, key)
    write_atomically(wh.fs, path, json.dumps({"addr": addr, "port": port}).encode())
    try:
        yield addr
    finally:
        with contextlib.suppress(OSError):
            wh.fs.delete_file(path)


def await_master(wh, key: str, timeout_s: float = 900, poll_s: float = 2) -> tuple[str, int]:
    """Node 0's address and port once it has published them (`published_master`)."""
    path, deadline = _published(wh, key), time.monotonic() + timeout_s
    while True:
        if wh.exists_file(path):
            with wh.fs.open_input_stream(path) as f:
                found = json.loads(f.read())
            return found["addr"], int(found["port"])
        if time.monotonic() > deadline:
            raise NoRendezvous(f"node 0 of training run {key} published no address at {path} "
                               f"within {timeout_s:.0f} s")  # fmt: skip
        time.sleep(poll_s)


# how long a node waits for node 0's next training run: the stages before training (a
# backfill's days among them); the Job's activeDeadlineSeconds ends a pipeline stuck longer
FOLLOW_WAIT_S = 6 * 3600

# (option, type, default, help): this machine's place in a run across machines, for `recd
# run` and the components alike
NODE_OPTIONS = (
    ("nodes", int, 1, "train across this many machines (pods), this one a node of them"),
    ("node_rank", int, 0, "this machine's node (0: runs the stage or the pipeline and hosts "
                          "the rendezvous)"),
    ("nproc_per_node", int, 1, "training processes on this machine"),
    ("rendezvous", str, "", "the orchestrator's run id, the same on every node: where node 0 "
                            "publishes its address (the warehouse's _rendezvous/)"),
)  # fmt: skip


@dataclass(frozen=True)
class NodeGroup:
    """This machine's place in a run across `nodes` machines of `per_node` training
    processes each (torchrun's ranks node_rank * per_node ...), joined on `channel`."""

    nodes: int
    node_rank: int
    per_node: int
    channel: str

    def __post_init__(self):
        if self.nodes < 1 or self.per_node < 1:
            raise BadInput(f"--nodes {self.nodes} --nproc-per-node {self.per_node}: both must "
                           "be at least 1")  # fmt: skip
        if not 0 <= self.node_rank < self.nodes:
            raise BadInput(f"--node-rank {self.node_rank} is not a node of --nodes "
                           f"{self.nodes} (0 to {self.nodes - 1})")  # fmt: skip
        if self.nodes > 1 and not self.channel:
            raise BadInput(f"--nodes {self.nodes} needs --rendezvous: the orchestrator's run "
                           "id, the same on every node")  # fmt: skip


def _channel(wh, channel: str) -> str:
    return f"{wh.root}/_rendezvous/{_safe(channel)}"


def _read(wh, path: str) -> dict | None:
    try:
        with wh.fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def node_torchrun(group: NodeGroup, addr: str, port: int, argv: list[str],
                  superseded=lambda: False, poll_s: float = 5) -> tuple[int, str]:  # fmt: skip
    """This node's torchrun of the program `argv` names (`-m components.<stage> ...`): its
    exit status and the failure's one-line reason (the last `error:` line of its stderr,
    which passes through). Stopped when `superseded()` says node 0 announced a newer run
    or ended (a node 0 that died before this node joined it, and its retry waiting for
    this node)."""
    _, *flags = torchrun_command(group.nodes, group.per_node, group.node_rank, addr, port)
    cmd = [sys.executable, "-m", "torch.distributed.run", *flags, *argv]
    reason: list[str] = []
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace") as p:

        def tee():
            for line in p.stderr:
                sys.stderr.write(line)
                if ": error: " in line:
                    reason[:] = [line.split(": error: ", 1)[1].strip()]

        thread = threading.Thread(target=tee, daemon=True)
        thread.start()
        try:
            while (code := _wait(p, poll_s)) is None:
                if superseded():
                    p.terminate()
                    code = p.wait()
                    reason[:] = ["node 0 announced a newer run, or ended"]
        except BaseException:  # SIGTERM (SystemExit), Ctrl-C: the node's processes too
            p.terminate()
            raise
        thread.join()
    return code, (reason or [""])[0]


def _wait(p: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


class Host:
    """Node 0 of a pipeline run across machines: each accelerated stage run as torchrun's
    node 0 of `component -m components.<stage>`, announced on the channel for the other
    nodes; `done` when the pipeline succeeded."""

    def __init__(self, wh, group: NodeGroup):
        self.wh, self.group = wh, group
        self.dir = _channel(wh, group.channel)
        self.attempt, self.runs = uuid.uuid4().hex[:8], 0
        for leftover in ("run.json", "done.json"):  # an earlier attempt's, or a reused id's
            with contextlib.suppress(OSError):
                wh.fs.delete_file(f"{self.dir}/{leftover}")

    def run_stage(self, stage: str, args: dict, upstream: list[dict] | None = None) -> dict:
        """`stage` with `args` across the group's machines; its summary (rank 0's)."""
        from recd_core.modeling.launch import free_port

        if upstream:
            raise BadInput(f"{stage} gathers other stages' summaries: it runs on one machine")
        self.runs += 1
        argv = ["-m", f"components.{stage}", "--args-json", json.dumps(args, default=str)]
        addr, port = socket.gethostbyname(socket.gethostname()), free_port()
        run = {"id": f"{self.attempt}-{self.runs}", "addr": addr, "port": port,
               "nodes": self.group.nodes, "per_node": self.group.per_node, "stage": stage,
               "argv": argv}  # fmt: skip
        path = f"{self.dir}/run.json"
        with tempfile.TemporaryDirectory() as tmp:
            write_atomically(self.wh.fs, path, json.dumps(run).encode())
            try:
                out = f"{tmp}/summary.json"
                code, reason = node_torchrun(
                    self.group, addr, port, [*argv, "--output-metadata", out]
                )
            finally:
                with contextlib.suppress(OSError):
                    self.wh.fs.delete_file(path)
            summary = json.loads(Path(out).read_text()) if Path(out).exists() else {}
        if code or summary.get("status") != "ok":  # rank 0's failure, or a rank's: torchrun's 1
            reason = summary.get("error") or reason or f"torchrun exited {code}"
            raise of_exit(summary.get("exit_code", code), reason)
        return summary

    def done(self) -> None:
        write_atomically(self.wh.fs, f"{self.dir}/done.json",
                         json.dumps({"runs": self.runs}).encode())  # fmt: skip


def _superseded(wh, where: str, run_id: str) -> bool:
    """Has node 0 announced another run since `run_id`, or ended its pipeline?"""
    if wh.exists_file(f"{where}/done.json"):
        return True
    found = _read(wh, f"{where}/run.json")
    return found is not None and found["id"] != run_id


def follow(wh, group: NodeGroup, wait_s: float = FOLLOW_WAIT_S, poll_s: float = 2,
           say=print) -> dict:  # fmt: skip
    """Node `group.node_rank` > 0 of a pipeline run across machines: join every training
    run node 0 announces, until node 0's pipeline is done; what it joined. A run that fails
    here fails on node 0 too, whose retry announces the next attempt: this node follows on."""
    where = _channel(wh, group.channel)
    joined, failed, last = 0, 0, None
    deadline = time.monotonic() + wait_s
    say(f"node {group.node_rank} of {group.nodes}: following {where}")
    while True:
        if wh.exists_file(f"{where}/done.json"):
            return {"node": group.node_rank, "runs_joined": joined, "runs_failed": failed}
        run = _read(wh, f"{where}/run.json")
        if run and run["id"] != last:
            if (run["nodes"], run["per_node"]) != (group.nodes, group.per_node):
                raise BadInput(f"node 0 of {group.channel} runs {run['nodes']} machines of "
                               f"{run['per_node']} processes; this node was started as one of "
                               f"{group.nodes} of {group.per_node}")  # fmt: skip
            last = run["id"]
            say(f"node {group.node_rank}: joining {run['stage']} run {last} at "
                f"{run['addr']}:{run['port']}")  # fmt: skip
            newer = functools.partial(_superseded, wh, where, last)
            code, reason = node_torchrun(group, run["addr"], run["port"], run["argv"], newer,
                                     poll_s * 5)  # fmt: skip
            joined, failed = joined + (code == 0), failed + (code != 0)
            say(f"node {group.node_rank}: {run['stage']} run {last} "
                + ("done" if code == 0 else f"failed here (exit {code}: {reason or 'see above'}); "
                   "following node 0's retry"))  # fmt: skip
            deadline = time.monotonic() + wait_s
        elif time.monotonic() > deadline:
            raise NoRendezvous(f"node 0 of {group.channel} announced no training run at "
                               f"{where} within {wait_s:.0f} s")  # fmt: skip
        time.sleep(poll_s)
