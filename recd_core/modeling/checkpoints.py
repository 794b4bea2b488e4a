"""A training run's checkpoints, and the key that names the run.

    <warehouse>/checkpoints/<run>/step-NNNNNNNN.pt     written atomically, `keep` newest kept
                                 step-NNNNNNNN/        a sharded run's (sharded/checkpoints.py)
        {"model": state dict, "optimizer": {"dense", "sparse"} (as the saved model's
         optimizer.pt), "step": steps taken, "config": the TrainConfig JSON,
         "early": EarlyStopping's state (best state, history)}

A run resumes from its latest checkpoint, so a killed run and an uninterrupted one end with
the same weights. The run's key (`run_name`) changes with the day, mode, config, the batches'
write id and the warm start's model: a retry on the same data resumes, other data starts
afresh instead of resuming onto it."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import time
from dataclasses import dataclass

import pyarrow.fs as pafs

from recd_core.config import TrainConfig
from recd_core.errors import RecdError
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
    where = {"device", "threads", "nproc", "engine", "max_failures"}
    # not where it runs (resumed anywhere); the saved layout is in it: a model asked for in
    # another layout is another model directory, never one a registered version names
    key = cfg.model_dump_json(exclude=where) + batches_id
    return f"{ds}-{cfg.mode}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def batches_id(wh: Warehouse, ds: str, mode: str) -> str:
    """The write id of the batches partition a run trains on (part of its key)."""
    return str(wh.manifest("batches", ds, mode=mode).get("write_id", ""))


class RunBusy(RecdError):
    """Another live process trains the same day and arm in this warehouse (exit 1,
    retryable: the orchestrator's retry comes after it is done)."""


WAIT_SAY_EVERY_S = 30.0  # a waiting run says so this often (a task log never goes quiet)


@contextlib.contextmanager
def one_writer(wh: Warehouse, ds: str, mode: str, wait_s: float | None = None, say=None):
    """Hold the day's and arm's training lock for the run (`checkpoints/_locks/`, local
    warehouses): its checkpoints and model have one live writer. Another run of the same day
    and arm (a manual run beside the scheduled one, a retry beside a leftover still ending)
    waits while the holder lives, saying so every `WAIT_SAY_EVERY_S` through `say` (no
    error: the holder's model is what it then finds, `train`), and takes the lock when the
    holder ends: the kernel drops a dead holder's lock, so nothing waits on a crash.
    `wait_s`: give up after that long instead (`RunBusy`, retryable)."""

    if not wh.locks:  # object stores: one run per day is the orchestrator's (max_active_runs)
        yield
        return
    path = f"{wh.root}/checkpoints/_locks/{ds}-{mode}.lock"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    say = say or functools.partial(print, flush=True)  # a task log shows it as it comes
    start = time.monotonic()
    said = None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if wait_s is not None and waited > wait_s:
                    raise RunBusy(
                        f"train: another live process is training ds={ds} mode={mode} in "
                        f"{wh.uri} ({path} held for {wait_s:.0f} s): retry once it is done"
                    ) from None
                if said is None or waited - said >= WAIT_SAY_EVERY_S:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    say(
                        f"train {ds} {mode}: another run (pid {holder}) is training this day "
                        f"and arm; waiting for it ({waited:.0f} s so far), then using its model"
                    )
                    said = waited
                time.sleep(0.25)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # who holds it, for a waiting run to say
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
