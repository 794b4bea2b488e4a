"""One way to get a Ray instance for the stages that scale out on Ray Data (ingest's parsing,
generate, DPP), and one way to run their work there (`ordered_map`). The instance: the
cluster the process is already connected to (`ray.init(address=...)`, or `RAY_ADDRESS` read
by Ray itself at the edge: a KubeRay cluster), else a local instance bound to loopback with
`workers` CPUs, shut down when the work is done.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def ray_session(workers: int) -> Iterator[None]:
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(
            num_cpus=workers,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            configure_logging=False,
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
