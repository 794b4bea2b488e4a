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

    <warehouse>/_rendezvous/<run>-<arm>-<day>.json   {"addr": node 0's IP, "port": 29400}"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time

from recd_core.errors import RecdError
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


def rendezvous_key(run: str, mode: str, ds: str) -> str:
    """One training run's rendezvous: the orchestrator's run id, the arm and the day."""
    return "-".join(re.sub(r"[^A-Za-z0-9_.-]", "_", part) for part in (run, mode, ds))


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
