"""Embedding tables beyond one process: the DLRM's tables as one TorchRec
`EmbeddingCollection`, sharded across the run's processes by `DistributedModelParallel`
(`TrainConfig.sharding`); the dense part stays data parallel (DDP, which DMP wraps it in).

    rank r's part of the batch (rows r*B/N ..)          every rank
    ┌────────────────────────────────────────┐
    │ item-side keys: B/N rows               │── input all-to-all ──┐  ids to the ranks
    │ user-side group keys: its U unique     │   (ids: unique rows  │  holding their rows
    │   rows, then B/N - U empty rows        │    only)             ▼
    └────────────────────────────────────────┘        lookups on the local shards (fused
    per-id vectors, unique rows only  ◀── output all-to-all ──┘   row-wise Adagrad in backward)
        │ pooled by the DLRM (mean/sum of a row's ids), a history's tokens gathered
        ▼ (HistoryEncoder on the unique rows), expanded to samples by `inverse_indices`
    dense layers (DDP)

Why an EmbeddingCollection (one vector per id) and not a pooled EmbeddingBagCollection: the
DLRM's tables are shared by pooled features and histories (the clicked items' history reads
the item table token by token), and a TorchRec table belongs to one module. Why the group
keys are padded rows and not a variable-batch KJT: TorchRec 1.8's EmbeddingCollection
expands a variable-batch KJT's output to every sample (measured), and the history encoder
must run on the unique rows; both carry the same vectors through the all-to-alls, the
padding adds a zero length (8 bytes) a padding row and key to the ids' (tested).

Optimizer: the tables train with FBGEMM's fused EXACT_ROWWISE_ADAGRAD (the update runs in
the backward pass), the same rule as modeling/optim.py's RowWiseAdagrad. TorchRec sums a
row's gradient over the ranks while DDP averages the dense ones; row-wise Adagrad from a
zero accumulator does not change with the gradient's scale, so the two agree (a non-zero
`adagrad_initial_accumulator` is refused here).

States: a `ShardedDLRM`'s `state_dict()` holds the dense weights and this rank's shards
(`sharded.<k>`, plain tensors: early stopping and the table restarts keep them per rank);
`full_state` gathers the single-process layout onto rank 0 (the saved model: evaluate,
serving and warm starts need no change, and a warm start may use another N);
`load_full_state` scatters it back on any N. Checkpoints go through
torch.distributed.checkpoint (`to_dcp` / `dcp_target` / `from_dcp`, used by
checkpoints.ShardedCheckpoints), which reshards: a resume may use another N too.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from recd_core.config import FeatureSet, ModelConfig, TrainConfig
from recd_core.dedup.sparse import InverseKeyedJaggedTensor, KeyedJaggedTensor
from recd_core.dpp.batch_store import Batch
from recd_core.errors import BadInput
from recd_core.modeling.model import DLRM


class ShardingRefused(BadInput, ValueError):
    """The tables cannot be placed, or the run asks for what sharded training lacks."""


@dataclass(frozen=True)
class TableSpec:
    """One table: its name in the EmbeddingCollection, rows, the features that look it up,
    and its key in a single-process model's state dict."""

    name: str
    rows: int
    features: tuple[str, ...]
    key: str
    init_bound: float  # uniform(-bound, bound) for a fresh table


def table_specs(model) -> list[TableSpec]:
    """A DLRM's tables in the order of its `sparse_parameters()` (bags, then the histories'
    own tables), so optimizer states line up with the single-process layout."""
    specs = []
    for table in model.bag_tables:
        feats = [n for n in model.sparse_names if model.table_of[n] == table]
        feats += [n for n in model.sequence_names if model.history_table[n] == table]
        rows = model.table_sizes[feats[0]]
        specs.append(TableSpec(table, rows, tuple(feats), f"bags.{table}.weight", 0.05))
    for n in model.sequence_names:
        if model.history_table[n] is None:  # N(0, 1) in one process: the same variance
            specs.append(TableSpec(f"h_{n}", model.table_sizes[n], (n,),
                                   f"history.{n}.embedding.weight", 3**0.5))  # fmt: skip
    return specs


def check_config(cfg: TrainConfig, world: int) -> None:
    """Refuse, in one line, what sharded training does not do (yet)."""
    import importlib.util

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
    if cfg.adagrad_initial_accumulator:
        raise ShardingRefused(
            "sharded tables' fused Adagrad starts from a zero accumulator: "
            "set train.adagrad_initial_accumulator: 0"
        )


