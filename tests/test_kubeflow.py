"""The Kubeflow pipeline: the compiled YAML holds a container component per stage running
the components image, and the lightweight twin of the same graph runs end to end locally
(`kfp.local.SubprocessRunner(use_venv=False)`) on small data."""

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from recd_core.orchestration.graph import DAILY
from recd_core.orchestration.graph import STAGES as ALL_STAGES

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "dags" / "kubeflow"))
# the daily pipeline: every stage but the two-arm comparison, in order
STAGES = [s for s in ALL_STAGES if s != "compare"]


def _compiled(tmp_path, name):
    import recd_pipeline

    paths = recd_pipeline.compile_pipelines(tmp_path, image="reg.example/recd:9")
    path = next(p for p in paths if p.name == name)
    return yaml.safe_load_all(path.read_text())  # the pipeline, its Kubernetes spec


def test_the_compiled_pipeline_has_a_container_component_per_stage(tmp_path):
    import recd_pipeline

    spec, platform = _compiled(tmp_path, "recd_pipeline.yaml")
    executors = spec["deploymentSpec"]["executors"]
    containers = {e["container"]["command"][-1]: e["container"] for e in executors.values()}
    assert sorted(containers) == sorted(f"components.{s}" for s in STAGES)
    for module, c in containers.items():
        assert c["image"] == "reg.example/recd:9"
        assert c["command"][:2] == ["python", "-m"]
        assert (REPO / "components" / f"{module.split('.')[1]}.py").exists()
        assert "--output-metadata" in c["args"] and "{{$}}" in c["args"]  # typed outputs
    assert containers["components.train"]["resources"]["memoryLimit"] > 0
    # flat typed inputs, and only those its stage is given (no unused `u_*` on every step)
    comps = spec["components"]
    inputs = {n: c.get("inputDefinitions", {}).get("parameters", {}) for n, c in comps.items()}
    assert set(inputs["comp-recd-finish"]) >= {"u_train", "start"}
    shared = set(recd_pipeline.SHARED)
    # and the config overrides its stage takes (the common ones, ingest's own)
    overrides = set(recd_pipeline._overrides("ingest"))
    assert {"batch_size", "workers", "max_quarantine_fraction"} <= overrides
    assert not overrides & {"nproc", "epochs", "users"}
    assert set(inputs["comp-recd-ingest"]) == shared | {"days_of", "start"} | overrides
    assert inputs["comp-recd-ingest"]["synthesize"]["parameterType"] == "BOOLEAN"
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
    # a recurring run leaves `ds` empty: every step gets the job's scheduled time
    assert params["ds"]["defaultValue"] == ""
    for t in tasks.values():
        given = t["inputs"]["parameters"]["scheduled_time"]["runtimeValue"]["constant"]
        assert given == "{{$.pipeline_job_schedule_time_utc}}"
    deps = {t["taskInfo"]["name"]: set(t.get("dependentTasks", [])) for t in tasks.values()}
    assert deps["start"] == set()
    # the chain: each stage after the one before it (by name or through its inputs)
    by_key = {k: t["taskInfo"]["name"] for k, t in tasks.items()}
    named = {by_key[k]: {by_key[d] for d in t.get("dependentTasks", [])} for k, t in tasks.items()}
    for a, b in zip(STAGES, STAGES[1:], strict=False):
        assert a in named[b], (a, b)
    assert "ingest_eval" in named["generate_eval"] and "generate_eval" in named["evaluate"]


