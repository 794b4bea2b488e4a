"""DPP on Ray Data: the same per-split function as the local engine, scheduled by Ray.

Used for scale-out beyond one machine (the cluster `ray_cluster.ray_session` finds, or a
local instance bound to loopback).
Results come back in split order, so the output equals the local engine's.
"""

from __future__ import annotations


def run_on_ray(args: list[tuple], workers: int) -> list[dict]:
    import ray

    from recd_core.dpp.preprocess import process_split
    from recd_core.ray_cluster import ray_session

    with ray_session(workers):
        items = ray.data.from_items(
            [{"split": i} for i in range(len(args))], override_num_blocks=max(1, len(args))
        )

        def run(row: dict) -> dict:
            return {"split": row["split"], **process_split(*args[row["split"]])}

        rows = items.map(run, concurrency=workers, num_cpus=1).take_all()
    rows.sort(key=lambda r: r["split"])
    return [{k: v for k, v in r.items() if k != "split"} for r in rows]
