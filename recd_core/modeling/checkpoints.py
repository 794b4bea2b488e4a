"""A training run's checkpoints, and the key that names the run.

    <warehouse>/checkpoints/<run>/step-NNNNNNNN.pt     written atomically, `keep` newest kept
                                 step-NNNNNNNN.dcp/    a sharded run's (`ShardedCheckpoints`)
        {"model": state dict, "optimizer": {"dense", "sparse"} (as the saved model's
         optimizer.pt), "step": steps taken, "config": the TrainConfig JSON,
         "early": EarlyStopping's state (best state, history)}

A run resumes from its latest checkpoint, so a killed run and an uninterrupted one end with
the same weights. The run's key (`run_name`) changes with the day, mode, config, the batches'
write id and the warm start's model: a retry on the same data resumes, other data starts
afresh instead of resuming onto it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import warnings
from dataclasses import dataclass

import pyarrow.fs as pafs

from recd_core.config import TrainConfig
from recd_core.errors import RecdError, first_line
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


class RunBusy(RecdError):
    """Another live process trains the same day and arm in this warehouse (exit 1,
    retryable: the orchestrator's retry comes after it is done)."""


RUN_LOCK_WAIT_S = 60.0  # how long a run waits for a leftover of the same day and arm to end


@contextlib.contextmanager
def one_writer(wh: Warehouse, ds: str, mode: str, wait_s: float | None = None):
    """Hold the day's and arm's training lock for the run (`checkpoints/_locks/`, local
    warehouses): its checkpoints and model have one live writer, so a retry never trains
    beside a leftover of the run it retries. A leftover still ending (its ranks take a
    moment after their parent's SIGTERM) is waited for up to `wait_s`; then `RunBusy`."""
    import fcntl
    import time

    if not wh.locks:  # object stores: one run per day is the orchestrator's (max_active_runs)
        yield
        return
    wait_s = RUN_LOCK_WAIT_S if wait_s is None else wait_s
    path = f"{wh.root}/checkpoints/_locks/{ds}-{mode}.lock"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RunBusy(
                        f"train: another live process is training ds={ds} mode={mode} in "
                        f"{wh.uri} ({path} held for {wait_s:.0f} s): retry once it is done"
                    ) from None
                time.sleep(0.25)
        yield
    finally:
        os.close(fd)  # closing drops the lock


@dataclass
class Checkpoints:
    wh: Warehouse
    run: str
    keep: int

    @property
    def dir(self) -> str:
        return f"{self.wh.root}/checkpoints/{self.run}"

    def list(self) -> list[str]:
        if self.wh.fs.get_file_info(self.dir).type != pafs.FileType.Directory:
            return []
        sweep_files(self.wh.fs, self.dir)  # a killed or failed save's temporary file
        infos = self.wh.fs.get_file_info(pafs.FileSelector(self.dir))
        return sorted(
            i.path for i in infos if i.base_name.startswith("step-") and i.base_name.endswith(".pt")
        )

    def save(self, state: dict) -> str:
        path = f"{self.dir}/step-{state['step']:08d}.pt"
        write_bytes(self.wh, path, torch_bytes(state))
        for old in self.list()[: -self.keep]:
            self.wh.fs.delete_file(old)
        return path

    def latest(self) -> dict | None:
        paths = self.list()
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

        from recd_core.modeling.sharding import to_dcp

        path = self.path(state["step"])
        with tempfile.TemporaryDirectory() as tmp, _quiet_dcp():
            dcp.save(to_dcp(self.tables, state, torch_bytes), checkpoint_id=tmp)
            names = sorted(os.listdir(tmp))
            for name in names:  # this rank's data; rank 0's metadata after everyone's
                if name != ".metadata":
                    write_bytes(self.wh, f"{path}/{name}", _read(f"{tmp}/{name}"))
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

        from recd_core.modeling.sharding import dcp_target, from_dcp

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


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
