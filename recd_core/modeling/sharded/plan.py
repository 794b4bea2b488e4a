"""Placing the tables: TorchRec's planner within a memory budget a process (or the
placement the config asks for), the one-line refusals, and where the tables went."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings

import torch
import torch.distributed as dist

from recd_core.config import TrainConfig
from recd_core.errors import BadInput
from recd_core.modeling.launch import every_rank
from recd_core.modeling.sharded.tables import ShardedTables


class ShardingRefused(BadInput, ValueError):
    """The tables cannot be placed, or the run asks for what sharded training lacks."""


def check_config(cfg: TrainConfig, world: int) -> None:
    """Refuse, in one line, what sharded training does not do (yet)."""

    if importlib.util.find_spec("torchrec") is None:
        raise ShardingRefused(
            f"train.sharding={cfg.sharding} needs TorchRec: pip install --no-deps torchrec==1.8.0 "
            "fbgemm-gpu-cpu==1.8.0 (or the project's `torchrec` extra)"
        )
    if world < 2:
        raise ShardingRefused(
            f"train.sharding={cfg.sharding} needs 2 or more processes (train.nproc, --nproc)"
        )
    if cfg.model.members > 1:
        raise ShardingRefused("sharded training trains one model: set train.model.members: 1")
    if cfg.average_states > 1:
        raise ShardingRefused(
            "sharded training keeps the live tables, not a mean of states: "
            "set train.average_states: 1"
        )
    per_node = cfg.flexshard.per_node
    if cfg.sharding == "flexshard" and per_node and world % per_node:
        raise ShardingRefused(
            f"train.flexshard.per_node={per_node} does not divide the {world} processes "
            "into machines"
        )
    if cfg.adagrad_initial_accumulator:
        raise ShardingRefused(
            "sharded tables' fused Adagrad starts from a zero accumulator: "
            "set train.adagrad_initial_accumulator: 0"
        )


def shard(
    model,
    cfg: TrainConfig,
    world: int,
    device: torch.device,
    kept: tuple[str, ...] = ("the live tables",),
):
    """`model` (a `ShardedDLRM`) under DistributedModelParallel: its
    tables placed by TorchRec's planner within `memory_budget_mb` per process (`auto`) or
    as `cfg.sharding` asks; refuses in one line when no plan fits. `kept`: the copies of a
    rank's shards the run holds (the live tables, early stopping's best state, the passes'
    restart point): the budget holds them all, so the planner places the tables within its
    share of it."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import (
        KernelConfig,
        ParameterConstraints,
        PlannerError,
        TopologyFactory,
        TrainerConfig,
    )

    sharders = [
        EmbeddingCollectionSharder(
            fused_params={
                "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "learning_rate": cfg.lr_sparse,
                "eps": 1e-10,
            }
        )
    ]
    cap = {}
    if cfg.memory_budget_mb is not None:
        share = (cfg.memory_budget_mb << 20) // len(kept)
        cap = {f"{'hbm' if device.type == 'cuda' else 'ddr'}_cap_bytes": share}
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world, **cap),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    constraints = None
    if cfg.sharding != "auto":
        constraints = {
            s.name: ParameterConstraints(sharding_types=[cfg.sharding]) for s in model.sharded.specs
        }
    # the budget is the tables' (and their input and output buffers', as TorchRec estimates
    # them): nothing of it is held back for the dense part
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.0),
    )
    try:
        with _quiet_planner():  # every rank plans alike (a refusal is then every rank's)
            plan = planner.plan(model, sharders)
    except PlannerError as e:
        specs = model.sharded.specs
        row_bytes = 4 * (cfg.model.embedding_dim + 1)  # weights and the row's accumulator
        big = max(specs, key=lambda s: s.rows)
        sizes = (
            f"{len(specs)} tables, {sum(s.rows for s in specs) * row_bytes >> 20} MB with "
            f"their accumulators, the largest {big.name} {big.rows * row_bytes >> 20} MB"
        )
        budget = f"{cfg.memory_budget_mb} MB" if cfg.memory_budget_mb else "the device's memory"
        copies = f", {len(kept)} copies of its shards ({', '.join(kept)})" if len(kept) > 1 else ""
        raise ShardingRefused(
            f"train.sharding={cfg.sharding}: no placement of the tables ({sizes}) on {world} "
            f"processes fits {budget} each{copies} ({_first_reason(e)})"
        ) from None
    # TorchRec's sharded modules ask torch.fx whether they are traced on every forward, and
    # torch warns each process once that the question is ambiguous: not the user's concern
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    with warnings.catch_warnings():  # DMP builds its DDP with an argument torch deprecates
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
        return DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)


def _first_reason(e: Exception) -> str:
    text = " ".join(str(e).split()).split(". Possible solutions")[0]
    return text[:120] + ("..." if len(text) > 120 else "")


@contextlib.contextmanager
def _quiet_planner():
    """TorchRec's planner logs its whole search at WARNING; a refusal says it in one line."""
    names = [
        "torchrec.distributed.planner",
        "torchrec.distributed.planner.types",
        "torchrec.distributed.planner.storage_reservations",
    ]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def plan_table(dmp) -> dict[str, str]:
    """Where each table went: {table: "row_wise on ranks 0,1"} (the run's summary)."""
    out = {}
    for module_plan in dmp.plan.plan.values():
        for table, p in module_plan.items():
            shards = p.sharding_spec.shards if p.sharding_spec is not None else []
            ranks = sorted({int(s.placement.rank()) for s in shards}) or p.ranks or []
            out[table] = f"{p.sharding_type} on ranks {','.join(map(str, ranks))}"
    return out


def shard_bytes(model) -> list[int]:
    """The bytes each rank holds of the tables (weights and accumulators). A collective."""
    tables: ShardedTables = model.sharded
    mine = sum(
        t.numel() * t.element_size()
        for t in [*tables.local_weights(), *tables.local_accumulators()]
    )
    return every_rank(mine, dist.get_world_size())
