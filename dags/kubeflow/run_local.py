"""The Kubeflow pipeline itself run here, each stage a container of the components image:
`kfp.local`'s DockerRunner against docker, or podman's Docker-compatible API
(`podman system service`, started for the run), every pod as the chart runs it (uid 10001,
a read-only root, every capability dropped, /tmp a tmpfs).

    python dags/kubeflow/run_local.py --image localhost/recd-components:0.1.0 \\
        --root /srv/recd-kfp --ds 2026-11-01 [--config tests/configs/small.yaml]

The warehouse, the logs and a SQLite MLflow store live under `--root`, the local pipeline
root, which kfp.local mounts into every container at the same path. Two things of kfp.local
2.17 are worked around here, both said where they happen: it cannot resolve the
scheduled-time placeholder (the pipeline is built without it: `scheduled=False`), and with
`auto_remove` it loses a container's exit code when the engine removes the container first
(podman does), reporting a failed stage as SUCCESS; the containers are removed here after
their exit code is read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recd_pipeline import RETRIES, build_pipeline  # noqa: E402
from run_in_containers import POD_RUN_ARGS  # noqa: E402  (how the chart runs pods)

from recd_core.orchestration.graph import COMPARISON, DAILY, Graph  # noqa: E402


@contextlib.contextmanager
def docker_api(env: dict | None = None) -> Iterator[str | None]:
    """A Docker API for kfp.local: the environment's (`DOCKER_HOST`, a docker daemon), else
    podman's, served for the run from a socket of its own. Yields its DOCKER_HOST (None: the
    default)."""
    env = dict(os.environ if env is None else env)
    docker = shutil.which("docker")
    if env.get("DOCKER_HOST") or (
        docker and subprocess.run([docker, "info"], capture_output=True).returncode == 0
    ):
        yield env.get("DOCKER_HOST")
        return
    with tempfile.TemporaryDirectory(prefix="recd-podman-") as tmp:
        sock = f"unix://{tmp}/podman.sock"
        proc = subprocess.Popen(
            ["podman", "system", "service", "--time=0", sock],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            for _ in range(100):
                if Path(tmp, "podman.sock").exists():
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"podman system service: {proc.stderr.read().decode()}")
                time.sleep(0.1)
            yield sock
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _run_keeping_exit_code(client, image: str, command: list[str], volumes: dict, **kw) -> int:
    """kfp.local's `run_docker_container`, but the container is removed after its exit code
    is read (kfp.local's `auto_remove` races the engine and then assumes exit 0)."""
    container = client.containers.run(
        image=image, command=command, detach=True, volumes=volumes, **kw
    )
    try:
        for line in container.logs(stream=True):
            print(line.decode(), end="")
        return container.wait()["StatusCode"]
    finally:
        container.remove(force=True)


def task_outputs(root: Path) -> dict[str, dict]:
    """Each task's summary and typed outputs from a kfp.local pipeline root, by component
    (`recd-train`, …; a stage run twice, like ingest for the evaluation day: `recd-ingest-2`)."""
    out = {}
    for f in sorted(root.glob("*/recd-*/executor_output.json")):
        executor_output = json.loads(f.read_text())
        summary = executor_output.get("parameterValues", {}).get("summary")
        summary = summary or (f.parent / "summary").read_text()
        out[f.parent.name] = {
            "summary": json.loads(summary),
            "outputs": executor_output.get("artifacts", {}),
        }
    return out


def run_pipeline(
    image: str, root: Path, args: dict, graph: Graph = DAILY, retries: int = RETRIES
) -> dict[str, dict]:
    """Run `graph`'s Kubeflow pipeline with kfp.local in containers under pipeline root
    `root`; each task's summary and outputs (`task_outputs`). A stage that fails raises
    `RuntimeError` naming it, after its retries (kfp.local honours the retry policy)."""
    from kfp import local
    from kfp.local import docker_task_handler

    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o777)  # the pods' user writes its outputs there
    with docker_api() as host:
        saved = (os.environ.get("DOCKER_HOST"), docker_task_handler.run_docker_container)
        if host:
            os.environ["DOCKER_HOST"] = host
        docker_task_handler.run_docker_container = _run_keeping_exit_code
        try:
            local.init(
                runner=local.DockerRunner(**POD_RUN_ARGS),
                pipeline_root=str(root),
                raise_on_error=True,
            )
            build_pipeline(image, graph, scheduled=False, retries=retries)(**args)
        finally:
            docker_task_handler.run_docker_container = saved[1]
            if saved[0] is None:
                os.environ.pop("DOCKER_HOST", None)
            else:
                os.environ["DOCKER_HOST"] = saved[0]
    return task_outputs(root)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True)
    p.add_argument("--root", type=Path, required=True, help="the local pipeline root")
    p.add_argument("--ds", required=True)
    p.add_argument("--config", type=Path, help="a pipeline config (copied under --root)")
    p.add_argument("--comparison", action="store_true", help="the two-arm pipeline")
    a = p.parse_args()
    root = a.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    config = ""
    if a.config:
        config = str(shutil.copy(a.config, root / a.config.name))
    args = {
        "ds": a.ds,
        "warehouse": f"{root}/wh",
        "logs": f"{root}/logs",
        "config": config,
        "tracking_uri": f"sqlite:///{root}/mlflow.db",
        "synthesize": True,
    }
    try:
        done = run_pipeline(a.image, root, args, COMPARISON if a.comparison else DAILY)
    except RuntimeError as e:  # kfp.local's: the pipeline failed, naming the task
        print(f"run_local: {str(e).splitlines()[-1]}", file=sys.stderr)
        return 1
    last = done["recd-finish"]["summary"]
    keys = ("eval.ne", "eval.auc", "registry.decision", "storage.ratio", "train.speedup")
    print(json.dumps({k: last[k] for k in keys if k in last}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
