"""The Kubeflow pipeline: the compiled YAML holds a container component per stage running
the components image, and the lightweight twin of the same graph runs end to end locally
(`kfp.local.SubprocessRunner(use_venv=False)`) on small data."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from recd_core.orchestration.graph import DAILY
from recd_core.orchestration.stages import STAGES as ALL_STAGES

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "dags" / "kubeflow"))
# the daily pipeline: every stage but the two-arm comparison, in order
STAGES = [s for s in ALL_STAGES if s != "compare"]


def test_the_compiled_pipeline_has_a_container_component_per_stage(tmp_path):
    import recd_pipeline

    out = recd_pipeline.compile_pipeline(
        tmp_path / "recd_pipeline.yaml", image="reg.example/recd:9"
    )
    spec, platform = yaml.safe_load_all(out.read_text())  # the pipeline, its Kubernetes spec
    executors = spec["deploymentSpec"]["executors"]
    containers = {e["container"]["command"][-1]: e["container"] for e in executors.values()}
    assert sorted(containers) == sorted(f"components.{s}" for s in STAGES)
    for module, c in containers.items():
        assert c["image"] == "reg.example/recd:9"
        assert c["command"][:2] == ["python", "-m"]
        assert (REPO / "components" / f"{module.split('.')[1]}.py").exists()
        assert "--output-metadata" in c["args"]
    assert containers["components.train"]["resources"]["memoryLimit"] > 0
    # a component has only the inputs its stage is given (no unused `u_*` on every step)
    comps = spec["components"]
    inputs = {n: set(c.get("inputDefinitions", {}).get("parameters", {})) for n, c in comps.items()}
    assert inputs["comp-recd-finish"] >= {"u_train", "start"}
    assert inputs["comp-recd-ingest"] == {"args", "start"}
    assert not any(
        i.startswith("u_") for n, c in inputs.items() if n != "comp-recd-finish" for i in c
    )
    for module, c in containers.items():  # every step asks for CPU and memory
        assert c["resources"]["cpuRequest"] > 0 and c["resources"]["memoryRequest"] > 0, module
    gpu = containers["components.train"]["resources"]["accelerator"]
    assert set(gpu) >= {"resourceCount", "resourceType"}  # pipeline parameters (0: CPUs)
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["train_accelerators"]["defaultValue"] == 0
    # every pod mounts the logs volume and may read the object store's keys (kfp-kubernetes)
    executors_k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert len(executors_k8s) == len(executors)
    for e in executors_k8s.values():
        assert e["pvcMount"][0]["mountPath"] == recd_pipeline.LOGS_MOUNT
        assert {v["envVar"] for v in e["secretAsEnv"][0]["keyToEnv"]} == set(recd_pipeline.S3_KEYS)
    tasks = spec["root"]["dag"]["tasks"]
    assert len(tasks) == len(DAILY.tasks)  # a task per graph task (ingest_eval: ingest again)
    # never served from cache: the warehouse and MLflow are state the inputs do not name
    assert all(not t.get("cachingOptions", {}).get("enableCache") for t in tasks.values())
    assert all(t["retryPolicy"]["maxRetryCount"] == recd_pipeline.RETRIES for t in tasks.values())
    deps = {t["taskInfo"]["name"]: set(t.get("dependentTasks", [])) for t in tasks.values()}
    assert deps["start"] == set()
    # the chain: each stage after the one before it (by name or through its inputs)
    by_key = {k: t["taskInfo"]["name"] for k, t in tasks.items()}
    named = {by_key[k]: {by_key[d] for d in t.get("dependentTasks", [])} for k, t in tasks.items()}
    for a, b in zip(STAGES, STAGES[1:], strict=False):
        assert a in named[b], (a, b)
    assert "ingest_eval" in named["generate_eval"] and "generate_eval" in named["evaluate"]


@pytest.mark.slow
def test_the_lightweight_pipeline_runs_end_to_end_locally(tmp_path, monkeypatch):
    import recd_pipeline
    from kfp import local

    monkeypatch.chdir(tmp_path)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    task = recd_pipeline.lightweight_pipeline(
        warehouse=str(tmp_path / "wh"), ds="2026-11-01", logs=str(tmp_path / "logs"),
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", config=str(REPO / "tests/configs/small.yaml"),
    )  # fmt: skip
    assert task is not None
    outputs = [
        json.loads(json.loads(f.read_text())["parameterValues"]["Output"])
        for f in (tmp_path / "root").glob("*/*/executor_output.json")
    ]
    assert len(outputs) == len(DAILY.tasks)  # every task ran and returned its summary
    summary = next(o for o in outputs if "pipeline.ds" in o)  # finish's merged summary
    assert summary["status"] == "ok" and summary["registry.decision"] == "promoted"
    assert summary["eval.ne"] > 0 and summary["storage.ratio"] > 1
    assert (tmp_path / "wh/batches/mode=dedup/ds=2026-11-01/_manifest.json").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_model_version_by_alias("recd-dlrm", "champion") is not None
