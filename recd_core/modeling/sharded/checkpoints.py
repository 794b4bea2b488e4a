"""A sharded run's checkpoints through torch.distributed.checkpoint (DCP), and the state's
layout in them: the tables' shards as ShardedTensors (DCP reshards them on load, so a
resume may use another number of processes or another placement), the rest as bytes."""

from __future__ import annotations

import contextlib
import os
import re
import warnings

import pyarrow.fs as pafs
import torch

from recd_core.errors import first_line
from recd_core.leftovers import write_atomically
from recd_core.modeling.saved import (
    CheckpointError,
    read_bytes,
    torch_bytes,
    torch_load,
    write_bytes,
)
from recd_core.modeling.sharded.tables import ShardedTables, local_shards
from recd_core.warehouse import Warehouse


class ShardedCheckpoints:
    """A sharded run's checkpoints, through torch.distributed.checkpoint (DCP):

        <warehouse>/checkpoints/<run>/step-NNNNNNNN.dcp/
            __R_0.distcp   rank R's shards: the tables' weights and accumulators (the
                           live ones, and the best validated state's), as ShardedTensors
            .metadata      the layout, written last: a step without it is incomplete
        "rest": the dense weights, Adam's state, the step, the config and early
        stopping's history, one copy (the same on every rank), as bytes of a tensor file

    Every rank writes its own file through the warehouse (any filesystem it supports: DCP
    writes to a local staging directory first); rank 0 writes `.metadata` after every rank
    has written. Loading reshards: a run resumed with another number of processes, or
    another placement, reads the same checkpoint. `save` takes and `latest` gives the state
    as the training loop holds it (`checkpoint_state`: a sharded model's local layout)."""

    def __init__(self, wh: Warehouse, run: str, keep: int, tables):
        self.wh, self.run, self.keep, self.tables = wh, run, keep, tables
        self.dir = f"{wh.root}/checkpoints/{run}"

    def steps(self, complete: bool = True) -> list[int]:
        """The checkpoints' steps, oldest first (`complete=False`: the ones a killed save
        left without `.metadata`)."""
        if self.wh.fs.get_file_info(self.dir).type != pafs.FileType.Directory:
            return []
        mine = re.compile(r"step-(\d{8})\.dcp")
        infos = self.wh.fs.get_file_info(pafs.FileSelector(self.dir))
        found = [(mine.fullmatch(i.base_name), i.path) for i in infos]
        return sorted(int(m.group(1)) for m, path in found
                      if m and self.wh.exists_file(f"{path}/.metadata") == complete)  # fmt: skip

    def path(self, step: int) -> str:
        return f"{self.dir}/step-{step:08d}.dcp"

    def save(self, state: dict) -> str:
        import tempfile

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        path = self.path(state["step"])
        with tempfile.TemporaryDirectory() as tmp, _quiet_dcp():
            dcp.save(to_dcp(self.tables, state, torch_bytes), checkpoint_id=tmp)
            names = sorted(os.listdir(tmp))
            for name in names:  # this rank's data (streamed: a shard is not read whole
                if name != ".metadata":  # again); rank 0's metadata after everyone's
                    write_atomically(self.wh.fs, f"{path}/{name}", _blocks(f"{tmp}/{name}"))
            dist.barrier()
            if dist.get_rank() == 0:
                write_bytes(self.wh, f"{path}/.metadata", _read(f"{tmp}/.metadata"))
                old = self.steps()[: -self.keep] + self.steps(complete=False)
                for step in old:
                    self.wh.fs.delete_dir(self.path(step))
        dist.barrier()
        return path

    def latest(self) -> dict | None:
        """The newest complete checkpoint, in the loop's layout (resharded to this run)."""
        import tempfile

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        steps = self.steps()
        if not steps:
            return None
        path = self.path(steps[-1])
        with tempfile.TemporaryDirectory() as tmp:
            for info in self.wh.fs.get_file_info(pafs.FileSelector(path)):
                with open(f"{tmp}/{info.base_name}", "wb") as f:
                    f.write(read_bytes(self.wh, info.path))
            try:
                with _quiet_dcp():
                    metadata = dcp.FileSystemReader(tmp).read_metadata()
                    target = dcp_target(self.tables, metadata)
                    dcp.load(target, checkpoint_id=tmp)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
                raise CheckpointError(
                    f"{path} is corrupt or not a recd checkpoint ({type(e).__name__}: "
                    f"{first_line(e, 160)}); delete it to resume from the previous checkpoint"
                ) from None
        return from_dcp(self.tables, target, lambda data: torch_load(data, path))


@contextlib.contextmanager
def _quiet_dcp():
    """TorchRec 1.8's state is ShardedTensors, which torch warns it deprecates, on every
    save and load: not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead")
        yield


def _blocks(path: str, size: int = 1 << 24):
    with open(path, "rb") as f:
        while block := f.read(size):
            yield block


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


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


def to_dcp(tables: ShardedTables, state: dict, to_bytes) -> dict:
    """The loop's checkpoint state (`checkpoint_state`, this rank's shards as plain
    tensors) as DCP saves it: the tables' shards as ShardedTensors, the rest as one tensor
    of bytes (the same on every rank: DCP keeps one copy)."""
    live = tables.live()
    model, optimizer = state["model"], state["optimizer"]
    shards = [model[f"sharded.{k}"] for k in range(len(local_shards(live["weights"])))]
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
        return _wrapped(part, [torch.empty_like(t) for t in local_shards(part)])

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
        return {**dense, **{f"sharded.{k}": t for k, t in enumerate(local_shards(part))}}

    def sparse(part: dict) -> dict:
        return {"state": {k: {"sum": t} for k, t in enumerate(local_shards(part))},
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