class ShardedTables(nn.Module):
    """The DLRM's tables as one TorchRec EmbeddingCollection (built on the meta device:
    `DistributedModelParallel` materializes each rank's shards only). `forward(batch)` ->
    each id feature's per-id vectors, in the order of its rows' ids ([nnz, d])."""

    def __init__(self, specs: list[TableSpec], dim: int):
        super().__init__()
        from torchrec import EmbeddingCollection, EmbeddingConfig

        self.specs = specs
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=s.name,
                    embedding_dim=dim,
                    num_embeddings=s.rows,
                    feature_names=list(s.features),
                    weight_init_min=-s.init_bound,
                    weight_init_max=s.init_bound,
                )
                for s in specs
            ],  # fmt: skip
            device=torch.device("meta"),
        )

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = self.ec(torchrec_input(batch))
        return {name: jt.values() for name, jt in out.items()}

    # -- this rank's shards ----------------------------------------------------------------
    def live(self) -> dict[str, dict]:
        """Each table's live ShardedTensors, in `specs` order: {"weights": name -> weights,
        "accumulators": name -> the fused Adagrad's per-row accumulators} (a table-wise rank
        without the table has no accumulators for it). Their local shards are views:
        writing them writes the tables."""
        weights = self.ec.state_dict()
        optim = self.ec.fused_optimizer.state_dict()["state"]
        out: dict[str, dict] = {"weights": {}, "accumulators": {}}
        for s in self.specs:
            key = f"embeddings.{s.name}.weight"
            out["weights"][s.name] = weights[key]
            if key in optim:
                (out["accumulators"][s.name],) = optim[key].values()
        return out

    def local_weights(self) -> list[torch.Tensor]:
        """This rank's shards of every table (views: writing them writes the weights)."""
        return _local(self.live()["weights"])

    def local_momentum(self) -> list[torch.Tensor]:
        """The per-row accumulators of this rank's shards (views)."""
        return _local(self.live()["accumulators"])


class ShardedDLRM(DLRM):
    """The DLRM with its tables in `ShardedTables` (one lookup a step for every id feature)
    and its dense part as usual. Its `state_dict()` is the dense weights and this rank's
    shards (`sharded.<k>`, plain tensors: what early stopping and the table restarts keep
    per rank); `load_state_dict` takes that, or the single-process layout (a saved model, a
    warm start), scattered to the shards."""

    def __init__(self, features: FeatureSet, cfg: ModelConfig):
        super().__init__(features, cfg, tables=False)
        self.sharded = ShardedTables(table_specs(self), cfg.embedding_dim)
        # the per-id vectors of the batch embedded last (feature -> [nnz, d]): the
        # co-occurrence loss reads its lists there, the tables being looked up once a step
        self.looked_up: dict[str, torch.Tensor] = {}

    def lookup(self, batch: Batch) -> dict[str, torch.Tensor]:
        self.looked_up = self.sharded(batch)
        return self.looked_up

    def sparse_parameters(self) -> list[torch.Tensor]:
        """This rank's shards (views of the weights)."""
        return self.sharded.local_weights()

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("sharded.")]

    def dense_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in super().state_dict().items() if not k.startswith("sharded.")}

    def load_dense_state(self, state: dict[str, torch.Tensor]) -> None:
        """Everything but the tables, strictly (TorchRec's loading hooks want the whole
        sharded state, so the tables are left out of the walk)."""
        children = dict(self.named_children())
        children.pop("sharded")
        own = dict(self.named_parameters(recurse=False)) | {
            k: b for k, b in self.named_buffers(recurse=False)
            if k not in self._non_persistent_buffers_set
        }  # fmt: skip
        unexpected = [k for k in state if k.split(".")[0] not in children and k not in own]
        missing = [k for k in own if k not in state]
        if missing or unexpected:
            raise RuntimeError(f"missing keys {missing[:4]}, unexpected keys {unexpected[:4]}")
        for name, child in children.items():
            child.load_state_dict({k[len(name) + 1 :]: v for k, v in state.items()
                                   if k.startswith(name + ".")})  # fmt: skip
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(state[k])

    def state_dict(self, *args, **kwargs):
        if args or kwargs:  # a module walk (DMP, DDP): the usual
            return super().state_dict(*args, **kwargs)
        shards = {f"sharded.{k}": w.detach() for k, w in enumerate(self.sharded.local_weights())}
        return {**self.dense_state(), **shards}

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        if any(spec.key in state for spec in self.sharded.specs):  # the single-process layout
            return load_full_state(self, state)
        shards = self.sharded.local_weights()
        if any(f"sharded.{k}" not in state for k in range(len(shards))):
            raise RuntimeError("the state holds no shards of this rank (a sharded model's own)")
        self.load_dense_state({k: v for k, v in state.items() if not k.startswith("sharded.")})
        with torch.no_grad():
            for k, w in enumerate(shards):
                w.copy_(state[f"sharded.{k}"])
        return None


