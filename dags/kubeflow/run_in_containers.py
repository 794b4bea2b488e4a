"""The daily graph with every stage as its own container of the components image, run here
with podman or docker, as Kubernetes runs the Kubeflow pipeline's pods: the container
components' own command lines (`recd_pipeline.stage_command`), uid 10001, a read-only root
filesystem, every capability dropped, /tmp a tmpfs; each task's summary read from its
output-metadata file and handed to the tasks downstream, in the graph's order.

    python dags/kubeflow/run_in_containers.py --image localhost/recd-components:0.1.0 \\
        --data /srv/recd --ds 2026-11-01 [--engine podman] [--config /data/small.yaml]

`--data` is mounted at /data (the warehouse, the logs and a SQLite MLflow store live there).
Why not `kfp.local.DockerRunner`: it runs the containers (against podman's Docker API too),
but it does not resolve pipeline parameters inside the STRUCT `args` input the components
take (`--ds` arrives as `{{$.inputs.parameters['pipelinechannel--ds']}}`), and it reported a
stage that exited 2 as SUCCESS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recd_pipeline import stage_command  # noqa: E402

from recd_core.orchestration.graph import DAILY, PULLED_FROM  # noqa: E402

POD = ["--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges",
       "--user", "10001:10001", "--tmpfs", "/tmp:mode=1777"]  # fmt: skip


def run_in_containers(engine: str, image: str, data: Path, args: dict) -> dict[str, dict]:
    """Every task of the daily graph in its own container; each task's summary by task id.
    A task that fails raises `subprocess.CalledProcessError` with its exit code and stderr."""
    out = data / "_task_outputs"
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o777)
    done: dict[str, dict] = {}
    for task in DAILY.order():
        pulled = {p.stage: json.dumps(done[src]) for p, src in DAILY.pulls(task)}
        sources = [pulled.get(s, "{}") for s in PULLED_FROM]
        gathered = [json.dumps(done[t]) for t in task.gathers]
        targs = json.dumps({**args, **task.args()})
        cmd = stage_command(
            task.stage, targs, sources, gathered, f"/data/_task_outputs/{task.id}.json"
        )
        t0 = time.perf_counter()
        r = subprocess.run([engine, "run", "--rm", *POD, "-v", f"{data}:/data", image, *cmd],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode:
            raise subprocess.CalledProcessError(
                r.returncode, f"{task.id} ({task.stage})", r.stdout, r.stderr
            )
        done[task.id] = json.loads((out / f"{task.id}.json").read_text())
        print(f"{task.id:<18} {time.perf_counter() - t0:6.1f} s  exit 0", flush=True)
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True)
    p.add_argument("--engine", default="podman")
    p.add_argument("--data", type=Path, required=True, help="mounted at /data")
    p.add_argument("--ds", required=True)
    p.add_argument("--config", default="", help="a config path inside the container")
    a = p.parse_args()
    a.data.mkdir(parents=True, exist_ok=True)
    args = {"warehouse": "/data/wh", "logs": "/data/logs", "ds": a.ds, "synthesize": True,
            "tracking_uri": "sqlite:////data/mlflow.db", "config": a.config,
            "pipeline": "recd kubeflow (containers)"}  # fmt: skip
    try:
        done = run_in_containers(a.engine, a.image, a.data.resolve(), args)
    except subprocess.CalledProcessError as e:
        print(
            f"{e.cmd}: exit {e.returncode}: {e.stderr.strip().splitlines()[-1:]}", file=sys.stderr
        )
        return e.returncode
    last = done[DAILY.order()[-1].id]
    print(json.dumps({k: last.get(k) for k in ("eval.ne", "eval.auc", "registry.decision")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
