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

The cache's variants (`CACHED`: lookahead k, budget as a share of row-wise's rows, the
prefetch in the background or at the step's start) go under `sharded.bagpipe.steps.`, beside
the plans' figures of the same run: its hit rate, the bytes moved in the background (those
the prefetch group sent while the step before computed), the bytes the step itself sent,
and the model's classification of them. The cache's memory is its capacity.

Where a step's time goes (FlexShard's tables and the cache, means over the steps):
`prepare` (the cache made ready: the background job waited for, the late rows fetched),
`lookup` (forward: ids out, vectors back), `backward` (gradients to the servers, the
write-throughs, the copies' sync, the update), `rest` (the dense model forward and
backward, DDP's all-reduce, the loss); and off the step, in the background thread (on the
same cores): `oracle` (the batches ahead read and planned) and `prefetch` (its fetches).

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
from collections import Counter
from dataclasses import dataclass

import numpy as np

from recd_core.bench.sharded import counted_all_to_all, spawn_ranks
from recd_core.config import FlexShardConfig, TrainConfig
from recd_core.modeling.sharded.bagpipe import CacheBytes, Keyed, cached_bytes
from recd_core.modeling.sharded.flexshard import Traffic, row_wise, table_wise, traffic
from recd_core.runtime import cpu_budget
from recd_core.warehouse import Warehouse

PLANS = ("table_wise", "row_wise", "flexshard")
# BagPipe's cache on FlexShard's default placement: variant -> (lookahead, budget as a share
# of row-wise's rows, prefetch in the background); the first is the default
CACHED = {
    "k4_b25": (4, 0.25, True),
    "k4_b25_at_step": (4, 0.25, False),
    "k1_b25": (1, 0.25, True),
    "k8_b25": (8, 0.25, True),
    "k4_b5": (4, 0.05, True),
    "k4_b100": (4, 1.0, True),
}
MODES = ("dedup", "baseline")
PARTS = ("prepare", "lookup", "backward", "oracle", "prefetch")  # a step's time (module doc)


def measured(
    wh_uri: str, ds: str, worlds=(2, 4), steps: int = 16, cached: tuple = tuple(CACHED)
) -> dict:
    """`sharded.flexshard.steps.<mode>.w<N>.<plan>.*` and `sharded.bagpipe.steps.<mode>.w<N>.
    <variant>.*` for each N of `worlds` (a fresh set of processes each): `cached`, the
    variants of `CACHED`; the first two (the default, in the background and at the step's
    start) at every N, the rest (the sweep) at the smallest."""
    figures: dict = {}
    for world in worlds:
        variants = cached if world == min(worlds) else cached[:2]
        figures |= spawn_ranks(_rank, world, wh_uri, ds, str(steps), ",".join(variants))
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
    reads = [tables.keys_of_parts(store[k], world) for k in range(steps + 1)]
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
    if plan != "table_wise" and plan != "row_wise":
        return model.sharded.placements
    if plan == "row_wise":
        return [row_wise(s.rows, world, world) for s in specs]
    from recd_core.modeling.sharded.plan import plan_table

    where = plan_table(net)
    return [
        table_wise(s.rows, world, world, int(where[s.name].rsplit(" ", 1)[-1].split(",")[0]))
        for s in specs
    ]


def _rank(rank: int, world: int, out: str, wh_uri: str, ds: str, steps: str, cached: str):
    import torch
    import torch.distributed as dist

    from recd_core.dpp.batch_store import BatchStore
    from recd_core.modeling.launch import join_process_group, resolve_device

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
        runs = [(f"sharded.flexshard.steps.{mode}.w{world}.{p}", p, None) for p in PLANS]
        runs += [
            (f"sharded.bagpipe.steps.{mode}.w{world}.{v}", "flexshard", CACHED[v])
            for v in cached.split(",")
            if v
        ]
        for key, plan, cache in runs:
            figures |= _measure(rank, world, device, store, cfg, n, key, plan, cache)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(figures, f)
    dist.barrier()
    dist.destroy_process_group()


