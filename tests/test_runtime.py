"""How recd's processes use their CPUs: passive OpenMP waiting, threads from the quota."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from recd_core.runtime import cgroup_cpu_quota, cpu_budget


def _omp_policy(env: dict) -> str:
    code = "import recd_core, os; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.strip()


def test_importing_recd_makes_openmp_wait_passively_unless_the_user_chose():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _omp_policy(env) == "PASSIVE"
    assert _omp_policy(env | {"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


def test_a_cgroup_cpu_limit_caps_the_threads(tmp_path: Path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a pod limited to 1.5 CPUs
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert cpu_budget(tmp_path) == min(2, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no limit: the affinity
    assert cgroup_cpu_quota(tmp_path) is None
    assert cpu_budget(tmp_path) == len(os.sched_getaffinity(0))
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_budget(v1) == 1


SERVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:  # a zombie (killed, not yet reaped) is gone for a user
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int, within_s: float = 20) -> bool:
    import time

    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_benchs_server_ends_with_the_bench_even_when_the_bench_is_killed():
    """A bench killed where no `finally` runs (SIGKILL, a test's timeout) must not leave its
    scoring server running; stopped the normal way, the server's own children end too."""
    import signal

    bench = f"""
import subprocess, sys, time
from recd_core.runtime import owned_child
server = subprocess.Popen([sys.executable, "-c", {SERVER!r}], stdout=subprocess.PIPE,
                          text=True, **owned_child())
print(server.pid, server.stdout.readline().strip(), flush=True)
time.sleep(300)
"""
    parent = subprocess.Popen([sys.executable, "-c", bench], stdout=subprocess.PIPE, text=True)
    server, _ = map(int, parent.stdout.readline().split())
    assert _alive(server)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _gone(server), "the server outlived the killed bench"
    os.killpg(server, signal.SIGKILL)  # its own child, orphaned: the kernel signals one level

    from recd_core.runtime import owned_child, stop_group

    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, **owned_child()
    )
    grandchild = int(server.stdout.readline())
    stop_group(server)
    assert not _alive(server.pid) and _gone(grandchild), "the server's child outlived it"
