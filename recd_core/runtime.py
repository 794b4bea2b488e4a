"""How recd's processes use the CPUs they are given: set once, before torch loads.

OpenMP's worker threads (torch's intra-op pool) spin for a while after each parallel region,
waiting for the next one, by default. A training step runs hundreds of small ops, so on a
machine that is shared (a neighbour process, a pod under a CPU limit) the spinning threads
take the time slices the working ones need: beside a neighbour process the dedup step
ran an order of magnitude slower with spinning threads than with passive ones
(docs/benchmarks.md, "Training", "Beside a neighbour"). recd therefore asks for passive
waiting unless the environment already says otherwise; idle, that costs the dedup step a
little (the figures: docs/journal.md).

torch sizes its pool by the machine's cores, not by what the process may use: a pod limited
to 2 CPUs on a 64-core node would run 32+ threads in 2 CPUs' time. `cpu_budget` reads the
limit (affinity and the cgroup's CPU quota), and training sizes its pool by it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def quiet_openmp(environ: dict | None = None) -> None:
    """Passive OpenMP waiting for this process and its children, unless already set. Takes
    effect only where torch (libgomp) has not been loaded yet: recd_core calls it on import."""
    env = os.environ if environ is None else environ
    for key, value in OPENMP_DEFAULTS.items():
        env.setdefault(key, value)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 `cpu.max`, v1 `cpu.cfs_quota_us`
    over `cpu.cfs_period_us`), or None where there is none."""
    try:
        v2 = root / "cpu.max"
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpu_budget(root: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup's quota (rounded
    up: a limit of 1.5 CPUs gets 2 threads), at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus or 1, math.ceil(quota))
    return max(int(cpus or 1), 1)


def _parent_death_signal():
    """A call that asks the kernel for a SIGTERM when this process's parent ends (Linux's
    `PR_SET_PDEATHSIG`; True where it took), or None where there is no such call. Loaded
    here, so the call itself imports nothing (it may run between fork and exec)."""

    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG


def die_with_parent(parent: int) -> None:
    """End this process when `parent` (the process that started it) ends: a SIGTERM to a
    `recd` command (a pod stopped, an Airflow task timed out) must not leave its training
    ranks or DPP workers running under PID 1, writing into a run a retry is using. Linux:
    the kernel sends SIGTERM at the parent's death (`PR_SET_PDEATHSIG`); elsewhere a
    thread watches the parent. A parent already gone: this process ends now."""

    ask = _parent_death_signal()
    if ask is None or not ask():

        def watch() -> None:

            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(143)

        threading.Thread(target=watch, name="recd-watch-parent", daemon=True).start()
    if os.getppid() != parent:  # died before the watch was set
        os._exit(143)


def owned_child() -> dict:
    """`subprocess.Popen`'s keywords for a child that must not outlive this process (a
    benchmark's scoring server, its busy neighbour): its own process group, so `stop_group`
    ends what it started too, and on Linux a SIGTERM from the kernel when the thread that
    starts it ends, however it ends (SIGKILL, a test's timeout) where a `finally` never
    runs. Call from the thread that outlives the child (the main thread)."""
    parent = os.getpid()
    ask = _parent_death_signal()
    if ask is None:
        return {"start_new_session": True}

    def set_parent_death_signal() -> None:  # in the child, between fork and exec
        ask()
        if os.getppid() != parent:  # the parent died before the signal was set
            os._exit(143)

    return {"start_new_session": True, "preexec_fn": set_parent_death_signal}


def stop_group(child, grace_s: float = 30) -> None:
    """End a child started with `owned_child` and every process it started: SIGTERM to its
    group, SIGKILL after `grace_s`."""

    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        try:
            child.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
    child.wait()


def _status_kb(field: str) -> int | None:
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def rss() -> int | None:
    """This process's resident set now (bytes; None where /proc is not Linux's)."""
    return _status_kb("VmRSS")


def peak_rss() -> int | None:
    """This process's peak resident set since it started or since `reset_peak_rss`."""
    return _status_kb("VmHWM")


def reset_peak_rss() -> bool:
    """Start the peak resident set afresh (Linux: /proc/self/clear_refs), so a stage run in a
    process that ran others reports its own peak; whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def launched_rank() -> int | None:
    """This process's rank when `torchrun` started it (its RANK and WORLD_SIZE), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def follower() -> bool:
    """A process `torchrun` started as a rank other than 0 (on this machine or another): it
    does its share of a stage's work; rank 0 records the stage and reports it."""
    rank = launched_rank()
    return rank is not None and rank != 0
