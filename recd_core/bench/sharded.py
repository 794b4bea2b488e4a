"""Sharded tables (`recd bench`'s training part): what TorchRec's all-to-alls carry and what
a step costs, dedup vs baseline, with the tables sharded across N processes (gloo on CPU,
nccl on CUDA), and a table larger than a process's memory budget.

communication   each rank sends, per step, through `all_to_all_single` (counted by
                `counted_all_to_all`): ids and lengths (the input
                distribution) and vectors (the output distribution, forward, and their
                gradients, backward). Both modes train their own copy of one model on the
                same batches, each rank its slice; the dedup arm sends a group's unique
                rows, the baseline every sample's. Beside it the batches' dedup factor
                (samples a unique user row) over the ranks' slices.
over budget     the items table enlarged until it alone exceeds `budget_mb` (its ids stay
                the day's), placed by the planner within the budget (`auto`) on N
                processes, a few steps; each rank's table bytes, its resident set before
                the tables were placed (the runtime, the batches, the dense layers) and its
                peak. The same budget at half size: the one-line refusal.
pipeline        `recd run`, two days, from a config alone (`big_table_config`: the items
                table past the budget, 2 processes, row-wise): day one trained, scored,
                registered and promoted, day two warm-started from that champion; each
                training rank's peak over what it held first, each scoring stage's, the
                model's largest file against the table; then the champion served (`recd
                serve models:/...@champion`), 100 rows a request: its memory idle and at
                peak.

Run as a module it writes the figures of one part as JSON (a fresh process per part, as
each spawns its ranks):
    python -m recd_core.bench.sharded comm|budget SAMPLES.parquet CFG_JSON OUT.json
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import yaml

from recd_core.config import TrainConfig
from recd_core.config_files import load_feature_set
from recd_core.modeling.tables import TableSpec
from recd_core.runtime import cpu_budget, rss
from recd_core.warehouse import Warehouse

SHARDINGS = ("table_wise", "row_wise")


def sharded_figures(table_path: str, cfg_json: str, budget_mb: int = 400) -> dict:
    """The four parts, the three with processes of their own in fresh ones (the module)."""
    figures = pipeline_figures() | verify_figures()
    for part, arg in (("comm", cfg_json), ("budget", str(budget_mb))):
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/figures.json"
            cmd = [sys.executable, "-m", __name__, part, table_path, arg, out]
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"sharded bench ({part}) failed: {r.stderr.strip()[-800:]}")
            with open(out) as f:
                figures |= json.load(f)
    return figures


PIPELINE_BUDGET_MB = 256
PIPELINE_ITEMS_ROWS = 3_000_000  # x 33 float32 (32 weights, 1 accumulator): 396 MB


def big_table_config(rows: int = PIPELINE_ITEMS_ROWS, budget_mb: int = PIPELINE_BUDGET_MB) -> dict:
    """A pipeline config (YAML's content) whose items table of `rows` rows is past the
    per-process budget: the small synthetic days, 2 processes, row-wise shards. No
    validation slice and no pass restarts: each would keep another copy of every rank's
    shards, and the budget would hold a third of the tables (docs/operations.md)."""

    features = load_feature_set("synthetic").model_dump(mode="json")
    for f in features["features"]:
        if f.get("table") == "items":
            f["table_size"] = rows
    return {
        "features": features,
        "synth": {"users": 400, "items": 2000, "samples_per_day": 4000},
        "preprocess": {"validation_fraction": 0.0},
        "train": {
            "nproc": 2,
            "sharding": "row_wise",
            "memory_budget_mb": budget_mb,
            "restart_tables": False,
            "epochs": 2,
        },
    }


def pipeline_days(root: str, days: tuple[str, str] = ("2026-11-01", "2026-11-02")) -> list[dict]:
    """`recd run` for two days with `big_table_config` under `root` (SQLite MLflow): each
    day's summary. Raises with the command's last lines if one fails."""

    config = Path(root, "big-table.yaml")
    config.write_text(yaml.safe_dump(big_table_config()))
    exe = Path(sys.executable).parent / "recd"
    out = []
    for ds in days:
        summary = Path(root, f"{ds}.json")
        cmd = [
            exe,
            "--tracking-uri",
            f"sqlite:///{root}/mlflow.db",
            "run",
            "--warehouse",
            f"{root}/wh",
            "--logs",
            f"{root}/logs",
            "--out",
            f"{root}/out",
            "--config",
            config,
            "--ds",
            ds,
            "--summary",
            summary,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"recd run {ds} (big table) failed: {r.stderr.strip()[-800:]}")
        out.append(json.loads(summary.read_text()))
    return out


def serve_champion(root: str, ds: str, rows: int = 100) -> dict:
    """The champion of `pipeline_days` under `root` served by `recd serve` (through MLflow's
    registry, as the chart serves it), `rows` of day `ds`'s samples a request: the server's
    memory idle and at its peak, the median latency."""
    from recd_core.bench.serving import recd_serve_cmd, run_server
    from recd_core.mlops.pyfunc import NON_FEATURE_COLUMNS
    from recd_core.modeling.launch import free_port

    table = Warehouse(f"{root}/wh").read_range("samples", ds, 0, rows, layout="clustered")
    keep = [c for c in table.column_names if c not in NON_FEATURE_COLUMNS]
    body = json.dumps(
        {
            "dataframe_split": {
                "columns": keep,
                "data": [[r[c] for c in keep] for r in table.select(keep).to_pylist()],
            }
        }
    ).encode()
    port = free_port()
    served = run_server(
        recd_serve_cmd("models:/recd-dlrm@champion", port),
        port,
        {rows: 5},
        {rows: body},
        {"MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db"},
    )
    return {
        "sharded.pipeline.serve_idle_bytes": served["rss_idle"],
        "sharded.pipeline.serve_peak_bytes": served[rows]["peak_rss"],
        "sharded.pipeline.serve_p50_ms": served[rows]["p50_ms"],
        "sharded.pipeline.serve_rows": rows,
    }


def pipeline_figures() -> dict:
    """The `pipeline` part (see the module)."""

    with tempfile.TemporaryDirectory() as root:
        days = pipeline_days(root)
        figures = {
            "sharded.pipeline.budget_mb": PIPELINE_BUDGET_MB,
            "sharded.pipeline.table_bytes": PIPELINE_ITEMS_ROWS * 32 * 4,
        }
        figures |= serve_champion(root, days[-1]["eval.ds"])
        for k, day in enumerate(days, 1):
            files = [
                p.stat().st_size for p in Path(day["train.model_uri"]).rglob("*") if p.is_file()
            ]
            grown = [
                peak - before
                for before, peak in zip(
                    day["train.rss_before_model_bytes_per_rank"],
                    day["train.peak_mem_bytes_per_rank"],
                    strict=True,
                )
            ]
            figures |= {
                f"sharded.pipeline.day{k}.saved_layout": day["train.saved_layout"],
                f"sharded.pipeline.day{k}.init": day["train.init_from"] or "scratch",
                f"sharded.pipeline.day{k}.decision": day["registry.decision"],
                f"sharded.pipeline.day{k}.shard_bytes_per_rank": day["train.shard_bytes_per_rank"],
                f"sharded.pipeline.day{k}.rank_runtime_bytes": day[
                    "train.rss_before_model_bytes_per_rank"
                ],
                f"sharded.pipeline.day{k}.rank_grown_bytes": grown,
                f"sharded.pipeline.day{k}.largest_file_bytes": max(files),
                **{
                    f"sharded.pipeline.day{k}.{st}_grown_bytes": day[f"{st}.peak_rss_bytes"]
                    - day[f"{st}.start_rss_bytes"]
                    for st in ("evaluate", "register")
                },
            }
    return figures


VERIFY_ROWS = 4_096_000  # the over-budget part's items table


def verify_figures(rows: int = VERIFY_ROWS, dim: int = 32, world: int = 2) -> dict:
    """What verifying a saved model's shard files costs (shard_files.py: size, box, CRC-32
    of every file), on a table of `rows` x `dim` saved row-wise by `world` ranks with its
    accumulators: a plain sequential read of the same files beside it (the floor any
    reader of every byte pays), the verified open, the private open a server makes (copy
    and check in one pass), and reading the whole table through the maps afterwards (what
    a warm start's placement reads). Page cache warm for each, as after the save."""

    import torch

    from recd_core.modeling.shard_files import layout, open_tables, write_shard

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as root:
        table, acc = torch.randn(rows, dim), torch.rand(rows)
        step = -(-rows // world)  # rows a rank's shard, the last one's the rest
        cut = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
        entries = [
            (
                "t.weight",
                write_shard(
                    pafs.LocalFileSystem(),
                    root,
                    "t",
                    (r0, 0, r1 - r0, dim),
                    table[r0:r1],
                    acc[r0:r1],
                ),
            )
            for r0, r1 in cut
        ]
        meta = {
            "tables": layout(dim, world, [TableSpec("t", rows, ("f",), "t.weight", 0.05)], entries)
        }
        del table, acc
        files = sorted(Path(root, "tables").iterdir())
        size = sum(f.stat().st_size for f in files)

        def read_all() -> None:
            for f in files:
                with open(f, "rb") as src:
                    while src.read(1 << 23):
                        pass

        read_all()  # the cache as a reader after the save finds it
        read_s = min(timed(read_all) for _ in range(3))
        verify_s = min(timed(lambda: open_tables(Path(root), meta)) for _ in range(3))
        with tempfile.TemporaryDirectory() as copies:
            private_s = timed(lambda: open_tables(Path(root), meta, Path(copies)))
        (lazy,) = open_tables(Path(root), meta).values()
        whole_s = timed(lazy.materialize)
    return {
        "sharded.verify.rows": rows,
        "sharded.verify.dim": dim,
        "sharded.verify.bytes": size,
        "sharded.verify.read_s": read_s,
        "sharded.verify.verify_s": verify_s,
        "sharded.verify.private_s": private_s,
        "sharded.verify.materialize_s": whole_s,
    }


def spawn_ranks(fn, nproc: int, *args) -> dict:
    """`fn(rank, nproc, out, *args)` on `nproc` spawned processes: the figures rank 0
    wrote to `out` (JSON)."""
    import torch.multiprocessing as mp

    from recd_core.modeling.launch import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank0.json"
        mp.start_processes(fn, args=(nproc, out, *args), nprocs=nproc, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def _rank_setup(rank: int, world: int):
    """This rank in the process group, and the run's strategy for the tables sharded
    (modeling/sharded/strategy.py: what `recd train` uses)."""

    import torch

    from recd_core.modeling.launch import join_process_group, resolve_device
    from recd_core.modeling.sharded.strategy import Sharded

    warnings.filterwarnings("ignore")
    device = join_process_group(rank, world, resolve_device("auto"))
    if device.type == "cpu":
        torch.set_num_threads(max(cpu_budget() // world, 1))
    return device, Sharded(rank, world, device)


def _comm_rank(
    rank: int, world: int, out: str, table_path: str, cfg_json: str, steps: int = 5
) -> None:
    import torch
    import torch.distributed as dist

    from recd_core.bench.training import _batches
    from recd_core.modeling.step import cooccurrence_term, train_step

    device, strategy = _rank_setup(rank, world)
    cfg = TrainConfig.model_validate_json(cfg_json)
    table = pq.read_table(table_path)
    features, _, dedup, base = _batches(table, cfg, steps + 1, torch.device("cpu"))
    parts = {
        "dedup": [b.part(rank, world).to(device) for b in dedup],
        "baseline": [b.part(rank, world).to(device) for b in base],
    }
    factors = [b.size / ik.num_unique for b in parts["dedup"] for ik in b.groups.values()]
    figures: dict = {
        "sharded.world": world,
        "sharded.device": str(device),
        "sharded.batch_size": cfg.batch_size,
        "sharded.dedup_factor_per_rank": statistics.mean(factors),
    }
    for sharding in SHARDINGS:
        c = cfg.model_copy(update={"sharding": sharding})
        for mode, batches in parts.items():
            model = strategy.placed(features, c)
            net = strategy.net
            opt_dense, fused = strategy.optimizers(model, c, warm=False)
            train_step(
                net, batches[0], opt_dense, fused, False, cooccurrence_term(model, c, 0)
            )  # warm-up
            times, sent = [], []
            for k, b in enumerate(batches[1:], 1):
                aux = cooccurrence_term(model, c, k)
                dist.barrier()
                with counted_all_to_all() as counter:
                    t0 = time.perf_counter()
                    train_step(net, b, opt_dense, fused, False, aux)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - t0)
                sent.append(counter)
            key = f"sharded.{sharding}.{mode}"
            ids = [sum(v for k, v in s.items() if k.startswith("int")) for s in sent]
            vectors = [sum(v for k, v in s.items() if not k.startswith("int")) for s in sent]
            mine = torch.tensor(
                [statistics.mean(ids), statistics.mean(vectors), statistics.median(times)],
                dtype=torch.float64,
            )
            total = mine.clone()
            dist.all_reduce(total)  # bytes: every rank's sum; time: the ranks' mean
            figures[f"{key}.id_bytes_per_step"] = float(total[0])
            figures[f"{key}.vector_bytes_per_step"] = float(total[1])
            figures[f"{key}.step_ms"] = 1000 * float(total[2]) / world
            del net, model
    if rank == 0:
        with open(out, "w") as f:
            json.dump(figures, f)
    dist.barrier()
    dist.destroy_process_group()


def _budget_rank(
    rank: int, world: int, out: str, table_path: str, budget: str, steps: int = 3
) -> None:
    import torch
    import torch.distributed as dist

    from recd_core.bench.training import _batches
    from recd_core.modeling.launch import peak_mem
    from recd_core.modeling.sharded.model import ShardedDLRM
    from recd_core.modeling.sharded.plan import ShardingRefused, plan_table, shard, shard_bytes
    from recd_core.modeling.step import cooccurrence_term, train_step

    device, strategy = _rank_setup(rank, world)
    budget_mb = int(budget)
    cfg = TrainConfig(batch_size=1024, sharding="auto", memory_budget_mb=budget_mb)
    table = pq.read_table(table_path)
    features, _, dedup, _ = _batches(table, cfg, steps, torch.device("cpu"))
    # the items table alone past the budget: 1.25 x the budget's bytes (weights, fp32)
    big = int(1.25 * (budget_mb << 20) / (4 * cfg.model.embedding_dim))
    item_table = features.table_of(features.item_key)
    features = features.model_copy(
        update={
            "features": [
                f.model_copy(update={"table_size": big})
                if f.kind != "dense" and features.table_of(f.name) == item_table
                else f
                for f in features.features
            ]
        }
    )
    before = rss()  # the runtime (python, torch, torchrec), the batches
    model = strategy.placed(features, cfg)  # the tables placed: each rank's shards only
    net = strategy.net
    opt_dense, fused = strategy.optimizers(model, cfg, warm=False)
    for k, b in enumerate(dedup):
        aux = cooccurrence_term(model, cfg, k)
        train_step(net, b.part(rank, world).to(device), opt_dense, fused, False, aux)
    peak = torch.tensor([float(peak_mem(device))])
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, peak)
    held = shard_bytes(model)
    plan = plan_table(net)[f"t_{item_table}"]
    refused = ""
    try:
        shard(
            ShardedDLRM(features, cfg.model),
            cfg.model_copy(update={"memory_budget_mb": budget_mb // 2}),
            world,
            device,
        )
    except ShardingRefused as e:
        refused = str(e)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "sharded.budget_mb": budget_mb,
                    "sharded.big_table_rows": big,
                    "sharded.big_table_bytes": big * 4 * cfg.model.embedding_dim,
                    "sharded.big_table_plan": plan,
                    "sharded.table_bytes_per_rank": held,
                    "sharded.peak_rss_per_rank": [int(p) for p in peaks],
                    "sharded.rss_before_tables": before,
                    "sharded.half_budget_refusal": refused,
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def counted_all_to_all():
    """Count the bytes this rank sends to other ranks through `all_to_all_single` (what
    TorchRec's input and output distributions use) while inside, from this thread (a
    step's own exchanges: not a background prefetch's); yields a Counter by dtype
    (int64/int32: ids and lengths; float32: vectors and their gradients)."""
    import torch.distributed as dist

    sent: Counter = Counter()
    original = dist.all_to_all_single
    rank, world = dist.get_rank(), dist.get_world_size()
    caller = threading.get_ident()

    def counting(
        output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
    ):
        if threading.get_ident() != caller:
            return original(output, input, output_split_sizes, input_split_sizes, group, async_op)
        rows = input.shape[0] if input.dim() else 0
        row_bytes = input[0].numel() * input.element_size() if rows else 0
        splits = input_split_sizes or [rows // world] * world
        sent[str(input.dtype).removeprefix("torch.")] += row_bytes * sum(
            n for j, n in enumerate(splits) if j != rank
        )
        return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

    dist.all_to_all_single = counting
    try:
        yield sent
    finally:
        dist.all_to_all_single = original


if __name__ == "__main__":
    part, table_path, arg, out_path = sys.argv[1:5]
    fn = _comm_rank if part == "comm" else _budget_rank
    figures = spawn_ranks(fn, 2, table_path, arg)
    with open(out_path, "w") as f:
        json.dump(figures, f)
