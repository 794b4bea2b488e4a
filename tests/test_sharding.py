"""Model-parallel tables through TorchRec: sharded training on 2 processes (gloo) agrees
with one process, resumes after SIGKILL, refuses what it cannot place; interop with
TorchRec's KJTs."""

import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from test_train import DAY, SMALL_MODEL

from recd_core.config import FlexShardConfig, PreprocessConfig, TrainConfig
from recd_core.dedup.sparse import (
    InverseKeyedJaggedTensor,
    KeyedJaggedTensor,
    from_torchrec,
    to_torchrec,
)
from recd_core.dpp.preprocess import preprocess
from recd_core.errors import BadInput
from recd_core.modeling.saved import load_model, read_optimizer
from recd_core.modeling.sharded.plan import ShardingRefused
from recd_core.modeling.train import train

SHARDED = dict(
    batch_size=256,
    epochs=2,
    model=SMALL_MODEL,
    threads=1,
    cooccurrence_weight=0.0,
    checkpoint_every=5,
)


def _start(wh, mode: str = "dedup") -> str:
    """A common starting point: one step of a one-process run, saved as a model."""
    preprocess(wh, DAY, PreprocessConfig(batch_size=256, mode=mode))
    s = train(wh, DAY, TrainConfig(**SHARDED, max_steps=1, mode=mode))
    return s["train.model_uri"]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_sharded_two_processes_end_where_one_process_does(fresh_warehouse, sharding):
    start = _start(fresh_warehouse)
    cfg = TrainConfig(**SHARDED, seed=1)  # another run key than the start's
    one = train(fresh_warehouse, DAY, cfg, init_from=start)
    two = train(
        fresh_warehouse,
        DAY,
        cfg.model_copy(update={"sharding": sharding}),
        nproc=2,
        init_from=start,
    )
    assert two["train.world_size"] == 2 and two["train.steps"] == one["train.steps"]
    assert {v.split()[0] for v in two["train.sharding"].values()} == {sharding}
    assert two["train.val_ne"] == pytest.approx(one["train.val_ne"], rel=1e-4)
    # torchrec.metrics, each rank on its slice, agree with recd's own on the chosen state
    assert two["train.val_ne_torchrec"] == pytest.approx(two["train.val_ne"], rel=1e-4)
    assert two["train.val_auc_torchrec"] == pytest.approx(two["train.val_auc"], abs=1e-4)
    assert two["train.val_ne_calibrated"] == pytest.approx(one["train.val_ne_calibrated"], rel=1e-4)
    a, _ = load_model(one["train.model_uri"])
    b, _ = load_model(two["train.model_uri"])  # the usual model.pt + model.json
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    worst = max(_relative(sb[k].float(), sa[k].float()) for k in sa)
    assert worst < 1e-4
    oa, ob = read_optimizer(one["train.model_uri"]), read_optimizer(two["train.model_uri"])
    for i, state in oa["sparse"]["state"].items():  # the tables' accumulators, gathered
        assert _relative(ob["sparse"]["state"][i]["sum"], state["sum"]) < 1e-3


@pytest.mark.slow
def test_sharded_training_with_the_cooccurrence_loss_ends_near_one_process(fresh_warehouse):
    """The loss's negatives are drawn from each rank's slice instead of the whole batch:
    the same objective, other draws; the chosen state's validation NE stays close."""
    start = _start(fresh_warehouse)
    cfg = TrainConfig(**{**SHARDED, "cooccurrence_weight": 3.0}, seed=1)
    one = train(fresh_warehouse, DAY, cfg, init_from=start)
    two = train(
        fresh_warehouse,
        DAY,
        cfg.model_copy(update={"sharding": "row_wise"}),
        nproc=2,
        init_from=start,
    )
    assert two["train.val_ne"] == pytest.approx(one["train.val_ne"], rel=1e-3)


def test_from_torchrec_reads_back_what_to_torchrec_wrote():
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.tensor([1, 2, 3, 7, 8, 9]), torch.tensor([2, 0, 1, 1, 2, 0])
    )
    ik = InverseKeyedJaggedTensor.from_kjt(kjt)
    back = from_torchrec(to_torchrec(ik))
    assert isinstance(back, InverseKeyedJaggedTensor)
    assert back.unique.equals(ik.unique) and torch.equal(back.inverse_indices, ik.inverse_indices)
    assert back.to_kjt().equals(kjt)
    plain = from_torchrec(to_torchrec(kjt))
    assert isinstance(plain, KeyedJaggedTensor) and plain.equals(kjt)


def test_sharding_refuses_what_it_cannot_do_in_one_line(fresh_warehouse):
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256))
    for update, nproc, reason in [
        ({}, 1, r"needs 2 or more processes \(train.nproc, --nproc\)"),
        ({"model": SMALL_MODEL.model_copy(update={"members": 3})}, 2, "members: 1"),
        ({"average_states": 4}, 2, "average_states: 1"),
        (
            {"sharding": "flexshard", "flexshard": {"per_node": 3}},
            2,
            "per_node=3 does not divide the 2 processes",
        ),
    ]:
        cfg = TrainConfig(**{**SHARDED, "sharding": "auto", **update})
        with pytest.raises(ShardingRefused, match=reason):
            train(fresh_warehouse, DAY, cfg, nproc=nproc)


