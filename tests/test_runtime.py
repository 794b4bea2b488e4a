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
