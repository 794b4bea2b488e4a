"""DPP on Ray Data: the same per-split function as the local engine, scheduled by Ray.

Used for scale-out beyond one machine (`ray.init(address=...)` of an existing cluster, via
RAY_ADDRESS at the edge); with no cluster it starts a local instance bound to loopback.
Results come back in split order, so the output equals the local engine's.
"""

from __future__ import annotations


def run_on_ray(args: list[tuple], workers: int) -> list[dict]:
    import ray

    from recd_core.dpp.preprocess import process_split

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
        items = ray.data.from_items(
            [{"split": i} for i in range(len(args))], override_num_blocks=max(1, len(args))
        )

        def run(row: dict) -> dict:
            return {"split": row["split"], **process_split(*args[row["split"]])}

        rows = items.map(run, concurrency=workers, num_cpus=1).take_all()
    finally:
        if started:
            ray.shutdown()
    rows.sort(key=lambda r: r["split"])
    return [{k: v for k, v in r.items() if k != "split"} for r in rows]
