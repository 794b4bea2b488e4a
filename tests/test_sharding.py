"""Model-parallel tables through TorchRec: sharded training on 2 processes (gloo) agrees
with one process, resumes after SIGKILL, refuses what it cannot place; interop with
TorchRec's KJTs."""

import pytest
import torch

from recd_core.config import PreprocessConfig, TrainConfig
from recd_core.dedup.sparse import (
    InverseKeyedJaggedTensor,
    KeyedJaggedTensor,
    to_torchrec,
)
from recd_core.dpp.preprocess import preprocess
from recd_core.modeling.saved import load_model, read_optimizer
from recd_core.modeling.sharding import ShardingRefused, from_torchrec
from recd_core.modeling.train import train
from test_train import DAY, SMALL_MODEL

SHARDED = dict(batch_size=256, epochs=2, model=SMALL_MODEL, threads=1,
               cooccurrence_weight=0.0, checkpoint_every=5)  # fmt: skip


def _start(wh) -> str:
    """A common starting point: one step of a one-process run, saved as a model."""
    preprocess(wh, DAY, PreprocessConfig(batch_size=256))
    s = train(wh, "2026-11-02" if False else DAY, TrainConfig(**SHARDED, max_steps=1))
    return s["train.model_uri"]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_sharded_two_processes_end_where_one_process_does(fresh_warehouse, sharding):
    start = _start(fresh_warehouse)
    cfg = TrainConfig(**SHARDED, seed=1)  # another run key than the start's
    one = train(fresh_warehouse, DAY, cfg, init_from=start)
    two = train(fresh_warehouse, DAY, cfg.model_copy(update={"sharding": sharding}), nproc=2,
                init_from=start)  # fmt: skip
    assert two["train.world_size"] == 2 and two["train.steps"] == one["train.steps"]
    assert {r["sharding"] for r in two["train.sharding"]} == {sharding}
    assert two["train.val_ne"] == pytest.approx(one["train.val_ne"], rel=1e-4)
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
