"""Training across machines: the `torchrun` command each machine (a pod, a host) runs so that
`nodes` of them join one run.

    node 0   torchrun --nnodes N --node-rank 0 --master-addr <node 0's name> ... -m components.train ...
    node k   the same, --node-rank k: joins node 0's rendezvous (its TCPStore)

The rendezvous is torchrun's static one, node 0 hosting it: the node ranks are the pods'
indices, so rank 0 (which writes the model, the summary and the MLflow record) is always on
node 0, the pod whose output the orchestrator reads. Every rank runs the same stage with the
same arguments; the others do their share and report themselves done (`runtime.follower`)."""

from __future__ import annotations

RDZV_PORT = 29400  # torchrun's usual rendezvous port


def torchrun_command(nodes: int, per_node: int, node_rank: int | str, master: str,
                     port: int = RDZV_PORT) -> list[str]:  # fmt: skip
    """`torchrun` starting this node's `per_node` processes of a run of `nodes` machines,
    joined at `master:port` (node 0's address); the program and its arguments follow."""
    return ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
            f"--node-rank={node_rank}", f"--master-addr={master}", f"--master-port={port}"]  # fmt: skip