def torchrec_input(batch: Batch):
    """The batch's id features as one TorchRec KJT of stride B: per-sample keys as they are,
    each group's keys as its unique rows followed by empty ones (see the module)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TrecKJT

    keys, values, lengths = [], [], []
    size = batch.size
    if batch.kjt is not None:
        keys += batch.kjt.keys
        values.append(batch.kjt.values)
        lengths.append(batch.kjt.lengths)
    for ik in batch.groups.values():
        pad = size - ik.num_unique
        for name, jt in ik.unique.to_dict().items():
            keys.append(name)
            values.append(jt.values)
            lengths += [jt.lengths, jt.lengths.new_zeros(pad)]
    return TrecKJT(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def from_torchrec(kjt) -> KeyedJaggedTensor | InverseKeyedJaggedTensor:
    """TorchRec's KJT -> recd's: a variable-batch KJT with `inverse_indices` (one stride per
    key, as `to_torchrec` writes an IKJT) becomes an IKJT, a plain one a KJT."""
    keys = list(kjt.keys())
    values, lengths = kjt.values(), kjt.lengths().to(torch.int64)
    if kjt.variable_stride_per_key():
        strides = kjt.stride_per_key()
        if len(set(strides)) != 1:
            raise BadInput(f"a variable-batch KJT with strides {strides}: one per IKJT group")
        inverse = kjt.inverse_indices_or_none()
        if inverse is None:
            raise BadInput("a variable-batch KJT without inverse_indices is no IKJT")
        inv_keys, inv = inverse
        if list(inv_keys) != keys or not bool((inv == inv[:1]).all()):
            raise BadInput("an IKJT's keys share one inverse_indices row; this KJT's differ")
        unique = KeyedJaggedTensor(keys, values, lengths)
        return InverseKeyedJaggedTensor(unique, inv[0].to(torch.int64))
    return KeyedJaggedTensor(keys, values, lengths)


# -- placing the tables --------------------------------------------------------------------
def shard(model, cfg: TrainConfig, world: int, device: torch.device):
    """`model` (a `ShardedDLRM`) under DistributedModelParallel: its
    tables placed by TorchRec's planner within `memory_budget_mb` per process (`auto`) or
    as `cfg.sharding` asks; refuses in one line when no plan fits."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import (
        FixedPercentageStorageReservation,
    )
    from torchrec.distributed.planner.types import (
        KernelConfig,
        ParameterConstraints,
        PlannerError,
        TopologyFactory,
        TrainerConfig,
    )

    sharders = [EmbeddingCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": cfg.lr_sparse,
        "eps": 1e-10})]  # fmt: skip
    cap = {}
    if cfg.memory_budget_mb is not None:
        cap = {f"{'hbm' if device.type == 'cuda' else 'ddr'}_cap_bytes": cfg.memory_budget_mb << 20}
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world, **cap),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    constraints = None
    if cfg.sharding != "auto":
        constraints = {s.name: ParameterConstraints(sharding_types=[cfg.sharding])
                       for s in model.sharded.specs}  # fmt: skip
    # the budget is the tables' (and their input and output buffers', as TorchRec estimates
    # them): nothing of it is held back for the dense part
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints,
                                       storage_reservation=FixedPercentageStorageReservation(0.0))  # fmt: skip
    try:
        with _quiet_planner():  # every rank plans alike (a refusal is then every rank's)
            plan = planner.plan(model, sharders)
    except PlannerError as e:
        specs = model.sharded.specs
        row_bytes = 4 * (cfg.model.embedding_dim + 1)  # weights and the row's accumulator
        big = max(specs, key=lambda s: s.rows)
        sizes = (f"{len(specs)} tables, {sum(s.rows for s in specs) * row_bytes >> 20} MB with "
                 f"their accumulators, the largest {big.name} {big.rows * row_bytes >> 20} MB")  # fmt: skip
        budget = f"{cfg.memory_budget_mb} MB" if cfg.memory_budget_mb else "the device's memory"
        raise ShardingRefused(
            f"train.sharding={cfg.sharding}: no placement of the tables ({sizes}) on {world} "
            f"processes fits {budget} each ({_first_reason(e)})"
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
    names = ["torchrec.distributed.planner", "torchrec.distributed.planner.types",
             "torchrec.distributed.planner.storage_reservations"]  # fmt: skip
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
    mine = sum(t.numel() * t.element_size()
               for t in [*tables.local_weights(), *tables.local_momentum()])  # fmt: skip
    out = [0] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


# -- the single-process layout, gathered and scattered -------------------------------------
def _shard_boxes(tables: ShardedTables) -> list[tuple[int, list, list]]:
    """(table index, offsets, sizes) of this rank's shards, in `local_weights` order."""
    weights = tables.live()["weights"]
    return [
        (i, list(sh.metadata.shard_offsets), list(sh.metadata.shard_sizes))
        for i, s in enumerate(tables.specs)
        for sh in weights[s.name].local_shards()
    ]


def full_state(model, dense_optimizer: dict, opt_sparse) -> tuple[dict, dict] | None:
    """(model state, optimizers) in the single-process layout, on rank 0 (None elsewhere):
    every rank sends its shards and their accumulators (`dense_optimizer`: Adam's state,
    the same on every rank). A collective: all ranks call it."""
    tables: ShardedTables = model.sharded
    boxes = _shard_boxes(tables)
    weights = [w.detach().cpu().clone() for w in tables.local_weights()]
    accs = [a.detach().cpu().clone() for a in tables.local_momentum()]
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((boxes, weights, accs), parts, dst=0)
    if dist.get_rank() != 0:
        return None
    dim = model.cfg.embedding_dim
    full_w = [torch.zeros(s.rows, dim) for s in tables.specs]
    full_acc = [torch.zeros(s.rows) for s in tables.specs]
    for rank_boxes, rank_w, rank_acc in parts:
        for (i, (r0, c0), (nr, nc)), w, acc in zip(rank_boxes, rank_w, rank_acc, strict=True):
            full_w[i][r0 : r0 + nr, c0 : c0 + nc] = w
            # a column-wise shard's accumulator is the mean over its columns: the row's
            # accumulator is the column-weighted mean of its shards'
            full_acc[i][r0 : r0 + nr] += acc.reshape(-1)[:nr] * (nc / dim)
    state = {k: v.detach().cpu().clone() for k, v in model.dense_state().items()}
    state.update({s.key: w for s, w in zip(tables.specs, full_w, strict=True)})
    sparse = {
        "state": {i: {"sum": acc} for i, acc in enumerate(full_acc)},
        "param_groups": [{**opt_sparse.param_groups[0], "params": list(range(len(full_acc)))}],
    }
    return state, {"dense": dense_optimizer, "sparse": sparse}


def load_full_state(model, state: dict) -> None:
    """The single-process layout (a saved model, a warm start) into this rank's dense
    weights and shards (`FusedTables.load_state_dict` takes the accumulators)."""
    tables: ShardedTables = model.sharded
    keys = {s.key for s in tables.specs}
    missing = [s.key for s in tables.specs if s.key not in state]
    if missing:
        raise RuntimeError(f"the state lacks tables {missing}")
    model.load_dense_state({k: v for k, v in state.items() if k not in keys})
    with torch.no_grad():
        for (i, (r0, c0), (nr, nc)), w in zip(_shard_boxes(tables), tables.local_weights(),
                                               strict=True):  # fmt: skip
            full = state[tables.specs[i].key]
            if tuple(full.shape) != (tables.specs[i].rows, model.cfg.embedding_dim):
                raise RuntimeError(f"{tables.specs[i].key}: shape {tuple(full.shape)}")
            w.copy_(full[r0 : r0 + nr, c0 : c0 + nc])


# -- checkpoints through torch.distributed.checkpoint (modeling/checkpoints.py) -------------
def _wrapped(live: dict, flat: list[torch.Tensor]) -> dict:
    """This rank's shards (`flat`, in `local_weights` order) as ShardedTensors laid out as
    `live`'s (a table's shards in the order of its local shards)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    out, k = {}, 0
    for name, st in live.items():
        shards = st.local_shards()
        mine = [Shard(flat[k + j], sh.metadata) for j, sh in enumerate(shards)]
        k += len(shards)
        out[name] = ShardedTensor._init_from_local_shards_and_global_metadata(mine, st.metadata())
    if k != len(flat):
        raise ValueError(f"{len(flat)} shards for {k} local shards of the tables")
    return out


def _local(sharded: dict) -> list[torch.Tensor]:
    return [sh.tensor for st in sharded.values() for sh in st.local_shards()]


def to_dcp(tables: ShardedTables, state: dict, to_bytes) -> dict:
    """The loop's checkpoint state (`checkpoint_state`, this rank's shards as plain
    tensors) as DCP saves it: the tables' shards as ShardedTensors, the rest as one tensor
    of bytes (the same on every rank: DCP keeps one copy)."""
    live = tables.live()
    model, optimizer = state["model"], state["optimizer"]
    shards = [model[f"sharded.{k}"] for k in range(len(_local(live["weights"])))]
    accs = [optimizer["sparse"]["state"][k]["sum"] for k in sorted(optimizer["sparse"]["state"])]
    out = {"weights": _wrapped(live["weights"], shards),
           "accumulators": _wrapped(live["accumulators"], accs)}  # fmt: skip
    early = dict(state["early"])
    best, best_opt = early.pop("best_state", None), early.pop("best_optimizer", None)
    if best is not None:
        out["best_weights"] = _wrapped(
            live["weights"], [best[f"sharded.{k}"] for k in range(len(shards))]
        )
        best_accs = best_opt["sparse"]["state"]
        out["best_accumulators"] = _wrapped(live["accumulators"],
                                            [best_accs[k]["sum"] for k in sorted(best_accs)])  # fmt: skip
        early["best_dense"] = {k: v for k, v in best.items() if not k.startswith("sharded.")}
        early["best_optimizer_dense"] = best_opt["dense"]
    rest = {
        "model": {k: v for k, v in model.items() if not k.startswith("sharded.")},
        "optimizer_dense": optimizer["dense"],
        "sparse_groups": optimizer["sparse"]["param_groups"],
        "step": state["step"],
        "config": state["config"],
        "early": early,
    }
    out["rest"] = torch.frombuffer(bytearray(to_bytes(rest)), dtype=torch.uint8)
    return out


def dcp_target(tables: ShardedTables, metadata) -> dict:
    """What DCP loads a checkpoint into: this run's placement (any N), empty."""
    live = tables.live()

    def empty(part: dict) -> dict:
        return _wrapped(part, [torch.empty_like(t) for t in _local(part)])

    out = {"weights": empty(live["weights"]), "accumulators": empty(live["accumulators"])}
    if any(k.startswith("best_weights.") for k in metadata.state_dict_metadata):
        out["best_weights"] = empty(live["weights"])
        out["best_accumulators"] = empty(live["accumulators"])
    out["rest"] = torch.empty(tuple(metadata.state_dict_metadata["rest"].size), dtype=torch.uint8)
    return out


