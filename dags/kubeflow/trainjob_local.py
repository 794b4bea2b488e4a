"""A recd TrainJob run on this machine by the Kubeflow SDK's own container backend (Podman or
Docker): each node a container of the components image on a network of its own, started by
the SDK as Kubeflow Trainer starts a node (torchrun with the node count, this node's rank and
node 0's address, static rendezvous), no cluster needed.

    python dags/kubeflow/trainjob_local.py --image localhost/recd-components:dev --nodes 2 \\
        --workdir /tmp/job -- --warehouse /workspace/wh --ds 2026-11-01 ...

The SDK's container backend runs Python functions only (`CustomTrainer`), not an image's own
command: each node runs `recd_node`, which runs `-m components.train` with the TrainJob's
arguments in the process torchrun started, as the TrainJob's `torchrun -m components.train
ARGS` does. The node sees `workdir` at /workspace (the SDK's job directory): the warehouse
the TrainJob reads goes there.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_local import docker_api  # noqa: E402  (podman's Docker API, served for the run)


def recd_node(argv: list[str]) -> None:
    """One TrainJob node's process, under the SDK's torchrun: `-m components.train ARGV`."""
    import runpy
    import sys

    sys.argv = ["components.train", *argv]
    runpy.run_module("components.train", run_name="__main__")


def run_locally(body: dict, workdir: Path, timeout_s: int = 1800) -> tuple[str, list[str]]:
    """The TrainJob `body` (`trainjob(...).to_dict()`) run in containers by the SDK, its job
    directory `workdir` (filled by the caller); its end ("Complete" or "Failed") and each
    node's log."""
    from kubeflow.trainer import ContainerBackendConfig, CustomTrainer, TrainerClient
    from kubeflow.trainer.backends.container.types import TrainingRuntimeSource
    from kubeflow.trainer.options.common import Name

    name, trainer = body["metadata"]["name"], body["spec"]["trainer"]
    assert trainer["command"] == ["torchrun", "-m", "components.train"], trainer["command"]
    with docker_api() as host:
        engine = "podman" if host and "recd-podman-" in host else "docker"  # docker_api's
        cfg = ContainerBackendConfig(
            container_runtime=engine,
            container_host=host,
            auto_remove=False,
            runtime_source=TrainingRuntimeSource(sources=[]),
        )
        client = TrainerClient(cfg)
        # the SDK's job directory (<home>/.kubeflow/trainer/containers/<name>): `workdir`
        job_dir = Path.home() / ".kubeflow/trainer/containers" / name
        job_dir.parent.mkdir(parents=True, exist_ok=True)
        job_dir.symlink_to(workdir, target_is_directory=True)
        client.train(
            trainer=CustomTrainer(
                func=recd_node,
                func_args={"argv": trainer["args"]},
                image=trainer["image"],
                num_nodes=trainer["numNodes"],
            ),
            options=[Name(name=name)],
        )
        with contextlib.suppress(RuntimeError):  # Failed: said by the status below
            client.wait_for_job_status(name, {"Complete", "Failed"}, timeout=timeout_s)
        status = client.get_job(name).status
        logs = [
            subprocess.run(
                [engine, "logs", f"{name}-node-{k}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ).stdout
            for k in range(trainer["numNodes"])
        ]
        client.delete_job(name)
        job_dir.unlink()
    return status, logs


def main() -> None:
    from recd_core.orchestration.trainjob import TrainJobConfig, job_name, trainjob

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--workdir", type=Path, required=True, help="the nodes' /workspace")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- the train stage's arguments")
    a = p.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    body = trainjob(job_name("local", "run"), args, TrainJobConfig(nodes=a.nodes, image=a.image))
    status, logs = run_locally(body.to_dict(), a.workdir.resolve())
    for k, log in enumerate(logs):
        print(f"===== node {k}\n{log}")
    print(f"TrainJob {body.metadata.name}: {status}")
    sys.exit(0 if status == "Complete" else 1)


if __name__ == "__main__":
    main()
