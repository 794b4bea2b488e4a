"""A training run's checkpoints, and the key that names the run.

    <warehouse>/checkpoints/<run>/step-NNNNNNNN.pt     written atomically, `keep` newest kept
                                 step-NNNNNNNN.rank-R-of-N.pt   a sharded run: one a rank
                                                                (its shards, its states)
        {"model": state dict, "optimizer": {"dense", "sparse"} (as the saved model's
         optimizer.pt), "step": steps taken, "config": the TrainConfig JSON,
         "early": EarlyStopping's state (best state, history)}

A run resumes from its latest checkpoint, so a killed run and an uninterrupted one end with
the same weights. The run's key (`run_name`) changes with the day, mode, config, the batches'
write id and the warm start's model: a retry on the same data resumes, other data starts
afresh instead of resuming onto it."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from recd_core.config import TrainConfig
from recd_core.leftovers import sweep_files
from recd_core.modeling.saved import (
    CheckpointError,
    read_bytes,
    torch_bytes,
    torch_load,
    write_bytes,
)
from recd_core.warehouse import Warehouse


def run_name(ds: str, cfg: TrainConfig, batches_id: str = "") -> str:
    """The training run's key: day, mode, config and the batches partition's write id. A
    retry on the same batches resumes the run's checkpoints; re-preprocessed batches (a new
    write id) start a new run instead of resuming onto other data."""
    key = cfg.model_dump_json(exclude={"device", "threads", "nproc"}) + batches_id
    return f"{ds}-{cfg.mode}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def batches_id(wh: Warehouse, ds: str, mode: str) -> str:
    """The write id of the batches partition a run trains on (part of its key)."""
    return str(wh.manifest("batches", ds, mode=mode).get("write_id", ""))


@dataclass
class Checkpoints:
    """`part`: a sharded run's rank writes and reads its own files (".rank-R-of-N")."""

    wh: Warehouse
    run: str
    keep: int
    part: str = ""

    @property
    def dir(self) -> str:
        return f"{self.wh.root}/checkpoints/{self.run}"

    def list(self) -> list[str]:
        if self.wh.fs.get_file_info(self.dir).type != pafs.FileType.Directory:
            return []
        sweep_files(self.wh.fs, self.dir)  # a killed or failed save's temporary file
        infos = self.wh.fs.get_file_info(pafs.FileSelector(self.dir))
        mine = re.compile(rf"step-\d{{8}}{re.escape(self.part)}\.pt")
        return sorted(i.path for i in infos if mine.fullmatch(i.base_name))

    def others(self) -> list[str]:
        """Checkpoints of this run written by another number of processes (a sharded run's
        parts are its processes' own: resuming needs the same number)."""
        if self.wh.fs.get_file_info(self.dir).type != pafs.FileType.Directory:
            return []
        theirs = re.compile(r"step-\d{8}(\.rank-\d+-of-\d+)?\.pt")
        infos = self.wh.fs.get_file_info(pafs.FileSelector(self.dir))
        mine = set(self.list())
        return sorted(i.path for i in infos if theirs.fullmatch(i.base_name) and i.path not in mine)

    def path(self, step: int) -> str:
        return f"{self.dir}/step-{step:08d}{self.part}.pt"

    def save(self, state: dict) -> str:
        path = self.path(state["step"])
        write_bytes(self.wh, path, torch_bytes(state))
        for old in self.list()[: -self.keep]:
            self.wh.fs.delete_file(old)
        return path

    def steps(self) -> list[int]:
        return [int(p.rsplit("/", 1)[-1][5:13]) for p in self.list()]

    def latest(self, step: int | None = None) -> dict | None:
        """The newest checkpoint (or the one of `step`: the newest every rank has)."""
        paths = self.list() if step is None else [self.path(step)]
        if not paths:
            return None
        state = torch_load(read_bytes(self.wh, paths[-1]), paths[-1])
        if not isinstance(state, dict) or not {"model", "optimizer", "step"} <= state.keys():
            raise CheckpointError(
                f"{paths[-1]} is not a recd checkpoint (keys: {sorted(state)[:6]})"
            )
        return state


def checkpoint_state(model, optimizer: dict, step: int, cfg: TrainConfig, early) -> dict:
    """Everything a resume needs; `optimizer` is laid out as the saved model's optimizer.pt,
    `early` is the run's EarlyStopping."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer,
        "step": step,
        "config": cfg.model_dump_json(),
        "early": early.state(),
    }
