"""FlexShard's placement against TorchRec's row-wise and table-wise plans, on a real day's
lookups (modeling/sharded/flexshard.py: the tiers and the traffic model).

Each id-list and sequence table's rows are counted over the day's training batches (the arm's
own: dedup looks a user row up once per group, the baseline once per sample). Then the first
`steps` batches are replayed: step k's batch split over `world` data-parallel ranks as
training splits it (`Batch.part`), each rank's lookups sent through each placement, at 2 to
64 ranks (`per_node` ranks a node), FlexShard within `budget` times the row-wise plan's rows
a rank. The budget is also swept at one size: the bytes bought by each row of memory.

    python -m recd_core.bench.flexshard WAREHOUSE DS OUT.json
"""

from __future__ import annotations

import json
import sys

import numpy as np

from recd_core.dpp.batch_store import Batch, BatchStore
from recd_core.modeling.sharded.flexshard import Traffic, flexshard, row_wise, table_wise, traffic
from recd_core.modeling.sharded.flexshard_tables import id_features
from recd_core.warehouse import Warehouse

WORLDS = (2, 4, 8, 16, 64)
PER_NODE = 8
BUDGET = 1.25  # FlexShard's rows a rank, over the row-wise plan's
SWEEP = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0)
SWEEP_WORLD = 16


def list_tables(features) -> dict[str, tuple[list[str], int]]:
    """{table: (its id-list and sequence features, its rows)}."""
    out: dict[str, tuple[list[str], int]] = {}
    for spec in features.features:
        if spec.kind in ("id_list", "sequence"):
            table = features.table_of(spec.name)
            names, _ = out.get(table, ([], 0))
            out[table] = ([*names, spec.name], int(spec.table_size))
    return out


def lookups(batch: Batch, tables: dict[str, tuple[list[str], int]]) -> dict[str, np.ndarray]:
    """{table: the ids one batch (or a rank's part of it) looks up}: a group's unique rows
    once (dedup), every sample's otherwise."""
    found: dict[str, list[np.ndarray]] = {t: [] for t in tables}
    owner = {n: t for t, (names, _) in tables.items() for n in names}
    for name, ids in id_features(batch):
        if name in owner:
            found[owner[name]].append(ids.numpy().astype(np.int64))
    return {t: np.concatenate(v) if v else np.zeros(0, np.int64) for t, v in found.items()}


def counts(store: BatchStore, tables) -> dict[str, np.ndarray]:
    """Each table's rows' lookups over the day's training batches."""
    out = {t: np.zeros(rows, np.int64) for t, (_, rows) in tables.items()}
    for i in range(len(store)):
        for t, ids in lookups(store[i], tables).items():
            out[t] += np.bincount(ids, minlength=len(out[t]))[: len(out[t])]
    return out


def replay(store: BatchStore, tables, seen, dim: int, world: int, budget: float, steps: int):
    """{plan: (Traffic per step, the fullest rank's rows)} over the first `steps` batches."""
    plans = {}
    for k, (t, (_, rows)) in enumerate(tables.items()):
        floor = -(-rows // world)
        plans[t] = {
            "table_wise": table_wise(rows, world, min(PER_NODE, world), k % world),
            "row_wise": row_wise(rows, world, min(PER_NODE, world)),
            "flexshard": flexshard(
                seen[t], world, min(PER_NODE, world), int(floor * budget), len(store), dim
            ),
        }
    out = {name: Traffic() for name in ("table_wise", "row_wise", "flexshard")}
    n = min(steps, len(store))
    for i in range(n):
        parts = [lookups(store[i].part(r, world), tables) for r in range(world)]
        for t in tables:
            for name, placement in plans[t].items():
                out[name].add(traffic(placement, [p[t] for p in parts], dim))
    memory = {name: int(sum(plans[t][name].rows_per_rank() for t in tables).max()) for name in out}
    return {name: (_per_step(out[name], n), memory[name]) for name in out}


def _per_step(total: Traffic, steps: int) -> Traffic:
    return Traffic(
        *(x / max(steps, 1) for x in (total.ids, total.vectors, total.sync, total.cross))
    )


def run(wh: Warehouse, ds: str, dim: int = 32, steps: int = 20) -> dict:
    figures: dict = {"sharded.flexshard.per_node": PER_NODE, "sharded.flexshard.budget": BUDGET}
    for mode in ("dedup", "baseline"):
        store = BatchStore(wh, ds, mode)
        tables = list_tables(store.model_features)
        seen = counts(store, tables)
        for world in WORLDS:
            for name, (t, rows) in replay(store, tables, seen, dim, world, BUDGET, steps).items():
                key = f"sharded.flexshard.{mode}.w{world}.{name}"
                figures[f"{key}.bytes_per_step"] = t.total
                figures[f"{key}.cross_bytes_per_step"] = t.cross
                figures[f"{key}.sync_bytes_per_step"] = t.sync
                figures[f"{key}.rows_per_rank"] = rows
        for budget in SWEEP:
            got = replay(store, tables, seen, dim, SWEEP_WORLD, budget, steps)["flexshard"]
            key = f"sharded.flexshard.{mode}.sweep.{budget:g}"
            figures[f"{key}.bytes_per_step"] = got[0].total
            figures[f"{key}.cross_bytes_per_step"] = got[0].cross
            figures[f"{key}.rows_per_rank"] = got[1]
    return figures


def markdown(f: dict) -> str:
    """The tables of docs/benchmarks.md's FlexShard section."""
    lines = [
        "| mode | ranks | plan | bytes/step | cross-node bytes/step | cut vs row-wise (all / "
        "cross-node) | rows a rank |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for mode in ("dedup", "baseline"):
        for world in WORLDS:
            base = f"sharded.flexshard.{mode}.w{world}.row_wise"
            for name in ("table_wise", "row_wise", "flexshard"):
                key = f"sharded.flexshard.{mode}.w{world}.{name}"
                cut = 1 - f[f"{key}.bytes_per_step"] / f[f"{base}.bytes_per_step"]
                cross_base = f[f"{base}.cross_bytes_per_step"]
                cross = (
                    f"{1 - f[f'{key}.cross_bytes_per_step'] / cross_base:+.0%}"
                    if cross_base
                    else "-"
                )
                lines.append(
                    f"| {mode} | {world} | {name} | {f[f'{key}.bytes_per_step'] / 1e6:.2f} MB | "
                    f"{f[f'{key}.cross_bytes_per_step'] / 1e6:.2f} MB | {cut:+.0%} / {cross} | "
                    f"{f[f'{key}.rows_per_rank']:,} |"
                )
    lines += [
        "",
        f"FlexShard's budget swept at {SWEEP_WORLD} ranks ({PER_NODE} a node), rows a rank "
        "against bytes a step:",
        "",
        "| mode | budget (x row-wise) | rows a rank | bytes/step | cross-node bytes/step |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in ("dedup", "baseline"):
        for budget in SWEEP:
            key = f"sharded.flexshard.{mode}.sweep.{budget:g}"
            lines.append(
                f"| {mode} | {budget:g} | {f[f'{key}.rows_per_rank']:,} | "
                f"{f[f'{key}.bytes_per_step'] / 1e6:.2f} MB | "
                f"{f[f'{key}.cross_bytes_per_step'] / 1e6:.2f} MB |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    warehouse, day, out = sys.argv[1:4]
    result = run(Warehouse(warehouse), day)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(markdown(result))
