"""How a run's processes share the model, as one strategy object the training loop asks
(`Parallelism`, the protocol `train.Run` holds: train.py names no strategy):

    Replicated   a copy of the whole model in each process (DDP over N > 1): rank r takes
                 every N-th batch of a pass; rank 0 checkpoints and saves
    Sharded      the tables sharded across the processes, the dense part replicated
                 (sharded/strategy.py, TorchRec): every rank takes its slice of every
                 batch; every rank checkpoints its shards; the saved model is gathered

Each builds the model at its starting point (`build`: a warm start's single-process state,
loaded or scattered), its optimizers, a step's batch (`step_batch`), the checkpoints, a
cross-check of the chosen state and the state the saved model is written from
(`saved_state`: one file, or the tables as shard files, `train.saved_layout`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recd_core.config import FeatureSet, TrainConfig
from recd_core.dpp.batch_store import Batch, BatchStore
from recd_core.errors import BadInput
from recd_core.modeling.checkpoints import Checkpoints
from recd_core.modeling.model import Model, build_model
from recd_core.modeling.saved import Saved, without_tables
from recd_core.modeling.shard_files import layout, materialized, write_shard
from recd_core.modeling.step import make_optimizers
from recd_core.modeling.tables import table_specs
from recd_core.modeling.warm_start import Init, starting_model
from recd_core.warehouse import Warehouse


class CheckpointStore(Protocol):
    """A run's checkpoints as the loop uses them (checkpoints.py, sharded/checkpoints.py)."""

    run: str  # the run's name: its checkpoints' folder and the saved model's

    def save(self, state: dict) -> str: ...

    def latest(self) -> dict | None: ...


class Parallelism(Protocol):
    """How the run's processes share the model: what the training loop asks of a strategy
    (`Replicated`, `sharded.strategy.Sharded`), and all it knows of one."""

    rank: int
    world: int
    device: torch.device

    def build(
        self, features: FeatureSet, cfg: TrainConfig, init: Init, click_rate: float
    ) -> tuple[Model, nn.Module, Init]: ...

    def optimizers(self, model: Model, cfg: TrainConfig, warm: bool) -> tuple: ...

    def steps_per_epoch(self, batches: int) -> int: ...

    def step_batch(self, store: BatchStore, order, k: int) -> tuple[Batch, float]: ...

    @property
    def writes_checkpoints(self) -> bool: ...

    def checkpoints(self, wh: Warehouse, run: str, keep: int, model: Model) -> CheckpointStore: ...

    def cross_check(self, model: Model, valid: BatchStore) -> dict[str, float]: ...

    def saved_state(
        self,
        model: Model,
        net: nn.Module,
        optimizer: dict,
        opt_sparse,
        cfg: TrainConfig,
        fs,
        base: str,
    ) -> Saved: ...


@dataclass
class Replicated:
    """Data parallel: the whole model in every process (see the module)."""

    rank: int
    world: int
    device: torch.device

    def build(
        self, features: FeatureSet, cfg: TrainConfig, init: Init, click_rate: float
    ) -> tuple[Model, nn.Module, Init]:
        """(the model, what a step runs: the model or its DDP wrapper, the start taken). A
        warm start saved as shard files is read whole: this process holds the tables."""
        init = replace(init, state=materialized(init.state), optimizer=materialized(init.optimizer))
        model, init = starting_model(lambda: build_model(features, cfg.model), init, click_rate)
        model = model.to(self.device)
        return model, DistributedDataParallel(model) if self.world > 1 else model, init

    def optimizers(self, model: Model, cfg: TrainConfig, warm: bool):
        """(the dense layers' Adam, the tables' row-wise Adagrad)."""
        return make_optimizers(model, cfg, warm)

    def steps_per_epoch(self, batches: int) -> int:
        """Every rank takes the same number of steps (DDP all-reduces each one): the batches
        past the last full round of `world` are left out of a pass (a different set each
        pass, the order being seeded per pass)."""
        return batches // self.world

    def step_batch(self, store: BatchStore, order, k: int) -> tuple[Batch, float]:
        """Step `k` of a pass in `order`: this rank's batch, and the loss's scale (1)."""
        return store[int(order[self.rank :: self.world][k])].to(self.device), 1.0

    @property
    def writes_checkpoints(self) -> bool:
        return self.rank == 0

    def checkpoints(self, wh: Warehouse, run: str, keep: int, model: Model) -> Checkpoints:
        return Checkpoints(wh, run, keep)

    def cross_check(self, model: Model, valid: BatchStore) -> dict[str, float]:
        return {}

    def saved_state(
        self,
        model: Model,
        net: nn.Module,
        optimizer: dict,
        opt_sparse,
        cfg: TrainConfig,
        fs,
        base: str,
    ) -> Saved:
        """The model's own state, or with `saved_layout: shards` its tables written by rank
        0 as one shard each under `base` (on filesystem `fs`); an ensemble (a day past
        `members_up_to_samples`) is saved as one file."""
        if cfg.saved_layout != "shards" or self.rank != 0 or cfg.model.members > 1:
            return Saved({}, None, optimizer)
        specs, state = table_specs(model), model.state_dict()
        accs = optimizer["sparse"]["state"]
        entries = [
            (
                s.key,
                write_shard(
                    fs,
                    base,
                    s.name,
                    (0, 0, s.rows, cfg.model.embedding_dim),
                    state[s.key],
                    accs.get(i, {}).get("sum"),
                ),
            )
            for i, s in enumerate(specs)
        ]
        dense, rest = without_tables(state, optimizer, specs)
        return Saved({}, dense, rest, layout(cfg.model.embedding_dim, 1, specs, entries))


def check(cfg: TrainConfig, world: int) -> None:
    """Refuse, in one line and before any process starts, what the strategy cannot do."""
    if cfg.saved_layout == "shards" and cfg.model.members > 1:
        raise BadInput("train.saved_layout=shards saves one model: set train.model.members: 1")
    if cfg.sharding != "none":
        from recd_core.modeling.sharded.plan import check_config

        check_config(cfg, world)


def parallelism(
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
    validating: bool = False,
    store: BatchStore | None = None,
) -> Parallelism:
    """The strategy `cfg` asks for (`train.sharding`); `validating`: the run keeps its best
    validated state (another copy of the tables, which a sharded run's budget holds);
    `store`: the training batches (FlexShard places the rows by their lookups there)."""
    if cfg.sharding == "none":
        return Replicated(rank, world, device)
    from recd_core.modeling.sharded.strategy import FlexSharded, Sharded

    kept = ("the live tables",)
    kept += ("early stopping's best state",) if validating else ()
    kept += ("the passes' restart point",) if cfg.restart_tables and cfg.epochs > 1 else ()
    if cfg.sharding == "flexshard":
        return FlexSharded(rank, world, device, kept=kept, store=store)
    return Sharded(rank, world, device, kept=kept)
