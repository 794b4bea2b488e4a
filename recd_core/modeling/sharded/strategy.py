"""`Sharded`: the parallelism strategy of a run whose tables are sharded (modeling/parallel.py
has the replicated one and what both answer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from recd_core.config import FeatureSet, TrainConfig
from recd_core.dpp.batch_store import Batch, BatchStore
from recd_core.modeling.sharded.checkpoints import ShardedCheckpoints
from recd_core.modeling.sharded.metrics import torchrec_validation
from recd_core.modeling.sharded.model import ShardedDLRM
from recd_core.modeling.sharded.plan import plan_table, shard, shard_bytes
from recd_core.modeling.sharded.state import FusedAdagrad, full_state
from recd_core.modeling.step import dense_optimizer
from recd_core.modeling.warm_start import Init, starting_model
from recd_core.warehouse import Warehouse


@dataclass
class Sharded:
    """The tables sharded across the run's processes by TorchRec's DistributedModelParallel
    (DMP), the dense part data parallel inside it."""

    rank: int
    world: int
    device: torch.device
    net: nn.Module | None = field(default=None, repr=False)  # the DMP of the model built last

    def placed(self, features: FeatureSet, cfg: TrainConfig) -> ShardedDLRM:
        """A fresh model: its dense part on the device, its tables placed by the planner
        (DMP materializes this rank's shards only); `self.net` is its DMP."""
        model = ShardedDLRM(features, cfg.model)
        tables, model.sharded = model.sharded, None
        model.to(self.device)
        model.sharded = tables
        self.net = shard(model, cfg, self.world, self.device)
        return self.net.module

    def build(self, features: FeatureSet, cfg: TrainConfig, init: Init,
              click_rate: float) -> tuple[ShardedDLRM, nn.Module, Init]:  # fmt: skip
        """(the model, its DMP, the start taken): a warm start's single-process state,
        saved by a run of any N, scattered to the shards."""
        model, init = starting_model(lambda: self.placed(features, cfg), init, click_rate)
        return model, self.net, init

    def optimizers(self, model: ShardedDLRM, cfg: TrainConfig, warm: bool):
        """(the dense layers' Adam, the tables' fused Adagrad: its step runs in backward)."""
        return dense_optimizer(model, cfg, warm), FusedAdagrad(model.sharded, cfg.lr_sparse)

    def steps_per_epoch(self, batches: int) -> int:
        return batches

    def step_batch(self, store: BatchStore, order, k: int) -> tuple[Batch, float]:
        """Every rank the same batch, its slice of it; the loss's scale makes DDP's mean
        over the ranks the batch's mean."""
        whole = store[int(order[k])]
        batch = whole.part(self.rank, self.world).to(self.device)
        return batch, self.world * batch.size / whole.size

    @property
    def writes_checkpoints(self) -> bool:
        return True  # every rank its own shards

    def checkpoints(self, wh: Warehouse, run: str, keep: int,
                    model: ShardedDLRM) -> ShardedCheckpoints:  # fmt: skip
        return ShardedCheckpoints(wh, run, keep, model.sharded)

    def cross_check(self, model: ShardedDLRM, valid: BatchStore) -> dict[str, float]:
        """The chosen state by torchrec.metrics over the ranks (rank 0's figures)."""
        return torchrec_validation(model, valid, self.device)

    def saved_state(self, model: ShardedDLRM, net: nn.Module, optimizer: dict,
                    opt_sparse: FusedAdagrad) -> tuple[dict, dict | None, dict | None]:  # fmt: skip
        """The single-process layout gathered onto rank 0 (None elsewhere), where the
        tables went, and each rank's share of them. A collective."""
        figures = {"train.sharding": plan_table(net),
                   "train.shard_bytes_per_rank": shard_bytes(model)}  # fmt: skip
        opt_sparse.load_state_dict(optimizer["sparse"])
        state, optimizer = full_state(model, optimizer["dense"], opt_sparse) or (None, None)
        return figures, state, optimizer