def test_training_across_machines_is_one_step_that_submits_a_trainjob(tmp_path):
    """`--train-nodes 2`: train is one step, the train component told to run as a Kubeflow
    Trainer TrainJob of 2 nodes of 4 processes on the pipeline's image, with the run's logs
    volume and S3 secret (its inputs); the TrainJob's pods get the accelerators, not it.
    The flags parse as the component parses them, into the TrainJob it would submit."""
    import recd_pipeline

    from components._entry import parser
    from recd_core.orchestration.trainjob import TrainJobConfig, flag_options, trainjob

    paths = recd_pipeline.compile_pipelines(
        tmp_path, "reg.example/recd:9", train_nodes=2, nproc_per_node=4
    )
    spec, platform = yaml.safe_load_all(paths[0].read_text())
    tasks = spec["root"]["dag"]["tasks"]
    by_name = {t["taskInfo"]["name"]: t for t in tasks.values()}
    assert "train" in by_name and not any("node" in n for n in by_name)
    train = by_name["train"]
    executors = spec["deploymentSpec"]["executors"]
    c = executors[spec["components"][train["componentRef"]["name"]]["executorLabel"]]["container"]
    assert c["command"] == ["python", "-m", "components.train"]
    assert "accelerator" not in c["resources"]
    args = [
        a.replace("{{$.inputs.parameters['logs_pvc']}}", "recd-logs").replace(
            "{{$.inputs.parameters['s3_secret']}}", "recd-s3"
        )
        for a in c["args"]
    ]
    ns = vars(parser("train").parse_args([re.sub(r"\{\{.*?\}\}", "x", a) for a in args]))
    cfg = TrainJobConfig.from_flags({n: ns[n] for n, *_ in flag_options()})
    assert (cfg.nodes, cfg.nproc_per_node, cfg.image) == (2, 4, "reg.example/recd:9")
    assert cfg.volume == ["recd-logs:/mnt/recd-logs"] and cfg.s3_secret == "recd-s3"
    body = trainjob("recd-train-x", ["--ds", "2026-11-01"], cfg).to_dict()
    assert body["spec"]["trainer"]["numNodes"] == 2
    params = train["inputs"]["parameters"]
    assert params["logs_pvc"]["componentInputParameter"] == "logs_pvc"
    assert params["s3_secret"]["componentInputParameter"] == "s3_secret"
    assert "recd-train" in by_name["evaluate"]["dependentTasks"]
    one = recd_pipeline.compile_pipelines(tmp_path / "one", "reg.example/recd:9")
    spec1, _ = yaml.safe_load_all(one[0].read_text())
    c1 = next(
        e["container"]
        for n, e in spec1["deploymentSpec"]["executors"].items()
        if e["container"]["command"][-1] == "components.train"
    )
    assert "--nodes" not in c1["args"] and "accelerator" in c1["resources"]


def test_the_pipelines_leave_typed_artifacts_a_kubeflow_run_shows(tmp_path):
    """Lineage and the Visualizations tab: partitions as Datasets, the model as a Model, the
    figures as Metrics, the comparison (and the run) as Markdown."""
    kinds = {}
    for name in ("recd_pipeline.yaml", "recd_comparison.yaml"):
        spec, _ = _compiled(tmp_path, name)
        for comp, c in spec["components"].items():
            arts = c.get("outputDefinitions", {}).get("artifacts", {})
            kinds[comp] = {a: v["artifactType"]["schemaTitle"] for a, v in arts.items()}
    assert kinds["comp-recd-ingest"] == {
        "events": "system.Dataset",
        "quarantine": "system.Dataset",
        "metrics": "system.Metrics",
    }
    assert kinds["comp-recd-generate"]["samples"] == "system.Dataset"
    assert kinds["comp-recd-preprocess"]["batches"] == "system.Dataset"
    assert kinds["comp-recd-train"] == {"model": "system.Model", "metrics": "system.Metrics"}
    assert kinds["comp-recd-evaluate"] == {"metrics": "system.Metrics"}
    assert kinds["comp-recd-compare"]["report"] == "system.Markdown"
    assert kinds["comp-recd-finish"]["report"] == "system.Markdown"
    spec, _ = _compiled(tmp_path, "recd_comparison.yaml")
    names = {t["taskInfo"]["name"] for t in spec["root"]["dag"]["tasks"].values()}
    assert {"train_dedup", "train_baseline", "compare"} <= names


