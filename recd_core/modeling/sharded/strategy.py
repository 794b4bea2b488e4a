"""`Sharded`: the parallelism strategy of a run whose tables are sharded (modeling/parallel.py
has the replicated one and what both answer)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

# TorchRec's import is part of a sharded run's fixed cost: here, before the model is measured
import torchrec.distributed.model_parallel  # noqa: F401
from torch import nn

from recd_core.config import FeatureSet, TrainConfig
from recd_core.dpp.batch_store import Batch, BatchStore
from recd_core.modeling.launch import every_rank
from recd_core.modeling.saved import Saved, without_tables
from recd_core.modeling.shard_files import layout
from recd_core.modeling.sharded.bagpipe_tables import CachedTables
from recd_core.modeling.sharded.checkpoints import ShardedCheckpoints
from recd_core.modeling.sharded.flexshard import flexshard
from recd_core.modeling.sharded.flexshard_tables import FlexShardTables, row_counts
from recd_core.modeling.sharded.metrics import torchrec_validation
from recd_core.modeling.sharded.model import ShardedDLRM
from recd_core.modeling.sharded.plan import ShardingRefused, plan_table, shard, shard_bytes
from recd_core.modeling.sharded.state import FusedAdagrad, full_state, write_shards
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
    # the copies of its shards a rank holds, which the memory budget must hold (plan.shard)
    kept: tuple[str, ...] = ("the live tables",)

    def placed(self, features: FeatureSet, cfg: TrainConfig) -> ShardedDLRM:
        """A fresh model: its dense part on the device, its tables placed by the planner
        (DMP materializes this rank's shards only); `self.net` is its DMP."""
        model = ShardedDLRM(features, cfg.model)
        tables, model.sharded = model.sharded, None
        model.to(self.device)
        model.sharded = tables
        self.net = shard(model, cfg, self.world, self.device, self.kept)
        return self.net.module

    def build(
        self, features: FeatureSet, cfg: TrainConfig, init: Init, click_rate: float
    ) -> tuple[ShardedDLRM, nn.Module, Init]:
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

    def checkpoints(
        self, wh: Warehouse, run: str, keep: int, model: ShardedDLRM
    ) -> ShardedCheckpoints:
        return ShardedCheckpoints(wh, run, keep, model.sharded)

    def placement(self, model: ShardedDLRM, net: nn.Module) -> dict[str, str]:
        """Where each table went (the run's summary)."""
        return plan_table(net)

    def figures(self, model: ShardedDLRM) -> dict:
        """What the placement adds to the run's summary (a collective)."""
        return {}

    def cross_check(self, model: ShardedDLRM, valid: BatchStore) -> dict[str, float]:
        """The chosen state by torchrec.metrics over the ranks (rank 0's figures)."""
        return torchrec_validation(model, valid, self.device)

    def saved_state(
        self,
        model: ShardedDLRM,
        net: nn.Module,
        optimizer: dict,
        opt_sparse: FusedAdagrad,
        cfg: TrainConfig,
        fs,
        base: str,
    ) -> Saved:
        """Where the tables went and each rank's share of them; the model as shard files
        every rank writes under `base` (`shards_saved`), or else gathered onto rank 0 in
        the single-process layout. A collective."""
        figures = {
            "train.sharding": self.placement(model, net),
            "train.shard_bytes_per_rank": shard_bytes(model),
            **self.figures(model),
        }
        opt_sparse.load_state_dict(optimizer["sparse"])
        if not shards_saved(cfg, model.sharded.specs):
            state, optimizer = full_state(model, optimizer["dense"], opt_sparse) or (None, None)
            return Saved(figures, state, optimizer)
        entries = write_shards(model, fs, base)
        if entries is None:  # not rank 0
            return Saved(figures, None, None)
        specs, dim = model.sharded.specs, cfg.model.embedding_dim
        groups = [{**opt_sparse.param_groups[0], "params": list(range(len(specs)))}]
        dense, rest = without_tables(
            model.dense_state(),
            {"dense": optimizer["dense"], "sparse": {"param_groups": groups}},
            specs,
        )
        return Saved(figures, dense, rest, layout(dim, self.world, specs, entries))


@dataclass
class FlexSharded(Sharded):
    """The tables placed per row by FlexShard (flexshard.py, flexshard_tables.py) from the
    day's lookups (`store`'s batches, counted once), the dense part data parallel (DDP)."""

    store: BatchStore | None = field(default=None, repr=False)

    def placed(self, features: FeatureSet, cfg: TrainConfig) -> ShardedDLRM:
        from torch.nn.parallel import DistributedDataParallel

        if self.store is None:
            raise ValueError("FlexShard places the rows by the day's lookups: give it the batches")
        per_node = cfg.flexshard.per_node or self.world
        dim = cfg.model.embedding_dim

        def place(specs):
            counts = row_counts(self.store, specs)
            placements = [
                flexshard(
                    c,
                    self.world,
                    per_node,
                    int(-(-s.rows // self.world) * cfg.flexshard.budget),
                    len(self.store),
                    dim,
                )
                for s, c in zip(specs, counts, strict=True)
            ]
            if cfg.memory_budget_mb is not None:
                held = sum(p.rows_per_rank() for p in placements).max() * 4 * (dim + 1)
                if held * len(self.kept) > cfg.memory_budget_mb << 20:
                    raise ShardingRefused(
                        f"train.sharding=flexshard: {held >> 20} MB of rows a process (at "
                        f"train.flexshard.budget={cfg.flexshard.budget}), {len(self.kept)} "
                        f"copies ({', '.join(self.kept)}), exceed {cfg.memory_budget_mb} MB"
                    )
            args = (specs, dim, placements, self.rank, self.device, cfg.lr_sparse, cfg.seed)
            if not cfg.flexshard.cache_lookahead:
                return FlexShardTables(*args)
            rows = sum(-(-s.rows // self.world) for s in specs)
            return CachedTables(
                *args,
                lookahead=cfg.flexshard.cache_lookahead,
                budget_rows=int(cfg.flexshard.cache_budget * rows),
                background=cfg.flexshard.cache_background,
            )

        model = ShardedDLRM(features, cfg.model, place=place).to(self.device)
        with warnings.catch_warnings():  # DDP as DMP builds it, an argument torch deprecates
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
            self.net = DistributedDataParallel(
                model,
                device_ids=None if self.device.type == "cpu" else [self.device],
                gradient_as_bucket_view=True,
                broadcast_buffers=False,
                static_graph=True,
            )
        return model

    def placement(self, model: ShardedDLRM, net: nn.Module) -> dict[str, str]:
        return model.sharded.placement_table()

    def figures(self, model: ShardedDLRM) -> dict:
        """The bytes the tables' exchanges sent over the run, summed over the ranks, by
        kind (`train.flexshard_bytes`); with the cache, its hit rate over the remote reads.
        A collective."""
        tables = model.sharded
        if isinstance(tables, CachedTables):
            tables.drain()  # the run's end: no step follows
        sent = every_rank(dict(tables.sent), self.world)
        total: dict = {}
        for part in sent:
            for kind, n in part.items():
                total[kind] = total.get(kind, 0) + n
        out = {"train.flexshard_bytes": total}
        if isinstance(tables, CachedTables):
            hits = every_rank((tables.hits, tables.lookups), self.world)
            out["train.cache_hit_rate"] = sum(h for h, _ in hits) / max(sum(n for _, n in hits), 1)
        return out

    def step_batch(self, store: BatchStore, order, k: int) -> tuple[Batch, float]:
        """As `Sharded`'s; with the cache, the cache prepared for the step first."""
        tables = self.net.module.sharded if self.net is not None else None
        if isinstance(tables, CachedTables):
            tables.before_step(k, order, lambda i: tables.keys_of_parts(store[i], self.world))
        return super().step_batch(store, order, k)


def shards_saved(cfg: TrainConfig, specs) -> bool:
    """Whether a sharded run saves its tables as shard files: asked for, or (`auto`) when
    the tables and their accumulators exceed the per-process budget, so that no process
    could hold the gathered model."""
    if cfg.saved_layout != "auto":
        return cfg.saved_layout == "shards"
    table_bytes = sum(s.rows for s in specs) * 4 * (cfg.model.embedding_dim + 1)
    return cfg.memory_budget_mb is not None and table_bytes > cfg.memory_budget_mb << 20
