"""FlexShard trained beside TorchRec's row-wise and table-wise plans on N processes: the bytes
each step sends and its time, measured, and the traffic model's prediction of the same steps
(modeling/sharded/flexshard.py), so the replay at 8-64 ranks (bench/flexshard.py) rests on a
model checked where it can be measured.

Each rank reads the day's batches (both arms; FlexShard's placement counts the whole day's
lookups), builds the model under each plan from the same seed and trains `steps` steps after
a warm-up, its slice of each batch as training takes it. Measured, summed over the ranks:

    ids       int bytes sent through all_to_all_single (ids, lengths, splits)
    vectors   float bytes sent through it (vectors forward, gradients backward)
    sync      FlexShard's copies: the touched rows' ids gathered and their gradients
              all-reduced (counted as a ring sends them; TorchRec's plans have none)

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

from recd_core.bench.sharded import counted_all_to_all, spawn_ranks
from recd_core.config import TrainConfig
from recd_core.modeling.sharded.flexshard import Traffic, row_wise, table_wise, traffic
from recd_core.runtime import cpu_budget
from recd_core.warehouse import Warehouse

PLANS = ("table_wise", "row_wise", "flexshard")
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


def _placements(plan: str, model, net, world: int) -> list:
    specs = model.sharded.specs
    if plan == "flexshard":
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
        for plan in PLANS:
            torch.manual_seed(cfg.seed)
            if plan == "flexshard":
                strategy = FlexSharded(rank, world, device, store=store)
            else:
                strategy = Sharded(rank, world, device)
            c = cfg.model_copy(update={"sharding": plan})
            model = strategy.placed(store.model_features, c)
            net = strategy.net
            opt_dense, fused = strategy.optimizers(model, c, warm=False)
            times, ints, floats, sync = [], [], [], []
            for k in range(n + 1):
                whole = store[k]
                batch = whole.part(rank, world).to(device)
                scale = world * batch.size / whole.size
                aux = cooccurrence_term(model, c, k)
                before = model.sharded.sent["sync"] if plan == "flexshard" else 0
                dist.barrier()
                with counted_all_to_all() as sent:
                    t0 = time.perf_counter()
                    train_step(net, batch, opt_dense, fused, False, aux, scale)
                    elapsed = time.perf_counter() - t0
                if k == 0:  # the warm-up
                    continue
                times.append(elapsed)
                ints.append(sum(v for d, v in sent.items() if d.startswith("int")))
                floats.append(sum(v for d, v in sent.items() if d.startswith("float")))
                after = model.sharded.sent["sync"] if plan == "flexshard" else 0
                sync.append(after - before)
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
            held = shard_bytes(model)
            if rank == 0:
                key = f"sharded.flexshard.steps.{mode}.w{world}.{plan}"
                guess = _predicted(
                    store, model.sharded.specs, _placements(plan, model, net, world), world, n, dim
                )
                figures |= {
                    f"{key}.id_bytes": float(mine[0]),
                    f"{key}.vector_bytes": float(mine[1]),
                    f"{key}.sync_bytes": float(mine[2]),
                    f"{key}.bytes": float(mine[0] + mine[1] + mine[2]),
                    f"{key}.predicted_bytes": guess.total,
                    f"{key}.predicted_vector_bytes": guess.vectors,
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
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    warehouse, day, out_path = sys.argv[1:4]
    worlds = tuple(int(w) for w in (sys.argv[4] if len(sys.argv) > 4 else "2,4").split(","))
    n_steps = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    result = measured(warehouse, day, worlds, n_steps)
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(markdown(result))