@pytest.mark.slow
def test_the_lightweight_pipeline_runs_end_to_end_locally(tmp_path, monkeypatch):
    import recd_pipeline
    from kfp import local

    monkeypatch.chdir(tmp_path)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    task = recd_pipeline.lightweight_pipeline(
        warehouse=str(tmp_path / "wh"),
        ds="2026-11-01",
        logs=str(tmp_path / "logs"),
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        config=str(REPO / "tests/configs/small.yaml"),
    )
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


def test_the_pipeline_defaults_work_with_the_chart_as_documented(tmp_path):
    """`helm install recd ./helm/recd -n recd` (docs/operations.md): the pipeline's default
    tracking URI is the MLflow Service the chart renders, its pods carry the label the
    chart's MLflow NetworkPolicy admits; every input is described in the UI; every step has
    CPU and memory limits and a timeout; train may be placed on GPU nodes."""
    import os
    import shutil
    import subprocess
    import urllib.parse

    import recd_pipeline

    helm = os.environ.get("RECD_HELM") or shutil.which("helm") or str(REPO / "build/tools/helm")
    r = subprocess.run(
        [helm, "template", "recd", str(REPO / "helm" / "recd"), "-n", "recd"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    objects = [d for d in yaml.safe_load_all(r.stdout) if d]
    services = {
        (o["metadata"]["name"], p["port"])
        for o in objects
        if o["kind"] == "Service"
        for p in o["spec"]["ports"]
    }
    spec, platform = _compiled(tmp_path, "recd_pipeline.yaml")
    params = spec["root"]["inputDefinitions"]["parameters"]
    uri = urllib.parse.urlsplit(params["tracking_uri"]["defaultValue"])
    host, namespace = uri.hostname.split(".")[:2]
    assert (host, uri.port) in services and namespace == "recd", (uri, services)
    policy = next(
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-mlflow")
    )
    admitted = [f["podSelector"]["matchLabels"] for f in policy["spec"]["ingress"][0]["from"]]
    key, value = recd_pipeline.MLFLOW_CLIENT_LABEL
    assert {key: value} in admitted
    for name, p in params.items():  # the UI shows a description beside every input
        assert p.get("description"), name
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, e in k8s.items():
        assert e["podMetadata"]["labels"][key] == value, name
        assert int(e["activeDeadlineSeconds"]) > 0, name
    assert int(k8s["exec-recd-train"]["activeDeadlineSeconds"]) == 180 * 60
    assert "tolerations" in k8s["exec-recd-train"] and "nodeSelector" in k8s["exec-recd-train"]
    for e in spec["deploymentSpec"]["executors"].values():
        res = e["container"]["resources"]
        assert res["cpuLimit"] > 0 and res["memoryLimit"] > 0


def test_each_step_consumes_what_it_reads_so_the_run_lineage_is_connected(tmp_path):
    """A step takes the artifact of the step that wrote what it reads (the day's events,
    samples, batches, model): Kubeflow's lineage graph runs from the logs to the model."""
    spec, _ = _compiled(tmp_path, "recd_pipeline.yaml")
    edges = set()
    for tid, t in spec["root"]["dag"]["tasks"].items():
        for a in t.get("inputs", {}).get("artifacts", {}).values():
            src = a["taskOutputArtifact"]
            edges.add((src["producerTask"], src["outputArtifactKey"], tid))
    assert {
        ("recd-synth", "raw_logs", "recd-ingest"),
        ("recd-ingest", "events", "recd-generate"),
        ("recd-generate", "samples", "recd-preprocess"),
        ("recd-preprocess", "batches", "recd-train"),
        ("recd-train", "model", "recd-evaluate"),
        ("recd-train", "model", "recd-register"),
    } <= edges
    # the evaluation day's samples come from that day's generate, not the training day's
    evaluate = spec["root"]["dag"]["tasks"]["recd-evaluate"]["inputs"]["artifacts"]
    producer = evaluate["in_samples"]["taskOutputArtifact"]["producerTask"]
    assert spec["root"]["dag"]["tasks"][producer]["taskInfo"]["name"] == "generate_eval"