def _measure(rank, world, device, store, cfg, n: int, key: str, plan: str, cache) -> dict:
    """One plan (or cache variant) trained n steps after a warm-up: rank 0's figures."""
    import torch
    import torch.distributed as dist

    from recd_core.modeling.sharded.bagpipe_tables import CachedTables
    from recd_core.modeling.sharded.plan import shard_bytes
    from recd_core.modeling.sharded.strategy import FlexSharded, Sharded
    from recd_core.modeling.step import cooccurrence_term, train_step

    torch.manual_seed(cfg.seed)
    dim = cfg.model.embedding_dim
    order = np.arange(len(store))
    if plan == "flexshard":
        strategy = FlexSharded(rank, world, device, store=store)
        c = cfg.model_copy(update={"sharding": "flexshard"})
        if cache is not None:
            k, budget, background = cache
            flex = FlexShardConfig(
                cache_lookahead=k, cache_budget=budget, cache_background=background
            )
            c = c.model_copy(update={"flexshard": flex})
    else:
        strategy = Sharded(rank, world, device)
        c = cfg.model_copy(update={"sharding": plan})
    model = strategy.placed(store.model_features, c)
    net, tables = strategy.net, model.sharded
    opt_dense, fused = strategy.optimizers(model, c, warm=False)
    cached = isinstance(tables, CachedTables)
    times, ints, floats, sync, ahead, parts = [], [], [], [], [], []
    hits = [0, 0]
    for k in range(n + 1):
        aux = cooccurrence_term(model, c, k)
        sent0, timed0 = Counter(getattr(tables, "sent", {})), Counter(getattr(tables, "timed", {}))
        hits0 = (getattr(tables, "hits", 0), getattr(tables, "lookups", 0))
        dist.barrier()
        with counted_all_to_all() as sent:  # this thread's: the step's own exchanges
            t0 = time.perf_counter()
            batch, scale = strategy.step_batch(store, order, k)  # the cache made ready too
            train_step(net, batch, opt_dense, fused, False, aux, scale)
            elapsed = time.perf_counter() - t0
        if k == 0:  # the warm-up
            continue
        delta = Counter(getattr(tables, "sent", {}))
        delta.subtract(sent0)
        spent = Counter(getattr(tables, "timed", {}))
        spent.subtract(timed0)
        times.append(elapsed)
        ints.append(sum(v for d, v in sent.items() if d.startswith("int")))
        floats.append(sum(v for d, v in sent.items() if d.startswith("float")))
        sync.append(delta["sync"])
        ahead.append(delta["prefetch_ids"] + delta["prefetch_rows"])  # the background's
        parts.append([spent[p] for p in PARTS])
        hits[0] += getattr(tables, "hits", 0) - hits0[0]
        hits[1] += getattr(tables, "lookups", 0) - hits0[1]
    means = [statistics.mean(x) for x in (ints, floats, sync, ahead)]
    mine = torch.tensor(
        [*means, statistics.median(times), statistics.mean(times), *np.mean(parts, 0), *hits],
        dtype=torch.float64,
    )
    dist.all_reduce(mine)  # bytes and counts: every rank's sum; times: / world below
    ids, vectors, synced, fetched_ahead, median, mean = mine[:6].tolist()
    part = dict(zip(PARTS, mine[6 : 6 + len(PARTS)].tolist(), strict=True))
    held = shard_bytes(model)
    if cached:
        tables.drain()
    out: dict = {}
    if rank == 0:
        guess = _predicted(
            store, model.sharded.specs, _placements(plan, model, net, world), world, n, dim
        )
        on_step = ids + vectors + synced
        out = {
            f"{key}.id_bytes": ids,
            f"{key}.vector_bytes": vectors,
            f"{key}.sync_bytes": synced,
            f"{key}.bytes": on_step + fetched_ahead,
            f"{key}.predicted_bytes": guess.total,
            f"{key}.step_ms": 1000 * median / world,
            f"{key}.table_bytes_max": int(max(held)),
            f"{key}.steps": n,
        }
        if plan == "flexshard":
            out[f"{key}.step_mean_ms"] = 1000 * mean / world
            for name, seconds in part.items():
                out[f"{key}.{name}_ms"] = 1000 * seconds / world
        if cached:
            g = _predicted_cached(store, tables, world, n, dim, guess.sync)
            out |= {
                f"{key}.on_step_bytes": on_step,
                f"{key}.prefetched_bytes": fetched_ahead,
                f"{key}.hit_rate": float(mine[-2] / max(mine[-1], 1)),
                f"{key}.predicted_bytes": g.total,
                f"{key}.predicted_critical_bytes": g.critical,
                f"{key}.lookahead": tables.lookahead,
                f"{key}.background": tables.worker is not None,
                # the cache's capacity: weights and accumulators of its rows
                f"{key}.cache_bytes": tables.budget_rows * 4 * (dim + 1),
            }
    del net, model, strategy
    return out


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
    return "\n".join(lines) + "\n"


