"""A sharded model's state as it leaves the run: in the single-process layout gathered onto
rank 0 (`full_state`: a model that fits one process) or as shard files every rank writes
(`write_shards`: a table no process holds, modeling/shard_files.py); scattered back onto
any N (`load_full_state`, from either); and the tables' fused optimizer as the training
loop sees it (`FusedAdagrad`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from recd_core.modeling.sharded.tables import ShardedTables


def full_state(model, dense_optimizer: dict, opt_sparse) -> tuple[dict, dict] | None:
    """(model state, optimizers) in the single-process layout, on rank 0 (None elsewhere):
    every rank sends its shards and their accumulators (`dense_optimizer`: Adam's state,
    the same on every rank). A collective: all ranks call it."""
    tables: ShardedTables = model.sharded
    boxes, weights, accs = tables.exported()
    weights = [w.detach().cpu().clone() for w in weights]
    accs = [a.detach().cpu().clone() for a in accs]
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


def rank_shards(
    tables: ShardedTables, fs, base: str, exported: tuple, folder: str = "tables"
) -> list[tuple[str, dict]]:
    """This rank's shards (`exported`: the tables' (boxes, weights, accumulators), None
    where it has none) as shard files in `base`/`folder`: `(state key, model.json entry)`."""
    from recd_core.modeling.shard_files import write_shard

    boxes, weights, accumulators = exported
    return [
        (
            tables.specs[i].key,
            write_shard(fs, base, tables.specs[i].name, (r0, c0, nr, nc), w, acc, folder),
        )
        for (i, (r0, c0), (nr, nc)), w, acc in zip(boxes, weights, accumulators, strict=True)
    ]


def write_shards(model, fs, base: str) -> list[tuple[str, dict]] | None:
    """Every rank writes its shards of the tables (weights and accumulators) under `base`;
    rank 0 gets every rank's `(state key, model.json entry)` (None elsewhere). A
    collective: all ranks call it."""
    tables: ShardedTables = model.sharded
    mine = rank_shards(tables, fs, base, tables.exported())
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return [entry for part in parts for entry in part] if parts is not None else None


def load_full_state(model, state: dict) -> None:
    """The single-process layout (a saved model, a warm start) into this rank's dense
    weights and shards (`FusedAdagrad.load_state_dict` takes the accumulators). A table may
    be a `shard_files.LazyTable`: this rank's boxes are then read from its files only."""
    tables: ShardedTables = model.sharded
    keys = {s.key for s in tables.specs}
    missing = [s.key for s in tables.specs if s.key not in state]
    if missing:
        raise RuntimeError(f"the state lacks tables {missing}")
    model.load_dense_state({k: v for k, v in state.items() if k not in keys})
    for s in tables.specs:
        if tuple(state[s.key].shape) != (s.rows, model.cfg.embedding_dim):
            raise RuntimeError(f"{s.key}: shape {tuple(state[s.key].shape)}")
    tables.load_full([state[s.key] for s in tables.specs])


class FusedAdagrad:
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
        accs = self.tables.local_accumulators()
        return {
            "state": {i: {"sum": a.detach().clone()} for i, a in enumerate(accs)},
            "param_groups": [{**self.param_groups[0], "params": list(range(len(accs)))}],
        }

    def load_state_dict(self, state: dict) -> None:
        """This rank's accumulators, or the single-process layout's (one a table: a warm
        start's, scattered to the shards)."""
        accs = self.tables.local_accumulators()
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
                    a.copy_(s[:].view_as(a))  # s[:]: a shard file's accumulator read
                return
            self.tables.load_full(accumulators=saved)
