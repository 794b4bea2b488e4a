"""BagPipe's oracle cacher replayed on a day's real lookups (modeling/sharded/bagpipe.py):
each id-list and sequence table's reads of the first `steps` batches, split over `world`
data-parallel ranks as training splits them, through each rank's cache under row-wise and
FlexShard's placements, at 2 to 64 ranks; the lookahead and the cache budget swept at one
size. All tables' ids are keyed as one and each rank has one cache, as training holds it;
its budget is in rows a rank, as a share of the row-wise plan's (0.25: the memory
FlexShard's default budget adds).

    python -m recd_core.bench.bagpipe WAREHOUSE DS OUT.json
"""

from __future__ import annotations

import json
import sys

import numpy as np

from recd_core.bench.flexshard import PER_NODE, counts, list_tables, lookups
from recd_core.dpp.batch_store import BatchStore
from recd_core.modeling.sharded.bagpipe import CacheBytes, Keyed, cached_bytes
from recd_core.modeling.sharded.flexshard import flexshard, row_wise
from recd_core.warehouse import Warehouse

WORLDS = (2, 4, 8, 16, 64)
LOOKAHEAD = 4
BUDGET = 0.25  # cache rows a rank, over the row-wise plan's rows a rank
LOOKAHEADS = (1, 2, 4, 8, 16)
BUDGETS = (0.05, 0.1, 0.25, 0.5, 1.0)
SWEEP_WORLD = 16
# a rank's link where the network is the bottleneck (25 Gb/s, a common cloud NIC), in bytes
# a second: a step's critical-path bytes a rank over it are the time the step waits on them
LINK = 25e9 / 8


def replay(store, tables, seen, dim, world, steps, lookahead, budget, plans=("row_wise",)):
    """{placement: CacheBytes} over the first `steps` batches at `world` ranks, all tables'
    ids keyed as one (`offsets[table] + row`), one cache a rank of `budget` times the
    row-wise plan's rows of them all (as training holds it: bagpipe_tables.py)."""
    n = min(steps, len(store))
    names = list(tables)
    offsets = np.cumsum([0] + [tables[t][1] for t in names])
    reads = []
    for s in range(n):
        step = []
        for r in range(world):
            ids = lookups(store[s].part(r, world), tables)
            step.append(
                np.concatenate([o + ids[t] for o, t in zip(offsets[:-1], names, strict=True)])
            )
        reads.append(step)
    rows = sum(-(-tables[t][1] // world) for t in names)
    out = {}
    for name in plans:
        placements = [
            row_wise(tables[t][1], world, min(PER_NODE, world))
            if name == "row_wise"
            else flexshard(
                seen[t],
                world,
                min(PER_NODE, world),
                int(1.25 * -(-tables[t][1] // world)),
                len(store),
                dim,
            )
            for t in names
        ]
        got = cached_bytes(reads, Keyed(placements, offsets), dim, lookahead, int(budget * rows))
        out[name] = _per_step(got, n)
    return out


def _per_step(b: CacheBytes, steps: int) -> CacheBytes:
    return CacheBytes(
        b.critical / steps, b.prefetched / steps, b.uncached / steps, b.hits, b.remote
    )


def run(wh: Warehouse, ds: str, dim: int = 32, steps: int = 20) -> dict:
    figures: dict = {"sharded.bagpipe.lookahead": LOOKAHEAD, "sharded.bagpipe.budget": BUDGET}
    for mode in ("dedup", "baseline"):
        store = BatchStore(wh, ds, mode)
        tables = list_tables(store.model_features)
        seen = counts(store, tables)

        def put(key: str, b: CacheBytes) -> None:
            figures[f"{key}.critical_bytes_per_step"] = b.critical
            figures[f"{key}.uncached_bytes_per_step"] = b.uncached
            figures[f"{key}.prefetched_bytes_per_step"] = b.prefetched
            figures[f"{key}.hit_rate"] = b.hits / max(b.remote, 1)

        for world in WORLDS:
            got = replay(
                store, tables, seen, dim, world, steps, LOOKAHEAD, BUDGET, ("row_wise", "flexshard")
            )
            for name, b in got.items():
                put(f"sharded.bagpipe.{mode}.w{world}.{name}", b)
        for k in LOOKAHEADS:  # at a budget past one step's rows: the lookahead has room
            b = replay(store, tables, seen, dim, SWEEP_WORLD, steps, k, 1.0)["row_wise"]
            put(f"sharded.bagpipe.{mode}.lookahead.{k}", b)
        for budget in BUDGETS:
            b = replay(store, tables, seen, dim, SWEEP_WORLD, steps, LOOKAHEAD, budget)["row_wise"]
            put(f"sharded.bagpipe.{mode}.budget.{budget:g}", b)
    return figures


def markdown(f: dict) -> str:
    """docs/results/bagpipe.md's tables."""
    head = "| critical path, uncached | with the cache | cut | hit rate | prefetched (overlapped) |"
    rule = "|---:|---:|---:|---:|---:|"

    def cells(key: str) -> str:
        u, c = f[f"{key}.uncached_bytes_per_step"], f[f"{key}.critical_bytes_per_step"]
        return (
            f"{u / 1e6:.2f} MB | {c / 1e6:.2f} MB | {1 - c / max(u, 1):+.0%} | "
            f"{f[f'{key}.hit_rate']:.0%} | {f[f'{key}.prefetched_bytes_per_step'] / 1e6:.2f} MB |"
        )

    def waits(key: str, world: int) -> str:  # a rank's wait on its link, bytes alone
        u, c = f[f"{key}.uncached_bytes_per_step"], f[f"{key}.critical_bytes_per_step"]
        return f" {1e6 * u / world / LINK:.0f} / {1e6 * c / world / LINK:.0f} µs |"

    lines = [
        "| mode | ranks | placement " + head + " a rank's wait at 25 Gb/s, uncached / cached |",
        "|---|---:|---" + rule + "---:|",
    ]
    for mode in ("dedup", "baseline"):
        for world in WORLDS:
            for name in ("row_wise", "flexshard"):
                key = f"sharded.bagpipe.{mode}.w{world}.{name}"
                lines.append(f"| {mode} | {world} | {name} | {cells(key)}{waits(key, world)}")
    lines += ["", f"The lookahead swept ({SWEEP_WORLD} ranks, row-wise, budget 1):", ""]
    lines += ["| mode | lookahead " + head, "|---|---:" + rule]
    for mode in ("dedup", "baseline"):
        for k in LOOKAHEADS:
            lines.append(f"| {mode} | {k} | {cells(f'sharded.bagpipe.{mode}.lookahead.{k}')}")
    lines += ["", f"The budget swept ({SWEEP_WORLD} ranks, row-wise, lookahead {LOOKAHEAD}):", ""]
    lines += ["| mode | budget (x row-wise rows) " + head, "|---|---:" + rule]
    for mode in ("dedup", "baseline"):
        for b in BUDGETS:
            lines.append(f"| {mode} | {b:g} | {cells(f'sharded.bagpipe.{mode}.budget.{b:g}')}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    warehouse, day, out = sys.argv[1:4]
    result = run(Warehouse(warehouse), day)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(markdown(result))
