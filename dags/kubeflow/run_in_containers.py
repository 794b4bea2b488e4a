"""The daily graph with every stage as its own container of the components image, run here
with podman or docker, as Kubernetes runs the Kubeflow pipeline's pods: the container
components' own command lines (`recd_pipeline.stage_command`), uid 10001, a read-only root
filesystem, every capability dropped, /tmp a tmpfs; each task's summary read from its
output-metadata file and handed to the tasks downstream, in the graph's order.

    python dags/kubeflow/run_in_containers.py --image localhost/recd-components:0.1.0 \\
        --data /srv/recd --ds 2026-11-01 [--engine podman] [--config /data/small.yaml]

`--data` is mounted at /data (the warehouse, the logs and a SQLite MLflow store live there).
Each container also gets the part of KFP's executor input that names its typed outputs, so
the Datasets, Model, Metrics and Markdown report a Kubeflow run shows are written here too
(`_task_outputs/<task>/`).
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

from recd_core.orchestration.graph import (  # noqa: E402
    COMPARISON,
    DAILY,
    PULLED_FROM,
    Graph,
    outputs,
)

# how the chart runs pods, declared once: as docker-py arguments (kfp.local's DockerRunner,
# run_local.py) and as the engine's command-line flags
POD_RUN_ARGS = {
    "user": "10001:10001",
    "read_only": True,
    "cap_drop": ["ALL"],
    "security_opt": ["no-new-privileges"],
    "tmpfs": {"/tmp": "mode=1777"},
}
POD = [
    "--user",
    POD_RUN_ARGS["user"],
    "--read-only",
    *(f"--cap-drop={c}" for c in POD_RUN_ARGS["cap_drop"]),
    *(f"--security-opt={o}" for o in POD_RUN_ARGS["security_opt"]),
    *(x for d, o in POD_RUN_ARGS["tmpfs"].items() for x in ("--tmpfs", f"{d}:{o}")),
]


def executor_input(task_id: str, stage: str) -> dict:
    """The part of KFP's executor input a stage's container reads (components/_kfp.py): where
    each typed output goes (under /data/_task_outputs/<task>/) and the executor output file."""
    base = f"/data/_task_outputs/{task_id}"
    return {
        "outputs": {
            "artifacts": {
                n: {"artifacts": [{"name": n, "uri": f"{base}/{n}", "metadata": {}}]}
                for n in outputs(stage)
            },
            "outputFile": f"{base}/executor_output.json",
        }
    }


def run_in_containers(
    engine: str, image: str, data: Path, args: dict, graph: Graph = DAILY
) -> dict[str, dict]:
    """Every task of `graph` in its own container; each task's summary and typed outputs
    (its executor output) by task id. A task that fails raises
    `subprocess.CalledProcessError` with its exit code and stderr."""
    out = data / "_task_outputs"
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o777)
    done: dict[str, dict] = {}
    for task in graph.order():
        pulled = {p.stage: json.dumps(done[src]["summary"]) for p, src in graph.pulls(task)}
        sources = [pulled.get(s, "{}") for s in PULLED_FROM]
        gathered = [json.dumps(done[t]["summary"]) for t in task.gathers]
        spec = executor_input(task.id, task.stage)
        flags = {
            k: json.dumps(v) if isinstance(v, bool) else str(v)
            for k, v in {**args, **task.args()}.items()
        }  # as KFP renders them
        cmd = stage_command(
            task.stage,
            flags,
            sources,
            gathered,
            f"/data/_task_outputs/{task.id}.json",
            json.dumps(spec),
        )
        t0 = time.perf_counter()
        r = subprocess.run(
            [engine, "run", "--rm", *POD, "-v", f"{data}:/data", image, *cmd],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            raise subprocess.CalledProcessError(
                r.returncode, f"{task.id} ({task.stage})", r.stdout, r.stderr
            )
        executor_output = out / task.id / "executor_output.json"
        done[task.id] = {
            "summary": json.loads((out / f"{task.id}.json").read_text()),
            "outputs": json.loads(executor_output.read_text())["artifacts"],
        }
        print(
            f"{task.id:<20} {time.perf_counter() - t0:6.1f} s  exit 0  "
            f"outputs: {', '.join(done[task.id]['outputs']) or '-'}",
            flush=True,
        )
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True)
    p.add_argument("--engine", default="podman")
    p.add_argument("--data", type=Path, required=True, help="mounted at /data")
    p.add_argument("--ds", required=True)
    p.add_argument("--config", default="", help="a config path inside the container")
    p.add_argument("--comparison", action="store_true", help="the two-arm graph (COMPARISON)")
    a = p.parse_args()
    graph = COMPARISON if a.comparison else DAILY
    a.data.mkdir(parents=True, exist_ok=True)
    args = {
        "warehouse": "/data/wh",
        "logs": "/data/logs",
        "ds": a.ds,
        "synthesize": True,
        "tracking_uri": "sqlite:////data/mlflow.db",
        "config": a.config,
        "pipeline": "recd kubeflow (containers)",
    }
    try:
        done = run_in_containers(a.engine, a.image, a.data.resolve(), args, graph)
    except subprocess.CalledProcessError as e:
        print(
            f"{e.cmd}: exit {e.returncode}: {e.stderr.strip().splitlines()[-1:]}", file=sys.stderr
        )
        return e.returncode
    last = done[graph.order()[-1].id]["summary"]
    keys = ("eval.ne", "eval.auc", "registry.decision", "storage.ratio", "train.speedup")
    print(json.dumps({k: last[k] for k in keys if k in last}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