def from_dcp(tables: ShardedTables, loaded: dict, from_bytes) -> dict:
    """A loaded `dcp_target` back in the loop's layout (`checkpoint_state`'s)."""
    rest = from_bytes(loaded["rest"].numpy().tobytes())

    def model_state(dense: dict, part: dict) -> dict:
        return {**dense, **{f"sharded.{k}": t for k, t in enumerate(_local(part))}}

    def sparse(part: dict) -> dict:
        return {"state": {k: {"sum": t} for k, t in enumerate(_local(part))},
                "param_groups": rest["sparse_groups"]}  # fmt: skip

    early = dict(rest["early"])
    if "best_weights" in loaded:
        early["best_state"] = model_state(early.pop("best_dense"), loaded["best_weights"])
        early["best_optimizer"] = {"dense": early.pop("best_optimizer_dense"),
                                   "sparse": sparse(loaded["best_accumulators"])}  # fmt: skip
    return {
        "model": model_state(rest["model"], loaded["weights"]),
        "optimizer": {"dense": rest["optimizer_dense"], "sparse": sparse(loaded["accumulators"])},
        "step": rest["step"],
        "config": rest["config"],
        "early": early,
    }


class FusedTables:
    """The tables' optimizer as the training loop sees it: the update itself is fused into
    the backward pass (TorchRec), so `step` and `zero_grad` do nothing; the state is this
    rank's accumulators (what the table restarts and early stopping keep per rank)."""

    def __init__(self, tables: ShardedTables, lr: float):
        self.tables = tables
        self.param_groups = [{"lr": lr, "eps": 1e-10, "initial_accumulator": 0.0}]

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        accs = self.tables.local_momentum()
        return {
            "state": {i: {"sum": a.detach().clone()} for i, a in enumerate(accs)},
            "param_groups": [{**self.param_groups[0], "params": list(range(len(accs)))}],
        }

    def load_state_dict(self, state: dict) -> None:
        """This rank's accumulators, or the single-process layout's (one a table: a warm
        start's, scattered to the shards)."""
        accs = self.tables.local_momentum()
        saved = [state["state"][i]["sum"] for i in sorted(state["state"])]
        local = len(saved) == len(accs) and all(
            s.numel() == a.numel() for s, a in zip(saved, accs, strict=True)
        )
        full = len(saved) == len(self.tables.specs) and all(
            s.numel() == spec.rows for s, spec in zip(saved, self.tables.specs, strict=True)
        )
        if not (local or full):
            raise ValueError("the state is neither this rank's shards nor the whole tables'")
        with torch.no_grad():
            if local:
                for s, a in zip(saved, accs, strict=True):
                    a.copy_(s.view_as(a))
                return
            for (i, (r0, _), (nr, _)), a in zip(_shard_boxes(self.tables), accs, strict=True):
                a.view(-1)[:nr].copy_(saved[i][r0 : r0 + nr])


