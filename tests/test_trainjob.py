"""Training across machines on Kubeflow Trainer (orchestration/trainjob.py): the TrainJob
recd submits is the Trainer's own API model, exactly; its nodes, started as the Trainer
starts them (the TrainJob's command and arguments, torchrun's settings as the PET_*
variables the Trainer's torch policy sets), from a directory that is not the checkout's,
train as one run of two processes and end where two spawned processes end, rank 0 writing
the model and the summary the submitting step reads; the step's exit is rank 0's, or a
retryable failure when rank 0 left none. Each attempt is a TrainJob of its own."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_sharding import SHARDED
from test_train import DAY

from recd_core.config import PreprocessConfig, TrainConfig
from recd_core.dpp.preprocess import preprocess
from recd_core.errors import BadInput
from recd_core.modeling.launch import free_port
from recd_core.modeling.saved import load_model
from recd_core.modeling.train import train
from recd_core.orchestration.trainjob import (
    TrainJobConfig,
    TrainJobFailed,
    job_name,
    outcome,
    summary_uri,
    trainjob,
)
from recd_core.report import read_summary
from recd_core.warehouse import Warehouse

BIN = Path(sys.executable).parent
FULL = TrainJobConfig(
    nodes=2,
    nproc_per_node=4,
    image="reg.example/recd:1",
    node_cpu="2",
    node_memory="8Gi",
    volume=["recd-logs:/mnt/recd-logs"],
    s3_secret="recd-s3",
)


def test_the_trainjob_is_the_trainers_own_api_model_exactly():
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    body = trainjob("recd-train-2026-11-01-dedup-0a1b2c3d", ["--ds", DAY], FULL).to_dict()
    assert TrainerV1alpha1TrainJob.from_dict(body).to_dict() == body  # nothing unknown, dropped
    trainer = body["spec"]["trainer"]
    assert trainer["command"] == ["torchrun", "-m", "components.train"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["resourcesPerNode"]["limits"] == {"cpu": "2", "memory": "8Gi"}
    assert body["spec"]["runtimeRef"] == {"name": "recd-torch", "kind": "TrainingRuntime"}
    pod = body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"
    ][0]["template"]["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "recd-0", "persistentVolumeClaim": {"claimName": "recd-logs"}}
    ]
    node = pod["containers"][0]
    assert node["name"] == "node" and node["volumeMounts"][0]["mountPath"] == "/mnt/recd-logs"
    assert {e["name"] for e in node["env"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    # a name of its own each attempt: a reused name is refused by the API, never joined
    assert job_name(DAY, "dedup") != job_name(DAY, "dedup")
    assert len(job_name(DAY, "baseline")) <= 63
    assert summary_uri("s3://b/wh?endpoint_override=minio:9000", "n") == (
        "s3://b/wh/_trainjobs/n.json?endpoint_override=minio:9000"
    )
    with pytest.raises(BadInput, match="CLAIM:/mount/path"):
        trainjob("x", [], TrainJobConfig(nodes=2, image="i", volume=["no-path"]))
    with pytest.raises(BadInput, match="--nodes 0"):
        TrainJobConfig.from_flags({"nodes": 0})


@pytest.mark.slow
def test_a_trainjobs_nodes_as_the_trainer_starts_them_train_as_two_spawned_processes(
    fresh_warehouse, tmp_path
):
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256))
    apart = Warehouse(shutil.copytree(fresh_warehouse.root, tmp_path / "nodes-wh"))
    cfg = TrainConfig(
        **{**SHARDED, "epochs": 1}, max_steps=8, sharding="row_wise", saved_layout="shards"
    )
    spawned = train(fresh_warehouse, DAY, cfg, nproc=2)
    (tmp_path / "train.yaml").write_text(cfg.model_dump_json())  # JSON is YAML
    name = job_name(DAY, "dedup")
    out = summary_uri(apart.uri, name)
    argv = [
        "--warehouse",
        apart.uri,
        "--ds",
        DAY,
        "--train-config",
        str(tmp_path / "train.yaml"),
        "--output-metadata",
        out,
    ]
    spec = trainjob(name, argv, TrainJobConfig(nodes=2, image="recd")).to_dict()["spec"]
    port = free_port()
    elsewhere = tmp_path / "elsewhere"  # not the checkout: the installed components
    elsewhere.mkdir()

    def node(rank: int) -> subprocess.Popen:  # the Trainer's torch policy's environment
        pet = {
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port),
        }
        command = [str(BIN / spec["trainer"]["command"][0]), *spec["trainer"]["command"][1:]]
        return subprocess.Popen(
            [*command, *spec["trainer"]["args"]],
            cwd=elsewhere,
            env={**os.environ, **pet},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    nodes = [node(0), node(1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)[-3000:]
    assert "recd train: rank 1 of 2 done" in logs[1]
    two = outcome(f"recd/{name}", out, None)  # what the submitting step returns
    assert two["train.trainjob"] == f"recd/{name}"
    assert two["train.world_size"] == 2 and two["train.steps"] == spawned["train.steps"] == 8
    assert two["train.loss"] == pytest.approx(spawned["train.loss"], rel=1e-6)
    assert two["train.val_ne"] == pytest.approx(spawned["train.val_ne"], rel=1e-6)
    assert two["train.saved_layout"] == "shards"
    assert load_model(two["train.model_uri"])[0] is not None


def test_the_steps_exit_is_rank_0s_or_retryable_without_it(fresh_warehouse, tmp_path):
    """A node's bad input (no batches for the day: rank 0 writes its failure) ends the step
    as rank 0 ended, exit 2, final; a TrainJob that failed with no word from rank 0 (a node
    lost past the restarts) is exit 1, retryable; completed without a summary, likewise."""
    name = job_name(DAY, "dedup")
    out = summary_uri(fresh_warehouse.uri, name)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "components.train",
            "--warehouse",
            fresh_warehouse.uri,
            "--ds",
            DAY,
            "--output-metadata",
            out,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and read_summary(out)["status"] == "failed", r.stderr[-2000:]
    with pytest.raises(BadInput) as e:
        outcome(f"recd/{name}", out, "RuntimeError: TrainJob recd/x is Failed")
    assert "batches" in str(e.value) and e.value.exit_code == 2
    missing = summary_uri(fresh_warehouse.uri, job_name(DAY, "dedup"))
    with pytest.raises(TrainJobFailed) as e:
        outcome("recd/y", missing, "RuntimeError: TrainJob recd/y is Failed")
    assert e.value.exit_code == 1 and e.value.retryable and "without a result" in str(e.value)
    with pytest.raises(TrainJobFailed, match="wrote no summary"):
        outcome("recd/z", missing, None)


def test_only_train_runs_across_machines_and_bad_options_are_one_line(tmp_path):
    for args, words in (
        (["components.ingest", "--nodes", "2"], "only the train stage"),
        (["components.train", "--nodes", "2"], "needs the components image"),
        (
            ["components.train", "--nodes", "2", "--image", "i", "--volume", "x"],
            "CLAIM:/mount/path",
        ),
    ):
        r = subprocess.run(
            [sys.executable, "-m", *args, "--warehouse", str(tmp_path / "wh"), "--ds", DAY],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 2 and words in r.stderr, r.stderr[-1500:]
        assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
