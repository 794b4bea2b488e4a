"""Training speed beside a busy neighbour (`recd bench`'s training part).

A shared machine or a pod under a CPU limit gives a training process less than the cores it
sees. The bench times the dedup and the baseline step (`bench_train`, fewer repeats) while
a neighbour process keeps every core busy with matrix products (a torch process of its own,
at its defaults), twice: with OpenMP threads that wait passively (recd's default,
recd_core/runtime.py) and with threads that spin (`OMP_WAIT_POLICY=ACTIVE`; OpenMP's
default spins for a while, then sleeps). Each in a fresh process, because OpenMP reads the
policy once, when it loads.

Run as a module it prints one timing as JSON:
    python -m recd_core.bench.neighbour WAREHOUSE DS BATCH_SIZE REPEATS
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from recd_core.config import TrainConfig
from recd_core.runtime import owned_child, stop_group
from recd_core.warehouse import Warehouse

NEIGHBOUR = "import torch\nx = torch.randn(1024, 1024)\nwhile True:\n    x @ x\n"
POLICIES = {"passive": "PASSIVE", "spinning": "ACTIVE"}


def neighbour_figures(warehouse: str, ds: str, batch_size: int, repeats: int = 3) -> dict:
    """dedup and baseline step times beside a neighbour, passive and spinning threads."""
    figures = {}
    for name, policy in POLICIES.items():
        env = os.environ | {"OMP_WAIT_POLICY": policy}
        args = [sys.executable, "-m", __name__, warehouse, ds, str(batch_size), str(repeats)]
        out = subprocess.run(
            args, env=env, capture_output=True, text=True, check=False, **owned_child()
        )
        if out.returncode != 0:
            raise RuntimeError(f"neighbour timing ({name}) failed: {out.stderr.strip()[-500:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        figures |= {
            f"train.neighbour.step_ms.dedup.{name}": r["train.step_ms.dedup"],
            f"train.neighbour.step_ms.baseline.{name}": r["train.step_ms.baseline"],
            f"bench.neighbour.train_speedup.{name}": r["bench.train_speedup"],
        }
    return figures


def _timed_beside_neighbour(warehouse: str, ds: str, batch_size: int, repeats: int) -> dict:
    from recd_core.bench.training import bench_train

    table = Warehouse(warehouse).read_range("samples", ds, 0, 5 * batch_size, layout="clustered")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # torch's defaults
    # a busy loop that must not outlive a killed bench: `owned_child`
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], env=env, **owned_child())
    try:
        time.sleep(2)  # until it computes
        return bench_train(table, TrainConfig(batch_size=batch_size), repeats=repeats)
    finally:
        stop_group(neighbour, grace_s=0)


if __name__ == "__main__":
    wh, day, batch, reps = sys.argv[1:5]
    print(json.dumps(_timed_beside_neighbour(wh, day, int(batch), int(reps))))
