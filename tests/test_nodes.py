"""Training across machines: two "nodes" (process groups started by their own `torchrun`,
as the DAG's pods start them) joined through node 0's rendezvous train as one run of two
processes, ending where two spawned processes end: rank 0 writes the model, its summary and
its record; the other rank reports itself done."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_sharding import SHARDED
from test_train import DAY

from recd_core.config import PreprocessConfig, TrainConfig
from recd_core.dpp.preprocess import preprocess
from recd_core.modeling.launch import free_port
from recd_core.modeling.saved import load_model
from recd_core.modeling.train import train
from recd_core.orchestration.nodes import torchrun_command
from recd_core.warehouse import Warehouse

BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_two_nodes_joined_by_one_rendezvous_train_as_two_spawned_processes(fresh_warehouse,
                                                                           tmp_path):  # fmt: skip
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256))
    apart = Warehouse(shutil.copytree(fresh_warehouse.root, tmp_path / "nodes-wh"))
    cfg = TrainConfig(**{**SHARDED, "epochs": 1}, max_steps=8, sharding="row_wise",
                      saved_layout="shards")  # fmt: skip
    spawned = train(fresh_warehouse, DAY, cfg, nproc=2)
    (tmp_path / "train.yaml").write_text(cfg.model_dump_json())  # JSON is YAML
    port = free_port()

    def node(n: int) -> subprocess.Popen:  # as the DAG's pods start it (orchestration/nodes.py)
        torchrun, *flags = torchrun_command(2, 1, n, "127.0.0.1", port)
        return subprocess.Popen(
            [BIN / torchrun, *flags, "--no-python", BIN / "recd", "train", "--warehouse",
             apart.uri, "--ds", DAY, "--train-config", tmp_path / "train.yaml", "--summary",
             tmp_path / f"node{n}.json"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    nodes = [node(0), node(1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)[-3000:]
    # one summary: rank 0's, on node 0; node 1 reports itself done
    assert not (tmp_path / "node1.json").exists()
    two = json.loads((tmp_path / "node0.json").read_text())
    assert "recd train: rank 1 of 2 done" in logs[1]
    (tmp_path / "launch.log").write_text("\n".join(logs))
    assert two["train.world_size"] == 2 and two["train.steps"] == spawned["train.steps"] == 8
    assert two["train.loss"] == pytest.approx(spawned["train.loss"], rel=1e-6)
    assert two["train.val_ne"] == pytest.approx(spawned["train.val_ne"], rel=1e-6)
    assert two["train.saved_layout"] == "shards"
    assert load_model(two["train.model_uri"])[0] is not None


@pytest.mark.slow
def test_nodes_without_stable_names_find_node_0_through_the_warehouse(fresh_warehouse, tmp_path):
    """Kubeflow's steps (pods with no stable names): each node is the train component with
    `--nodes 2 --node-rank k`; node 0 publishes its address in the warehouse, node 1 (started
    first here) waits for it; node 0's output is the stage's summary."""
    import yaml
    from test_train import SMALL_MODEL

    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256))
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump({"features": "synthetic", "train": {
        **{k: v for k, v in SHARDED.items() if k != "model"}, "model": SMALL_MODEL.model_dump(),
        "max_steps": 4, "sharding": "row_wise", "saved_layout": "shards"}}))  # fmt: skip
    repo = Path(__file__).resolve().parents[1]

    def node(k: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "components.train", "--warehouse", fresh_warehouse.uri,
             "--ds", DAY, "--config", config, "--nodes", "2", "--node-rank", str(k),
             "--rendezvous", "run-1", "--output-metadata", tmp_path / f"node{k}.json"],
            cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    nodes = [node(1), node(0)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)[-3000:]
    summary = json.loads((tmp_path / "node0.json").read_text())
    assert summary["train.world_size"] == 2 and summary["train.steps"] == 4
    assert summary["train.saved_layout"] == "shards"
    assert json.loads((tmp_path / "node1.json").read_text()) == {"status": "ok", "stage": "train",
                                                                  "rank": 1}  # fmt: skip
    assert not list(Path(fresh_warehouse.root, "_rendezvous").glob("*.json"))  # removed


SMALL_CONFIG = Path(__file__).parent / "configs/small.yaml"


@pytest.mark.slow
def test_a_pipeline_across_two_nodes_trains_once_on_both_and_survives_node_0s_retry(tmp_path):
    """`recd run --nodes 2` as the chart's Indexed Job runs it: the same command on both
    pods but the node rank. Node 0's first attempt fails in train (a budget no placement
    fits): it exits 2 with the one line, node 1 stays to follow its retry, which trains on
    both nodes (world size 2), and both end 0."""
    run = [BIN / "recd", "run", "--warehouse", tmp_path / "wh", "--logs", tmp_path / "logs",
           "--ds", DAY, "--config", SMALL_CONFIG, "--max-steps", "3", "--nodes", "2",
           "--nproc-per-node", "1", "--rendezvous", "recd-daily-29001"]  # fmt: skip

    def node(k: int, *extra) -> subprocess.Popen:
        return subprocess.Popen([*run, "--node-rank", str(k), "--summary",
                                 tmp_path / f"node{k}.json", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip

    follower = node(1)
    failed = node(0, "--sharding", "row_wise", "--memory-budget-mb", "1")
    log0 = failed.communicate(timeout=600)[0]
    assert failed.returncode == 2, log0[-3000:]
    reason = [line for line in log0.splitlines() if line.startswith("recd run: error:")]
    assert len(reason) == 1 and "train: train.sharding=row_wise: no placement" in reason[0], log0
    assert follower.poll() is None, "node 1 follows node 0's retry"
    retry = node(0)
    logs = [retry.communicate(timeout=600)[0], follower.communicate(timeout=600)[0]]
    (tmp_path / "launch.log").write_text("\n".join([log0, *logs]))
    assert [retry.returncode, follower.returncode] == [0, 0], "\n".join(logs)[-3000:]
    summary = json.loads((tmp_path / "node0.json").read_text())
    assert summary["train.world_size"] == 2 and summary["train.steps"] == 3
    assert json.loads((tmp_path / "node1.json").read_text())["runs_joined"] == 1
    assert "recd train: rank 1 of 2 done" in logs[1] and "failed here (exit" in logs[1]
    channel = tmp_path / "wh" / "_rendezvous" / "recd-daily-29001"
    assert sorted(p.name for p in channel.iterdir()) == ["done.json"]


@pytest.mark.parametrize(
    ("place", "message"),
    [((2, 0, 1, ""), "--nodes 2 needs --rendezvous"),
     ((2, 2, 1, "job"), "--node-rank 2 is not a node of --nodes 2 (0 to 1)"),
     ((2, 1, 0, "job"), "--nproc-per-node 0: both must be at least 1")],
)  # fmt: skip
def test_a_place_in_a_run_across_machines_that_cannot_be_is_refused_in_one_line(place, message):
    from recd_core.errors import BadInput
    from recd_core.orchestration.nodes import NodeGroup

    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        NodeGroup(*place)


def test_a_node_that_joined_a_dead_node_0_goes_to_its_retry_then_ends_with_the_pipeline(tmp_path):
    """A node that joined a run whose node 0 is gone (its address answers nothing) does not
    wait out torchrun's rendezvous timeout: it leaves for the run node 0's retry announces,
    and ends when node 0 says its pipeline is done."""
    import threading
    import time

    from recd_core.orchestration.nodes import NodeGroup, follow

    wh = Warehouse(str(tmp_path / "wh"))
    where = tmp_path / "wh" / "_rendezvous" / "recd-daily-1"
    where.mkdir(parents=True)

    def announce(run_id: str) -> None:
        run = {"id": run_id, "addr": "127.0.0.1", "port": free_port(), "nodes": 2,
               "per_node": 1, "stage": "train", "argv": ["-m", "components.train"]}  # fmt: skip
        (where / "run.json.tmp").write_text(json.dumps(run))
        (where / "run.json.tmp").rename(where / "run.json")

    said: list[str] = []
    result: dict = {}

    def node1():
        result.update(follow(wh, NodeGroup(2, 1, 1, "recd-daily-1"), wait_s=60, poll_s=0.2,
                             say=said.append))  # fmt: skip

    def seen(text: str) -> None:
        deadline = time.monotonic() + 60
        while not any(text in line for line in said):
            assert time.monotonic() < deadline, said
            time.sleep(0.1)

    announce("dead-1")
    thread = threading.Thread(target=node1)
    thread.start()
    seen("joining train run dead-1")
    announce("retry-1")
    seen("joining train run retry-1")
    (where / "done.json").write_text("{}")
    thread.join(60)
    assert not thread.is_alive()
    assert result == {"node": 1, "runs_joined": 0, "runs_failed": 2}
    assert any("dead-1 failed here" in line and "newer run" in line for line in said), said