@pytest.mark.slow
def test_a_budget_no_placement_fits_is_refused_and_one_that_fits_is_kept(fresh_warehouse):
    """The synthetic tables at 16 dims: ~37 MB in all, the items table ~13 MB. The budget
    holds the run's three copies of a rank's shards (live, best state, restart point)."""
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256))
    cfg = TrainConfig(**SHARDED, max_steps=2, sharding="auto", memory_budget_mb=30)
    with pytest.raises(
        Exception,
        match=r"no placement of the tables .* fits 30 MB each, 3 "
        r"copies of its shards \(the live tables, early stopping's best state",
    ):
        train(fresh_warehouse, DAY, cfg, nproc=2)
    with pytest.raises(
        Exception, match=r"train.sharding=flexshard: \d+ MB of rows a process .* exceed 30 MB"
    ):
        train(fresh_warehouse, DAY, cfg.model_copy(update={"sharding": "flexshard"}), nproc=2)
    s = train(fresh_warehouse, DAY, cfg.model_copy(update={"memory_budget_mb": 60}), nproc=2)
    ranks = {r for where in s["train.sharding"].values() for r in where.split()[-1].split(",")}
    assert ranks == {"0", "1"}  # both ranks hold tables
    assert s["train.shard_bytes_per_rank"] and max(s["train.shard_bytes_per_rank"]) < 20 << 20
    # without the passes' restarts, two copies: 45 MB holds them
    s = train(
        fresh_warehouse,
        DAY,
        cfg.model_copy(update={"restart_tables": False, "memory_budget_mb": 45}),
        nproc=2,
    )
    assert max(s["train.shard_bytes_per_rank"]) < 45 << 19


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["row_wise", "flexshard"])
def test_sigkill_of_a_sharded_run_then_resume_matches_an_uninterrupted_run(
    fresh_warehouse, samples_warehouse, tmp_path, sharding
):
    """Killed after a checkpoint, resumed on 2 and 3 processes: the uninterrupted run's
    model. FlexShard runs with BagPipe's cache (its copies are not in the checkpoint: the
    resumed run fetches from the owners what the killed one held)."""
    import shutil

    from recd_core.warehouse import Warehouse

    other = Warehouse(shutil.copytree(samples_warehouse, tmp_path / "other"))
    cfg = TrainConfig(**{**SHARDED, "checkpoint_every": 4}, max_steps=20, sharding=sharding)
    if sharding == "flexshard":
        cfg = cfg.model_copy(update={"flexshard": FlexShardConfig(cache_lookahead=4)})
    for wh in (fresh_warehouse, other):
        preprocess(wh, DAY, PreprocessConfig(batch_size=256))
    # rank 1 kills the whole run (every process, kill -9) right after its step-12 save: the
    # ranks are spawned, so the hook goes in through a sitecustomize every one imports
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
        import os, signal
        import torch.distributed as dist
        from recd_core.modeling.sharded.checkpoints import ShardedCheckpoints
        real = ShardedCheckpoints.save
        def save_then_die(self, state):
            path = real(self, state)
            if state["step"] == 12 and dist.get_rank() == 1:
                os.killpg(0, signal.SIGKILL)
            return path
        ShardedCheckpoints.save = save_then_die
        """
        )
    )
    script = textwrap.dedent(
        f"""
        from recd_core.config import TrainConfig
        from recd_core.modeling.train import train
        from recd_core.warehouse import Warehouse
        cfg = TrainConfig.model_validate_json({cfg.model_dump_json()!r})
        train(Warehouse({str(fresh_warehouse.uri)!r}), {DAY!r}, cfg, nproc=2)
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", script], start_new_session=True, env=env)
    assert r.returncode == -9, "the run was killed"
    from pathlib import Path

    assert sorted(p.name for p in Path(fresh_warehouse.root, "checkpoints").glob("*/step-*")) == [
        "step-00000008",
        "step-00000012",
    ]
    # the same checkpoint resumed by three processes: its shard files are cut again
    three = Warehouse(shutil.copytree(Path(fresh_warehouse.root), tmp_path / "three"))
    resumed = train(fresh_warehouse, DAY, cfg, nproc=2)
    assert resumed["train.resumed_from_step"] == 12 and resumed["train.steps"] == 20
    straight = train(other, DAY, cfg, nproc=2)
    a, b = load_model(resumed["train.model_uri"])[0], load_model(straight["train.model_uri"])[0]
    for name, w in a.state_dict().items():
        assert torch.equal(w, b.state_dict()[name]), name
    # a damaged shard file: one line naming the checkpoint and what to do
    broken = Warehouse(shutil.copytree(Path(three.root), tmp_path / "broken"))
    shard = sorted(Path(broken.root, "checkpoints").glob("*/step-00000012/tables/*.f32"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(BadInput, match=r"step-00000012 is corrupt .* delete it to resume"):
        train(broken, DAY, cfg, nproc=2)
    by_three = train(three, DAY, cfg, nproc=3)
    assert by_three["train.resumed_from_step"] == 12 and by_three["train.world_size"] == 3
    c = load_model(by_three["train.model_uri"])[0].state_dict()
    assert max(_relative(c[k].float(), w.float()) for k, w in b.state_dict().items()) < 1e-4


@pytest.mark.slow
def test_recd_train_refuses_a_budget_too_small_in_one_line_with_exit_2(fresh_warehouse, tmp_path):
    from pathlib import Path

    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256))
    cfg = tmp_path / "train.yaml"
    cfg.write_text(TrainConfig(**SHARDED).model_dump_json())  # JSON is YAML
    exe = Path(sys.executable).parent / "recd"
    r = subprocess.run(
        [
            exe,
            "train",
            "--warehouse",
            fresh_warehouse.uri,
            "--ds",
            DAY,
            "--train-config",
            cfg,
            "--nproc",
            "2",
            "--sharding",
            "auto",
            "--memory-budget-mb",
            "8",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "no placement of the tables (14 tables, 37 MB" in r.stderr and "8 MB each" in r.stderr


@pytest.mark.slow
def test_a_warm_start_whose_weights_do_not_fit_trains_sharded_from_scratch(fresh_warehouse):
    from pathlib import Path

    start = _start(fresh_warehouse)
    weights = torch.load(Path(start, "model.pt"), weights_only=True)
    weights["bags.t_items.weight"] = weights["bags.t_items.weight"][:10]  # another table size
    torch.save(weights, Path(start, "model.pt"))  # as another model code saved it: its checksum
    meta = json.loads(Path(start, "model.json").read_text())
    meta["checksums"]["model.pt"] = zlib.crc32(Path(start, "model.pt").read_bytes())
    Path(start, "model.json").write_text(json.dumps(meta))
    cfg = TrainConfig(**SHARDED, max_steps=2, sharding="row_wise", seed=1)
    s = train(fresh_warehouse, DAY, cfg, nproc=2, init_from=start)
    assert s["train.init_from"] == "" and "weights do not fit this model" in s["train.init_reason"]
    assert s["train.steps"] == 2


def _vbe_rank(rank: int, world: int, port: str, out: str) -> None:
    """One rank of the VBE probe below: the same group sent as a variable-batch KJT and as
    recd sends it (unique rows, then empty ones), with the all-to-alls' bytes counted."""
    import json

    import torch.distributed as dist
    from torch import nn

    from recd_core.bench.sharded import counted_all_to_all
    from recd_core.dpp.batch_store import Batch
    from recd_core.modeling.sharded.plan import shard
    from recd_core.modeling.sharded.tables import ShardedTables
    from recd_core.modeling.tables import TableSpec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    specs = [
        TableSpec("t_u", 50, ("u",), "bags.t_u.weight", 0.05),
        TableSpec("t_h", 100, ("h",), "bags.t_h.weight", 0.05),
    ]

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.sharded = ShardedTables(specs, 8)

    net = shard(Holder(), TrainConfig(sharding="row_wise"), world, torch.device("cpu"))
    unique = KeyedJaggedTensor(
        ["u", "h"], torch.tensor([3, 40, 7, 8, 90]), torch.tensor([1, 1, 2, 1])
    )  # 2 unique rows
    group = InverseKeyedJaggedTensor(unique, torch.tensor([0, 0, 0, 1, 1, 1]))
    batch = Batch(torch.zeros(6, 0), None, torch.zeros(6), {"user": group})
    with counted_all_to_all() as padded_bytes:
        padded = net.module.sharded(batch)
    with counted_all_to_all() as vbe_bytes:
        vbe = net.module.sharded.ec(to_torchrec(group))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "padded_rows": {k: v.shape[0] for k, v in padded.items()},
                    "vbe_rows": {k: v.values().shape[0] for k, v in vbe.items()},
                    "padded_bytes": dict(padded_bytes),
                    "vbe_bytes": dict(vbe_bytes),
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_variable_batch_kjt_comes_back_per_sample_and_padded_unique_rows_do_not(tmp_path):
    """Why the sharded tables take a group's unique rows padded with empty ones: TorchRec's
    EmbeddingCollection expands a variable-batch KJT's output to every sample, while the
    same ids as padded rows come back once; the all-to-alls carry the same vectors."""
    import json

    import torch.multiprocessing as mp

    from recd_core.modeling.launch import free_port

    out = tmp_path / "probe.json"
    mp.start_processes(
        _vbe_rank, args=(2, str(free_port()), str(out)), nprocs=2, start_method="spawn"
    )
    probe = json.loads(out.read_text())
    assert probe["padded_rows"] == {"u": 2, "h": 3}  # the unique rows' ids
    assert probe["vbe_rows"] == {"u": 6, "h": 9}  # every sample's
    # the same vectors each way; the padding adds a zero length (int64) a padding row and key
    assert probe["padded_bytes"]["float32"] == probe["vbe_bytes"]["float32"]
    assert probe["padded_bytes"]["int64"] - probe["vbe_bytes"]["int64"] == 8 * (6 - 2) * 2
