"""One way to get a Ray instance for the stages that scale out on Ray Data (ingest's parsing,
DPP): the cluster the process is already connected to (`ray.init(address=...)`, or
`RAY_ADDRESS` read by Ray itself at the edge: a KubeRay cluster), else a local instance bound
to loopback with `workers` CPUs, shut down when the work is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


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
