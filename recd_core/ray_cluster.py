"""One way to get a Ray instance for the stages that scale out on Ray (ingest's parsing,
generate and DPP on Ray Data, training on Ray Train), and one way to run Ray Data work there
(`ordered_map`). The instance: the cluster the process is already connected to
(`ray.init(address=...)`), the cluster at `RAY_ADDRESS` (Ray's own convention, which
KubeRay's RayJob sets), else a local instance bound to loopback with `workers` CPUs; one the
session started is shut down when the work is done.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def ray_session(workers: int, logs: bool = False) -> Iterator[None]:
    """The Ray instance (module docstring) for the work inside; `logs`: the workers' output
    shown on this process's (a training run's progress), else kept in Ray's log files."""
    import ray

    started = False
    if not ray.is_initialized():
        quiet = {"log_to_driver": logs, "configure_logging": False}
        if os.environ.get("RAY_ADDRESS"):  # a cluster: its resources are its own
            ray.init(**quiet)
        else:
            ray.init(
                num_cpus=workers, include_dashboard=False, _node_ip_address="127.0.0.1", **quiet
            )
        started = True
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def ordered_map(fn: Callable, args: list[tuple], workers: int) -> Iterator:
    """`fn(*a)` for every `a` in `args` as Ray Data tasks (`workers` at a time, one CPU each),
    yielded in the order of `args` as they finish. `fn` must be importable where the tasks
    run (a module-level function); each task's arguments travel in its own item and results
    come back, both pickled, so a worker receives only the arguments of the tasks it runs.
    Inside an open `ray_session`, that instance is used (several maps share one start-up)."""
    import ray

    with ray_session(workers):
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        items = ray.data.from_items(
            [{"args": pickle.dumps(a)} for a in args], override_num_blocks=max(1, len(args))
        )

        def run(row: dict) -> dict:
            return {"out": pickle.dumps(fn(*pickle.loads(row["args"])))}

        for row in items.map(run, concurrency=workers, num_cpus=1).iter_rows():
            yield pickle.loads(row["out"])
