"""Where training runs: the device, and the processes of a data-parallel run.

`nproc > 1` spawns that many workers (gloo on CPU, nccl on CUDA), or a run launched by
`torchrun` joins its process group, on one machine or across several (a Kubeflow Trainer
TrainJob's nodes, or each bare host's `torchrun --nnodes N --rdzv-backend c10d`); Ray
Train's workers likewise (`ray_engine.py`): every rank runs the same `recd train`; rank 0
writes checkpoints and the model, and its summary and MLflow record are the run's
(`follower`: the other ranks record nothing)."""

from __future__ import annotations

import json
import os
import resource
import socket
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from recd_core.config import TrainConfig
from recd_core.errors import BadInput
from recd_core.runtime import die_with_parent, launched_rank, peak_rss

# worker(rank, world, warehouse URI, ds, cfg, init_from, init_label) -> summary
Worker = Callable[[int, int, str, str, TrainConfig, str | None, str | None], dict]


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def join_process_group(rank: int, world: int, device: torch.device) -> torch.device:
    """This rank's device, after joining the run's process group (nccl on CUDA, one GPU a
    rank; gloo on CPU). A one-process run joins nothing."""
    if world <= 1:
        return device
    if device.type == "cuda":  # one GPU a process of its machine (torchrun's LOCAL_RANK)
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if dist.is_initialized():  # joined already by the engine that started it (Ray Train)
        return device
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world
    )
    return device


def every_rank(value, world: int) -> list:
    """`value` of every rank, in rank order (a collective in a run of several processes)."""
    if world <= 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def leave_process_group(world: int) -> None:
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def peak_mem(device: torch.device) -> int:
    """Peak memory: CUDA's allocator peak, or this process's peak resident set. VmHWM belongs
    to the address space, which exec replaces; ru_maxrss survives fork+exec and would report
    a big parent's peak in a freshly spawned child."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = peak_rss()
    return (
        peak if peak is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    )


def launch(
    worker: Worker,
    nproc: int,
    wh_uri: str,
    ds: str,
    cfg: TrainConfig,
    init_from: str | None,
    init_label: str | None,
) -> dict:
    """Run `worker` in this process (one process, or a rank `torchrun` started) or in
    `nproc` spawned ones; returns rank 0's summary."""
    if launched_rank() is not None:  # launched by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return worker(rank, world, wh_uri, ds, cfg, init_from, init_label)
    if nproc <= 1:
        return worker(0, 1, wh_uri, ds, cfg, init_from, init_label)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = f"{tmp}/rank0.json"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        mp.start_processes(
            _spawned,
            args=(
                nproc,
                worker,
                result,
                wh_uri,
                ds,
                cfg.model_dump_json(),
                init_from,
                init_label,
                os.getpid(),
            ),
            nprocs=nproc,
            start_method="spawn",
        )
        with open(result) as f:
            out = json.load(f)
        if "refused" in out:  # a bad input every rank met (e.g. no placement of the tables)
            raise BadInput(out["refused"])
        return out


def _spawned(
    rank: int,
    world: int,
    worker: Worker,
    result: str,
    wh_uri: str,
    ds: str,
    cfg_json: str,
    init_from: str | None,
    init_label: str | None,
    parent: int,
) -> None:
    """A rank; it ends with the process that spawned it (a SIGTERM to `recd train` stops
    every rank: `runtime.die_with_parent`); a bad input (`BadInput`) comes back as its one
    line, not a traceback."""
    die_with_parent(parent)
    try:
        summary = worker(
            rank,
            world,
            wh_uri,
            ds,
            TrainConfig.model_validate_json(cfg_json),
            init_from,
            init_label,
        )
    except BadInput as e:
        summary = {"refused": str(e)}
    if rank == 0:
        with open(result, "w") as f:
            json.dump(summary, f)


def free_port() -> int:
    """A TCP port free on this machine now (a rendezvous, a server a test or bench starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
