"""FlexShard, and FlexShard with BagPipe's oracle cache, trained beside TorchRec's row-wise
and table-wise plans on N processes: the bytes each step sends and its time, measured, and
the models' prediction of the same steps (modeling/sharded/flexshard.py's traffic,
bagpipe.py's cache), so the replays at 8-64 ranks (bench/flexshard.py, bench/bagpipe.py)
rest on models checked where they can be measured.

Each rank reads the day's batches (both arms; FlexShard's placement counts the whole day's
lookups), builds the model under each plan from the same seed and trains `steps` steps after
a warm-up, its slice of each batch as training takes it. Measured, summed over the ranks:

    ids       int bytes sent through all_to_all_single (ids, lengths, splits)
    vectors   float bytes sent through it (vectors forward, gradients backward)
    sync      FlexShard's copies: the touched rows' ids gathered and their gradients
              all-reduced (counted as a ring sends them; TorchRec's plans have none)

With the cache also: its hit rate over the remote reads, the bytes fetched ahead (those a
prefetch during the step before could move: the cache's fetches still run at the step's
start, and the step's time includes them and the oracle's reading of the batches ahead),
and the bytes the model classes as critical. The cache's memory is its capacity.

The dense layers' all-reduce (DDP, the same under every plan) is left out. Predicted: each
rank's lookups of the same steps through each plan's placement (TorchRec's table-wise ranks
read from its plan). The memory: each rank's bytes of tables and accumulators.

    python -m recd_core.bench.flexshard_steps WAREHOUSE DS OUT.json [WORLDS] [STEPS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import numpy as np

from recd_core.bench.sharded import counted_all_to_all, spawn_ranks
from recd_core.config import FlexShardConfig, TrainConfig
from recd_core.modeling.sharded.bagpipe import CacheBytes, Keyed, cached_bytes
from recd_core.modeling.sharded.flexshard import Traffic, row_wise, table_wise, traffic
from recd_core.runtime import cpu_budget
from recd_core.warehouse import Warehouse

PLANS = ("table_wise", "row_wise", "flexshard", "bagpipe")
# `bagpipe`: FlexShard's default placement with each rank's oracle cache of remote rows
CACHE = FlexShardConfig(cache_lookahead=4, cache_budget=0.25)
MODES = ("dedup", "baseline")


def measured(wh_uri: str, ds: str, worlds=(2, 4), steps: int = 16) -> dict:
    """`sharded.flexshard.steps.<mode>.w<N>.<plan>.*` for each N of `worlds` (a fresh set of
    processes each)."""
    figures: dict = {}
    for world in worlds:
        figures |= spawn_ranks(_rank, world, wh_uri, ds, str(steps))
    return figures


def _predicted(store, specs, placements, world: int, steps: int, dim: int) -> Traffic:
    from recd_core.modeling.sharded.flexshard_tables import table_ids

    out = Traffic()
    for k in range(1, steps + 1):
        parts = [table_ids(store[k].part(r, world), specs) for r in range(world)]
        for t, placement in enumerate(placements):
            out.add(traffic(placement, [p[t] for p in parts], dim))
    return Traffic(*(x / steps for x in (out.ids, out.vectors, out.sync, out.cross)))


def _predicted_cached(store, tables, world: int, steps: int, dim: int, sync: float):
    """The oracle cache's bytes a step over steps 1..`steps` (bagpipe.py's model, with the
    rows keyed and budgeted as `tables` hold them; the copies' sync as FlexShard's model
    counts it): `.total` (all bytes), `.critical` (those it classes as critical)."""
    reads = [
        [tables.keys_of_batch(store[k].part(r, world)) for r in range(world)]
        for k in range(steps + 1)
    ]
    placed = Keyed(tables.placements, tables.offsets)

    def run(upto: int) -> CacheBytes:
        return cached_bytes(reads[:upto], placed, dim, tables.lookahead, tables.budget_rows)

    whole, first = run(steps + 1), run(1)  # the warm-up step's bytes left out
    total = whole.critical + whole.prefetched - first.critical - first.prefetched
    critical = whole.critical - first.critical
    return _Cached(total / steps + sync, critical / steps + sync)


@dataclass
class _Cached:
    total: float
    critical: float


def _placements(plan: str, model, net, world: int) -> list:
    specs = model.sharded.specs
    if plan in ("flexshard", "bagpipe"):
        return model.sharded.placements
    if plan == "row_wise":
        return [row_wise(s.rows, world, world) for s in specs]
    from recd_core.modeling.sharded.plan import plan_table

    where = plan_table(net)
    return [
        table_wise(s.rows, world, world, int(where[s.name].rsplit(" ", 1)[-1].split(",")[0]))
        for s in specs
    ]


def _rank(rank: int, world: int, out: str, wh_uri: str, ds: str, steps: str) -> None:
    import torch
    import torch.distributed as dist

    from recd_core.dpp.batch_store import BatchStore
    from recd_core.modeling.launch import join_process_group, resolve_device
    from recd_core.modeling.sharded.plan import shard_bytes
    from recd_core.modeling.sharded.strategy import FlexSharded, Sharded
    from recd_core.modeling.step import cooccurrence_term, train_step

    warnings.filterwarnings("ignore")
    device = join_process_group(rank, world, resolve_device("auto"))
    if device.type == "cpu":
        torch.set_num_threads(max(cpu_budget() // world, 1))
    wh = Warehouse(wh_uri)
    figures: dict = {}
    for mode in MODES:
        store = BatchStore(wh, ds, mode)
        n = min(int(steps), len(store) - 1)  # a small day: its batches after the warm-up
        if n < 1:
            raise ValueError(f"batches/mode={mode}/ds={ds} holds {len(store)} batches: 2 needed")
        cfg = TrainConfig(mode=mode, batch_size=store.manifest["batch_size"])
        cfg = cfg.model_copy(update={"model": cfg.model.for_samples(store.samples())})
        dim = cfg.model.embedding_dim
        order = np.arange(len(store))
        for plan in PLANS:
            torch.manual_seed(cfg.seed)
            flex = plan in ("flexshard", "bagpipe")
            if flex:
                strategy = FlexSharded(rank, world, device, store=store)
                c = cfg.model_copy(update={"sharding": "flexshard"})
                if plan == "bagpipe":
                    c = c.model_copy(update={"flexshard": CACHE})
            else:
                strategy = Sharded(rank, world, device)
                c = cfg.model_copy(update={"sharding": plan})
            model = strategy.placed(store.model_features, c)
            net = strategy.net
            opt_dense, fused = strategy.optimizers(model, c, warm=False)
            times, ints, floats, sync = [], [], [], []
            tables = model.sharded
            counted = {"sync": 0, "fetch_ahead": 0, "hits": 0, "lookups": 0}
            for k in range(n + 1):
                aux = cooccurrence_term(model, c, k)
                before = dict(tables.sent) if flex else {}
                hits = (getattr(tables, "hits", 0), getattr(tables, "lookups", 0))
                dist.barrier()
                with counted_all_to_all() as sent:
                    t0 = time.perf_counter()
                    batch, scale = strategy.step_batch(store, order, k)  # the oracle's too
                    train_step(net, batch, opt_dense, fused, False, aux, scale)
                    elapsed = time.perf_counter() - t0
                if k == 0:  # the warm-up
                    continue
                times.append(elapsed)
                ints.append(sum(v for d, v in sent.items() if d.startswith("int")))
                floats.append(sum(v for d, v in sent.items() if d.startswith("float")))
                after = dict(tables.sent) if flex else {}
                sync.append(after.get("sync", 0) - before.get("sync", 0))
                counted["fetch_ahead"] += after.get("fetch_ahead", 0) - before.get("fetch_ahead", 0)
                counted["hits"] += getattr(tables, "hits", 0) - hits[0]
                counted["lookups"] += getattr(tables, "lookups", 0) - hits[1]
            mine = torch.tensor(
                [
                    statistics.mean(ints),
                    statistics.mean(floats),
                    statistics.mean(sync),
                    statistics.median(times),
                ],
                dtype=torch.float64,
            )
            dist.all_reduce(mine)  # bytes: every rank's sum; time: the ranks' mean
            cache = torch.tensor(
                [counted["fetch_ahead"] / n, counted["hits"], counted["lookups"]],
                dtype=torch.float64,
            )
            dist.all_reduce(cache)
            held = shard_bytes(model)
            if rank == 0:
                key = f"sharded.flexshard.steps.{mode}.w{world}.{plan}"
                guess = _predicted(
                    store, model.sharded.specs, _placements(plan, model, net, world), world, n, dim
                )
                if plan == "bagpipe":
                    guess = _predicted_cached(store, model.sharded, world, n, dim, guess.sync)
                    figures |= {
                        f"{key}.prefetchable_bytes": float(cache[0]),
                        f"{key}.hit_rate": float(cache[1] / max(cache[2], 1)),
                        f"{key}.predicted_critical_bytes": guess.critical,
                        # the cache's capacity: weights and accumulators of its rows
                        f"{key}.cache_bytes": model.sharded.budget_rows * 4 * (dim + 1),
                    }
                figures |= {
                    f"{key}.id_bytes": float(mine[0]),
                    f"{key}.vector_bytes": float(mine[1]),
                    f"{key}.sync_bytes": float(mine[2]),
                    f"{key}.bytes": float(mine[0] + mine[1] + mine[2]),
                    f"{key}.predicted_bytes": guess.total,
                    f"{key}.step_ms": 1000 * float(mine[3]) / world,
                    f"{key}.table_bytes_max": int(max(held)),
                    f"{key}.steps": n,
                }
            del net, model, strategy
    if rank == 0:
        with open(out, "w") as f:
            json.dump(figures, f)
    dist.barrier()
    dist.destroy_process_group()


def markdown(f: dict) -> str:
    """docs/benchmarks.md's table of the measured steps."""
    lines = [
        "| mode | procs | plan | bytes/step (ids + vectors + sync) | predicted | measured / "
        "predicted | cut vs row-wise | step | tables a rank |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    worlds = sorted(
        {
            int(k.split(".w")[1].split(".")[0])
            for k in f
            if k.startswith("sharded.flexshard.steps.") and ".w" in k
        }
    )
    for mode in MODES:
        for world in worlds:
            base = f[f"sharded.flexshard.steps.{mode}.w{world}.row_wise.bytes"]
            for plan in PLANS:
                k = f"sharded.flexshard.steps.{mode}.w{world}.{plan}"
                total = f[f"{k}.bytes"]
                lines.append(
                    f"| {mode} | {world} | {plan} | {total / 1e6:.2f} MB ({f[f'{k}.id_bytes'] / 1e6:.2f}"
                    f" + {f[f'{k}.vector_bytes'] / 1e6:.2f} + {f[f'{k}.sync_bytes'] / 1e6:.2f}) | "
                    f"{f[f'{k}.predicted_bytes'] / 1e6:.2f} MB | "
                    f"{total / max(f[f'{k}.predicted_bytes'], 1):.2f} | {1 - total / base:+.0%} | "
                    f"{f[f'{k}.step_ms']:.0f} ms | {f[f'{k}.table_bytes_max'] / 1e6:.1f} MB |"
                )
    lines += [
        "",
        "BagPipe's cache (FlexShard's placement, lookahead 4, 0.25x row-wise's rows):",
        "",
        "| mode | procs | hit rate | bytes/step, all | fetched ahead (could overlap) | "
        "critical, by the model | cache a rank |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        for world in worlds:
            k = f"sharded.flexshard.steps.{mode}.w{world}.bagpipe"
            if f"{k}.hit_rate" not in f:
                continue
            lines.append(
                f"| {mode} | {world} | {f[f'{k}.hit_rate']:.0%} | {f[f'{k}.bytes'] / 1e6:.2f} MB | "
                f"{f[f'{k}.prefetchable_bytes'] / 1e6:.2f} MB | "
                f"{f[f'{k}.predicted_critical_bytes'] / 1e6:.2f} MB | "
                f"{f[f'{k}.cache_bytes'] / 1e6:.1f} MB |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    warehouse, day, out_path = sys.argv[1:4]
    worlds = tuple(int(w) for w in (sys.argv[4] if len(sys.argv) > 4 else "2,4").split(","))
    n_steps = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    result = measured(warehouse, day, worlds, n_steps)
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(markdown(result))
