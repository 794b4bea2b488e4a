"""Training on FlexShard's placement (modeling/sharded/flexshard_tables.py): from the same
start it ends where TorchRec's row-wise plan ends, dedup and baseline, and its model, saved
in either layout, loads in one process and onto another number of processes. (Its
checkpoints, resumed after SIGKILL on 2 and on 3 processes: test_sharding.py.)"""

from pathlib import Path

import pytest
import torch
from test_sharding import SHARDED, _start
from test_train import DAY

from recd_core.config import TrainConfig
from recd_core.modeling.saved import load_model, read_optimizer
from recd_core.modeling.shard_files import is_sharded, open_tables
from recd_core.modeling.train import train

# 50 steps (the day's 15 batches a pass), no fold-in: the steps compared are the run's own
RUN = {**SHARDED, "seed": 1, "epochs": 4, "max_steps": 50, "fold_in_validation": False}
# a budget that copies the hot rows (one node: every copy on every rank)
FLEX = {"sharding": "flexshard", "flexshard": {"budget": 2.0}}


def _state(uri: str) -> dict[str, torch.Tensor]:
    """A saved model's weights in one process, its tables read from shard files if so."""
    model, meta = load_model(uri)
    state = model.state_dict()
    if is_sharded(meta):
        state |= {k: t.materialize() for k, t in open_tables(Path(uri), meta).items()}
    return state


def _gaps(a_uri: str, b_uri: str) -> dict[str, float]:
    """Relative differences of two saved models: the whole state as one vector, the worst
    table, the worst tensor of any size, the worst table's accumulators (single files)."""
    sa, sb = _state(a_uri), _state(b_uri)
    assert sa.keys() == sb.keys()

    def rel(k):
        return float((sb[k].float() - sa[k].float()).norm() / sa[k].float().norm())

    diff = sum(float((sb[k].float() - sa[k].float()).pow(2).sum()) for k in sa)
    norm = sum(float(sa[k].float().pow(2).sum()) for k in sa)
    gaps = {
        "model": (diff / norm) ** 0.5,
        "tables": max(
            rel(k) for k in sa if k.endswith("embedding.weight") or k.startswith("bags.")
        ),
        "tensor": max(rel(k) for k in sa),
    }
    oa, ob = (read_optimizer(u)["sparse"].get("state") for u in (a_uri, b_uri))
    if oa and ob:
        gaps["accumulators"] = max(
            float((ob[i]["sum"] - s["sum"]).norm() / s["sum"].norm()) for i, s in oa.items()
        )
    return gaps


def beside_row_wise(wh, plan: dict, mode: str = "dedup", nproc: int = 2, run: dict = RUN):
    """(TorchRec's row-wise run, `plan`'s run): the same config and start (one step of a
    one-process run), on `nproc` processes."""
    start = _start(wh, mode)
    rows = TrainConfig(**run, mode=mode, sharding="row_wise")
    rows = train(wh, DAY, rows, nproc=nproc, init_from=start)
    return rows, train(wh, DAY, TrainConfig(**run, mode=mode, **plan), nproc=nproc, init_from=start)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dedup", "baseline"])
def test_flexshard_ends_where_the_row_wise_plan_ends(fresh_warehouse, mode):
    rows, flex = beside_row_wise(fresh_warehouse, FLEX, mode)
    assert flex["train.steps"] == rows["train.steps"] == 50
    placed = flex["train.sharding"]
    assert all(v.startswith("flexshard on ranks 0-1") for v in placed.values())
    assert sum(" 0 rows hot" not in v for v in placed.values()) >= 5  # copies, trained
    # each rank holds its cold rows and every hot one: more than row-wise, within the budget
    assert all(
        r <= 2 * w
        for r, w in zip(
            flex["train.shard_bytes_per_rank"], rows["train.shard_bytes_per_rank"], strict=True
        )
    )
    gaps = _gaps(rows["train.model_uri"], flex["train.model_uri"])
    print(mode, {k: f"{v:.1e}" for k, v in gaps.items()})
    # float32 sums in another order, nothing else: the model and every table within 1e-6
    assert gaps["model"] < 1e-6 and gaps["tables"] < 1e-6 and gaps["accumulators"] < 1e-6
    assert gaps["tensor"] < 1e-5  # the smallest tensors (attention biases) feel it most
    assert flex["train.val_ne"] == pytest.approx(rows["train.val_ne"], rel=1e-6)


@pytest.mark.slow
def test_a_flexshard_model_saved_as_shards_loads_in_one_process_and_on_three(fresh_warehouse):
    start = _start(fresh_warehouse)
    single = train(fresh_warehouse, DAY, TrainConfig(**RUN, **FLEX), nproc=2, init_from=start)
    shards = train(
        fresh_warehouse,
        DAY,
        TrainConfig(**RUN, **FLEX, saved_layout="shards"),
        nproc=2,
        init_from=start,
    )
    assert _gaps(single["train.model_uri"], shards["train.model_uri"])["model"] == 0.0
    # onto three processes, FlexShard-placed again, and row-wise: one step each, the same
    after = {**RUN, "max_steps": 1}
    flex3 = train(
        fresh_warehouse,
        DAY,
        TrainConfig(**after, **FLEX),
        nproc=3,
        init_from=shards["train.model_uri"],
    )
    rows3 = train(
        fresh_warehouse,
        DAY,
        TrainConfig(**after, sharding="row_wise"),
        nproc=3,
        init_from=shards["train.model_uri"],
    )
    assert flex3["train.world_size"] == 3 and flex3["train.init_from"] == shards["train.model_uri"]
    assert _gaps(rows3["train.model_uri"], flex3["train.model_uri"])["model"] < 1e-6


@pytest.mark.slow
def test_on_two_machines_of_two_processes_the_warm_rows_train_exactly(fresh_warehouse):
    """4 processes as 2 machines of 2 (`per_node`): rows copied once a machine (warm, their
    gradients combined across the machines) and on every process (hot); 20 steps end where
    row-wise ends."""
    flex = {"sharding": "flexshard", "flexshard": {"budget": 2.0, "per_node": 2}}
    rows, got = beside_row_wise(fresh_warehouse, flex, nproc=4, run={**RUN, "max_steps": 20})
    tiers = got["train.sharding"].values()
    assert any(" 0 warm" not in v for v in tiers) and any(" 0 rows hot" not in v for v in tiers)
    gaps = _gaps(rows["train.model_uri"], got["train.model_uri"])
    print({k: f"{v:.1e}" for k, v in gaps.items()})
    assert gaps["model"] < 1e-6 and gaps["tables"] < 1e-6
