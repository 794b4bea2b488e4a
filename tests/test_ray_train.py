"""Training on a real two-node Ray cluster (`train.engine: ray`): a head and a worker node,
separate raylets of one CPU each, started on this machine (traffic on loopback). Ray Train's
workers run recd's own training as the ranks of one run: the model ends where the same run
on this machine's processes ends (sharded through TorchRec, row-wise), and a worker killed
mid-run is restarted by Ray and resumes from recd's checkpoint, ending where an
uninterrupted run ends."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from test_train import DAY, SMALL_MODEL

from recd_core.config import PreprocessConfig, TrainConfig
from recd_core.dpp.preprocess import preprocess
from recd_core.modeling.train import train
from recd_core.warehouse import Warehouse

BASE = dict(
    batch_size=256,
    model=SMALL_MODEL,
    threads=1,
    cooccurrence_weight=0.0,
    checkpoint_every=5,
    nproc=2,
)


@pytest.fixture(scope="module")
def cluster():
    """A head node and a worker node, one CPU each, this process connected as the driver.
    Ray advertises the machine's interface address unless told it has no cluster network
    (`ENABLE_RAY_CLUSTER`, read by the nodes from the environment and here from the
    constant): everything then binds and dials loopback."""
    import ray
    import ray._private.ray_constants as constants
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    was, constants.ENABLE_RAY_CLUSTER = constants.ENABLE_RAY_CLUSTER, False
    nodes = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address)
    try:
        assert len(ray.nodes()) == 2 and {n["NodeManagerAddress"] for n in ray.nodes()} == {
            "127.0.0.1"
        }
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        constants.ENABLE_RAY_CLUSTER = was
        if saved is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved


@pytest.fixture(scope="module")
def batches(samples_warehouse, tmp_path_factory) -> Path:
    """A warehouse with DAY preprocessed (copied by each run: a run's checkpoints are its
    own, whatever engine runs it)."""
    root = tmp_path_factory.mktemp("ray") / "wh"
    shutil.copytree(samples_warehouse, root)
    preprocess(Warehouse(root), DAY, PreprocessConfig(batch_size=256))
    return root


def _copy(batches: Path, tmp_path: Path, name: str) -> Warehouse:
    shutil.copytree(batches, tmp_path / name)
    return Warehouse(tmp_path / name)


def _weights(summary: dict) -> dict:
    return torch.load(Path(summary["train.model_uri"], "model.pt"), weights_only=True)


def _worst_relative(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)) for k in b)


def _train_workers() -> dict[int, int]:
    """The live Ray Train workers of this machine: pid -> parent pid (its node's raylet)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if title.startswith(b"ray::RayTrainWorker"):
                found[int(entry.name)] = int(stat[1])
    return found


def test_ray_workers_on_two_nodes_end_where_local_processes_end(cluster, batches, tmp_path):
    cfg = dict(BASE, epochs=2, sharding="row_wise")
    local = train(_copy(batches, tmp_path, "local"), DAY, TrainConfig(**cfg))
    seen: list[dict[int, int]] = []
    watch = threading.Event()

    def watcher():  # where the workers run while they train
        while not watch.is_set():
            if len(found := _train_workers()) == 2:
                seen.append(found)
            time.sleep(0.2)

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    try:
        on_ray = train(_copy(batches, tmp_path, "ray"), DAY, TrainConfig(**cfg, engine="ray"))
    finally:
        watch.set()
        thread.join()
    assert on_ray["train.engine"] == "ray" and on_ray["train.world_size"] == 2
    assert on_ray["train.steps"] == local["train.steps"]
    assert seen and len(set(seen[-1].values())) == 2, "one worker on each node's raylet"
    assert _worst_relative(_weights(on_ray), _weights(local)) <= 1e-6


def test_a_worker_killed_mid_run_is_restarted_and_resumes_from_the_checkpoint(
    cluster, batches, tmp_path
):
    cfg = dict(BASE, epochs=8)
    uninterrupted = train(_copy(batches, tmp_path, "local"), DAY, TrainConfig(**cfg))
    wh = _copy(batches, tmp_path, "ray")
    out: dict = {}
    runner = threading.Thread(
        target=lambda: out.update(train(wh, DAY, TrainConfig(**cfg, engine="ray"))), daemon=True
    )
    runner.start()
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and runner.is_alive() and time.monotonic() < deadline:
        steps = list(Path(wh.root, "checkpoints").glob("*/step-*.pt"))
        workers = _train_workers()
        if steps and len(workers) == 2:
            killed = max(workers)  # one of the two: whichever rank it is
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    runner.join(600)
    assert killed is not None, "the run ended before a checkpoint was written"
    assert out["train.resumed_from_step"] > 0, "the restarted workers resumed"
    assert out["train.steps"] == uninterrupted["train.steps"]
    assert _worst_relative(_weights(out), _weights(uninterrupted)) <= 1e-6
