"""A sharded run's checkpoints, in the format of a saved model's tables (shard_files.py):
every rank streams its shards into files, and a resume reads the boxes of its own placement,
so a run resumed with another number of processes, or another placement, reads the same
checkpoint (TorchRec has no such resharding of its own checkpoints)."""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import torch.distributed as dist

from recd_core.errors import BadInput, first_line
from recd_core.modeling.saved import (
    CheckpointError,
    read_bytes,
    torch_bytes,
    torch_load,
    write_bytes,
)
from recd_core.modeling.shard_files import LazyAccumulator, layout, open_tables
from recd_core.modeling.sharded.state import rank_shards
from recd_core.modeling.sharded.tables import ShardedTables
from recd_core.warehouse import Warehouse

LAYOUT_FILE = "layout.json"


class ShardedCheckpoints:
    """A sharded run's checkpoints:

        <warehouse>/checkpoints/<run>/step-NNNNNNNN/
            tables/<table>.<rows>.<cols>.f32, .acc.f32   the live tables: every rank its
                                                         shards' weights and accumulators
            best/...                                     early stopping's best state, kept
            rest.pt        the dense weights, Adam's state, the tables' optimizer settings,
                           the step, the config, early stopping's history (rank 0)
            layout.json    the shards of each part (shard_files.layout), written by rank 0
                           after every rank's files: a step without it is incomplete

    Saving copies nothing: a shard streams into its file in row blocks (DCP, used before,
    cloned each shard: a shard's bytes more at every checkpoint). `save` takes and `latest`
    gives the state as the training loop holds it (`checkpoint_state`); the live tables come
    back in the single-process layout, read box by box by the placement that loads them."""

    def __init__(self, wh: Warehouse, run: str, keep: int, tables: ShardedTables):
        self.wh, self.run, self.keep, self.tables = wh, run, keep, tables
        self.dir = f"{wh.root}/checkpoints/{run}"

    def steps(self, complete: bool = True) -> list[int]:
        """The checkpoints' steps, oldest first (`complete=False`: the ones a killed save
        left without `layout.json`)."""
        if self.wh.fs.get_file_info(self.dir).type != pafs.FileType.Directory:
            return []
        mine = re.compile(r"step-(\d{8})")
        infos = self.wh.fs.get_file_info(pafs.FileSelector(self.dir))
        found = [
            (mine.fullmatch(i.base_name), i.path)
            for i in infos
            if i.type == pafs.FileType.Directory
        ]
        return sorted(
            int(m.group(1))
            for m, path in found
            if m and self.wh.exists_file(f"{path}/{LAYOUT_FILE}") == complete
        )

    def path(self, step: int) -> str:
        return f"{self.dir}/step-{step:08d}"

    def _write(self, path: str, part: str, state: dict, sparse: dict) -> list[tuple[str, dict]]:
        """This rank's shards of `state` (`sharded.<k>`, the loop's layout) and their
        accumulators, as shard files in `path`/`part`."""
        n, accs = len(self.tables.local_weights()), sparse["state"]
        exported = self.tables.exported(
            [state[f"sharded.{k}"] for k in range(n)],
            [accs.get(k, {}).get("sum") for k in range(n)],
        )
        return rank_shards(self.tables, self.wh.fs, path, exported, part)

    def save(self, state: dict) -> str:
        path = self.path(state["step"])
        model, optimizer = state["model"], state["optimizer"]
        early = dict(state["early"])
        best, best_opt = early.pop("best_state", None), early.pop("best_optimizer", None)
        mine = {"tables": self._write(path, "tables", model, optimizer["sparse"])}
        if best is not None:
            mine["best"] = self._write(path, "best", best, best_opt["sparse"])
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() == 0:
            if best is not None:
                early["best_dense"] = {
                    k: v for k, v in best.items() if not k.startswith("sharded.")
                }
                early["best_optimizer_dense"] = best_opt["dense"]
            rest = {
                "model": {k: v for k, v in model.items() if not k.startswith("sharded.")},
                "optimizer_dense": optimizer["dense"],
                "sparse_groups": optimizer["sparse"]["param_groups"],
                "step": state["step"],
                "config": state["config"],
                "early": early,
            }
            write_bytes(self.wh, f"{path}/rest.pt", torch_bytes(rest))
            layouts = {
                part: layout(
                    self.tables.dim,
                    len(parts),
                    self.tables.specs,
                    [e for p in parts for e in p[part]],
                )
                for part in mine
            }
            write_bytes(self.wh, f"{path}/{LAYOUT_FILE}", json.dumps(layouts).encode())
            for step in self.steps()[: -self.keep] + self.steps(complete=False):
                if step != state["step"]:
                    self.wh.fs.delete_dir(self.path(step))
        dist.barrier()
        return path

    def latest(self) -> dict | None:
        """The newest complete checkpoint, in the loop's layout; the live tables and their
        accumulators in the single-process layout, lazy: this run's placement (any N) reads
        its boxes from the files."""
        steps = self.steps()
        if not steps:
            return None
        path = self.path(steps[-1])
        try:
            with _local(self.wh, path) as local:
                layouts = json.loads((local / LAYOUT_FILE).read_text())
                rest = torch_load((local / "rest.pt").read_bytes(), f"{path}/rest.pt")
                parts = {name: open_tables(local, {"tables": lay}) for name, lay in layouts.items()}
                return self._state(rest, parts)
        except (BadInput, KeyError, ValueError, OSError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(
                f"{path} is corrupt or not a recd checkpoint ({type(e).__name__}: "
                f"{first_line(e, 160)}); delete it to resume from the previous checkpoint"
            ) from None

    def _state(self, rest: dict, parts: dict) -> dict:
        live = parts["tables"]

        def accumulators(tables: dict) -> dict:
            return {
                i: {"sum": LazyAccumulator(tables[s.key])} for i, s in enumerate(self.tables.specs)
            }

        early = dict(rest["early"])
        if "best" in parts:  # kept as the loop keeps it: this rank's shards, a copy
            best, specs = parts["best"], self.tables.specs
            weights, sums = self.tables.local_of(
                [best[s.key] for s in specs], [LazyAccumulator(best[s.key]) for s in specs]
            )
            shards = {f"sharded.{k}": w for k, w in enumerate(weights)}
            accs = {k: {"sum": a} for k, a in enumerate(sums)}
            early["best_state"] = {**early.pop("best_dense"), **shards}
            early["best_optimizer"] = {
                "dense": early.pop("best_optimizer_dense"),
                "sparse": {"state": accs, "param_groups": rest["sparse_groups"]},
            }
        return {
            "model": {**rest["model"], **live},
            "optimizer": {
                "dense": rest["optimizer_dense"],
                "sparse": {"state": accumulators(live), "param_groups": rest["sparse_groups"]},
            },
            "step": rest["step"],
            "config": rest["config"],
            "early": early,
        }


@contextlib.contextmanager
def _local(wh: Warehouse, path: str):
    """A checkpoint's directory on the local filesystem (copied from an object store)."""
    if wh.fs.type_name == "local":
        yield Path(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for info in wh.fs.get_file_info(pafs.FileSelector(path, recursive=True)):
            if info.type == pafs.FileType.File:
                target = Path(tmp) / info.path[len(path) + 1 :]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(read_bytes(wh, info.path))
        yield Path(tmp)