def torchrec_validation(model, valid, device: torch.device) -> dict[str, float]:
    """NE and AUC of the current weights on the validation batches by `torchrec.metrics`,
    each rank scoring its slice of every batch and the metrics gathered over the ranks onto
    rank 0 (a check beside recd's own, which every rank computes on whole batches; {} on
    the other ranks). A collective."""
    from torchrec.metrics.auc import AUCMetric
    from torchrec.metrics.metrics_config import RecComputeMode, RecTaskInfo
    from torchrec.metrics.ne import NEMetric

    rank, world = dist.get_rank(), dist.get_world_size()
    task = RecTaskInfo(name="click", label_name="label", prediction_name="p", weight_name="w")
    samples = max(valid.samples(), 1)  # the AUC's window: all of them
    metrics = [m(world_size=world, my_rank=rank, batch_size=1, tasks=[task],
                 compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION, window_size=samples)
               for m in (NEMetric, AUCMetric)]  # fmt: skip
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for k in range(len(valid)):
            batch = valid[k].part(rank, world).to(device)
            probs = torch.sigmoid(model(batch)).float().cpu()
            labels = batch.labels.float().cpu()
            for m in metrics:
                m.update(predictions={"click": probs}, labels={"click": labels},
                         weights={"click": torch.ones_like(labels)})  # fmt: skip
    model.train(was_training)
    out = {}
    for m in metrics:  # gathered onto rank 0; the others get nothing back
        out |= {k: float(v) for k, v in m.compute().items()}
    if not out:
        return {}
    return {"train.val_ne_torchrec": out["ne-click|lifetime_ne"],
            "train.val_auc_torchrec": out["auc-click|window_auc"]}  # fmt: skip


# -- communication, measured ---------------------------------------------------------------
@contextlib.contextmanager
def counted_all_to_all():
    """Count the bytes this rank sends to other ranks through `all_to_all_single` (what
    TorchRec's input and output distributions use) while inside; yields a Counter by
    dtype (int64/int32: ids and lengths; float32: vectors and their gradients)."""
    sent: Counter = Counter()
    original = dist.all_to_all_single
    rank, world = dist.get_rank(), dist.get_world_size()

    def counting(output, input, output_split_sizes=None, input_split_sizes=None,
                 group=None, async_op=False):  # fmt: skip
        rows = input.shape[0] if input.dim() else 0
        row_bytes = input[0].numel() * input.element_size() if rows else 0
        splits = input_split_sizes or [rows // world] * world
        sent[str(input.dtype).removeprefix("torch.")] += row_bytes * sum(
            n for j, n in enumerate(splits) if j != rank
        )
        return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

    dist.all_to_all_single = counting
    try:
        yield sent
    finally:
        dist.all_to_all_single = original