def cache_markdown(f: dict) -> str:
    """docs/results/bagpipe.md's tables of the measured steps: the cache's variants beside
    row-wise and FlexShard without it, then where a step's time goes."""
    worlds = sorted(
        {int(k.split(".w")[1].split(".")[0]) for k in f if k.startswith("sharded.bagpipe.steps.")}
    )
    variants = [v for v in CACHED if any(f".{v}.bytes" in k for k in f)]
    lines = [
        "| mode | procs | plan | bytes/step | on the step | in the background | predicted "
        "(all / critical) | hit rate | step | vs row-wise | cache a rank |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for mode in MODES:
        for world in worlds:
            plans = f"sharded.flexshard.steps.{mode}.w{world}"
            base = f[f"{plans}.row_wise.step_ms"]
            keys = [(p, f"{plans}.{p}") for p in ("row_wise", "flexshard")]
            keys += [(v, f"sharded.bagpipe.steps.{mode}.w{world}.{v}") for v in variants]
            keys = [(name, k) for name, k in keys if f"{k}.bytes" in f]
            for name, k in keys:
                total, step = f[f"{k}.bytes"], f[f"{k}.step_ms"]
                cache = f"{k}.hit_rate" in f
                on_step = f[f"{k}.on_step_bytes"] if cache else total
                lines.append(
                    f"| {mode} | {world} | {name} | {total / 1e6:.2f} MB | {on_step / 1e6:.2f} MB"
                    f" | {f[f'{k}.prefetched_bytes'] / 1e6 if cache else 0:.2f} MB | "
                    + (
                        f"{f[f'{k}.predicted_bytes'] / 1e6:.2f} / "
                        f"{f[f'{k}.predicted_critical_bytes'] / 1e6:.2f} MB | "
                        f"{f[f'{k}.hit_rate']:.0%} | "
                        if cache
                        else f"{f[f'{k}.predicted_bytes'] / 1e6:.2f} MB | - | "
                    )
                    + f"{step:.0f} ms | {step / base - 1:+.0%} | "
                    + (f"{f[f'{k}.cache_bytes'] / 1e6:.1f} MB |" if cache else "- |")
                )
                if name != "row_wise":
                    rows.append((mode, world, name, k))
    lines += [
        "",
        "| mode | procs | plan | step (mean) | prepare | lookup | backward | rest | "
        "in the background: oracle | prefetch |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, world, name, k in rows:
        got = {p: f[f"{k}.{p}_ms"] for p in PARTS}
        mean = f[f"{k}.step_mean_ms"]
        rest = mean - got["prepare"] - got["lookup"] - got["backward"]
        lines.append(
            f"| {mode} | {world} | {name} | {mean:.0f} ms | {got['prepare']:.1f} | "
            f"{got['lookup']:.1f} | {got['backward']:.1f} | {rest:.1f} | {got['oracle']:.1f} | "
            f"{got['prefetch']:.1f} |"
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
    print(cache_markdown(result))
