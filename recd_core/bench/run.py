"""`recd bench`: the headline ratios, measured side by side in one run on one workload.

Storage of the shuffled (baseline) vs the session-clustered (RecD) layout against the
storage lower bound, the dedup profile, ingestion, DPP and training throughput of both
arms, and model quality next to references on the same data (bench/quality.py: a logistic
regression on MovieLens, the oracle on a synthetic week). Results go to `OUT/bench.json`
(the `bench.*` keys), `OUT/bench.md` (the tables for docs/benchmarks.md) and a chart.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from recd_core.bench.bagpipe import run as bagpipe_figures
from recd_core.bench.flexshard import run as flexshard_figures
from recd_core.bench.flexshard_steps import measured as flexshard_steps
from recd_core.bench.kept import machine
from recd_core.bench.lineage_cost import lineage_costs
from recd_core.bench.neighbour import neighbour_figures
from recd_core.bench.report import chart, markdown
from recd_core.bench.sharded import sharded_figures
from recd_core.bench.small_files import small_files_figures
from recd_core.config import PACKAGE_CONFIGS, GenerateConfig, TrainConfig
from recd_core.config_files import load_pipeline_config
from recd_core.data.movielens import release_name
from recd_core.orchestration.stages import run_stage
from recd_core.warehouse import Warehouse

DS = "2026-11-01"


def _storage(wh: Warehouse, ds: str, config: str | None = None) -> dict:
    """Both layouts of day `ds`, written by the generate stage as the pipelines run it
    (`config`: the pipeline config of the day's feature set; default: the synthetic one)."""
    g = run_stage("generate", {"warehouse": wh.uri, "ds": ds, "layout": "both", "config": config})
    c, s = g["layouts"]["clustered"], g["layouts"]["shuffled"]
    return {
        "storage_ratio": s["storage.bytes"] / c["storage.bytes"],
        "clustered_bytes": c["storage.bytes"],
        "shuffled_bytes": s["storage.bytes"],
        "lower_bound_bytes": c["storage.lower_bound_bytes"],
        "clustered_over_lower_bound": c["storage.bytes_over_lower_bound"],
        "rows": c["storage.rows"],
        "sessions": c["storage.sessions"],
        "dedup_factor_mean_clustered": c["dedup.factor.mean"],
        "dedup_factor_mean_shuffled": s["dedup.factor.mean"],
        "dedup_factor_user_group_clustered": c["dedup.factor.user_group"],
        "generate_seconds": g["generate.seconds"],
    }


def _train_figures(wh: Warehouse, ds: str, out: Path, repeats: int = 7) -> dict:
    import torch

    from recd_core.bench.training import bench_embeddings, bench_train, peak_memory

    table = wh.read("samples", ds, layout="clustered")
    # the paper-scale batch (4096); a small day gets the largest power of two it holds twice
    batch = min(TrainConfig().batch_size, 1 << max(int(np.log2(max(table.num_rows // 2, 1))), 0))
    cfg = TrainConfig(batch_size=batch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    figures = bench_train(table, cfg, repeats=repeats, device=device)
    if device == "cpu":  # the same steps beside a busy neighbour process
        figures.update(neighbour_figures(wh.uri, ds, batch))
    figures.update(peak_memory(table, cfg, str(out), device=device))
    figures.update(bench_embeddings(table, cfg, repeats=repeats))
    figures["train.model"] = cfg.model.model_dump()
    figures.update(_sharded_figures(table, cfg, out))
    return figures


def _movielens_flexshard(wh: Warehouse, ds: str) -> dict:
    """FlexShard and BagPipe on the MovieLens day's batches (both arms preprocessed as the
    pipelines do), measured and replayed: `sharded.{flexshard,bagpipe}.movielens.*`."""
    config = str(PACKAGE_CONFIGS / "movielens.yaml")
    for mode in ("dedup", "baseline"):
        run_stage("preprocess", {"warehouse": wh.uri, "ds": ds, "mode": mode, "config": config})
    figures = flexshard_figures(wh, ds) | flexshard_steps(wh.uri, ds) | bagpipe_figures(wh, ds)
    return {
        ".".join([*k.split(".")[:2], "movielens", *k.split(".")[2:]]): v for k, v in figures.items()
    }


def _sharded_figures(table, cfg, out: Path) -> dict:
    """The tables sharded over 2 processes (bench/sharded.py)."""

    path = out / "bench_sharded.parquet"
    pq.write_table(table.slice(0, 8 * cfg.batch_size), path)
    try:
        return sharded_figures(str(path), cfg.model_dump_json())
    finally:
        path.unlink()


def run_bench(
    preset: str,
    out: Path,
    movielens: Path | None = None,
    train: bool = True,
    quality: bool = True,
    quality_days: int = 7,
    seeds: int = 1,
    kept: Path | None = None,
) -> dict:
    out = Path(out)
    if (out / "warehouse").exists():
        shutil.rmtree(out / "warehouse")
    wh = Warehouse(out / "warehouse")
    logs = out / "logs"
    if logs.exists():
        shutil.rmtree(logs)
    # the bench's day, synthesized and ingested as the pipelines do (`stages.run_stage`)
    run_stage("synth", {"logs": str(logs), "ds": DS, "preset": preset})
    ing = run_stage("ingest", {"warehouse": wh.uri, "ds": DS, "source": str(logs / f"ds={DS}")})
    gen = GenerateConfig()
    storage = _storage(wh, DS)
    result = {
        "bench.preset": preset,
        "bench.batch_size": gen.batch_size,
        "bench.storage_ratio": storage["storage_ratio"],
        "bench.storage_over_lower_bound": storage["clustered_over_lower_bound"],
        "bench.ingest_rows_per_s": ing["ingest.rows_per_s"],
        "bench.ingest_mb_per_s": ing["ingest.bytes_in"] / 1e6 / ing["ingest.seconds"],
        "bench.machine": machine(),
        "synthetic": {
            **storage,
            "ingest_rows": ing["ingest.rows_in"],
            "ingest_seconds": ing["ingest.seconds"],
        },
    }

    result.update(small_files_figures(logs / f"ds={DS}", DS))
    result.update(dpp_figures(wh, DS))
    if train:
        result.update(_train_figures(wh, DS, out))
        # FlexShard's placement against TorchRec's, on the day's batches DPP just wrote:
        # trained on 2 and 4 processes (measured), replayed at 2 to 64 ranks (the model)
        result.update(flexshard_figures(wh, DS))
        result.update(flexshard_steps(wh.uri, DS))
        # BagPipe's oracle cacher on the same lookups, replayed at 2 to 64 ranks
        result.update(bagpipe_figures(wh, DS))

    rows = result["synthetic"]["rows"]
    seconds = {
        "ingest": ing["ingest.seconds"],
        "generate": storage["generate_seconds"],
        "preprocess": rows / result["dpp.samples_per_s.dedup"],
    }
    if "train.samples_per_s.dedup" in result:
        seconds["train"] = rows / result["train.samples_per_s.dedup"]  # a pass over the day
    result.update(lineage_costs(wh, DS, logs / f"ds={DS}", seconds))
    if movielens is not None:
        ml_ing = run_stage(
            "ingest",
            {
                "warehouse": wh.uri,
                "ds": "2026-10-01",
                "source": str(movielens),
                "format": "movielens",
            },
        )
        ml = _storage(wh, "2026-10-01", str(PACKAGE_CONFIGS / "movielens.yaml"))
        result.update(_movielens_flexshard(wh, "2026-10-01"))
        result["bench.movielens.storage_ratio"] = ml["storage_ratio"]
        result["bench.movielens.storage_over_lower_bound"] = ml["clustered_over_lower_bound"]
        result["movielens"] = {
            **ml,
            "data": release_name(movielens),
            "ingest_rows": ml_ing["ingest.rows_in"],
            "ingest_quarantined": ml_ing["ingest.rows_quarantined"],
        }
    if quality:
        from recd_core.bench.quality import SPLITS, movielens_quality, synthetic_week

        if movielens is not None:
            for split in SPLITS:  # per user, and globally by time
                result.update(
                    movielens_quality(movielens, out, split=split, seeds=seeds, kept=kept)
                )
        if quality_days:
            result.update(synthetic_week(out, preset, days=quality_days))
            from recd_core.bench.serving import ranking_figures, serving_figures
            from recd_core.bench.serving_load import load_figures

            served = result["week_model"]  # the week's last model, sent its next day's rows
            result.update(serving_figures(served["uri"], served["warehouse"], served["ds"]))
            result.update(ranking_figures(served["uri"], served["warehouse"], served["ds"]))
            result.update(load_figures(served["uri"], served["warehouse"], served["ds"]))
    (out / "bench.md").write_text(markdown(result))
    result["artifacts"] = [str(out / "bench.md"), str(chart(result, out / "bench.png"))]
    return result


def dpp_figures(
    wh: Warehouse, ds: str, repeats: int = 5, batch_size: int = GenerateConfig().batch_size
) -> dict:
    """DPP through the preprocess stage, as the pipelines run it, dedup against baseline on
    the same samples at the bench's batch size (the training bench's), interleaved repeats,
    medians: the stage's time, and apart its two parts, the transform (the splits' work:
    read, encode, write) and the fixed cost around it (the statistics, the dedup profile,
    the validation split, the manifest); the same ratio at the daily pipeline's batch; and
    1 vs 2 workers in dedup mode."""

    pipeline_batch = load_pipeline_config().preprocess.batch_size
    arms = {
        "dedup": {"mode": "dedup"},
        "baseline": {"mode": "baseline"},
        "dedup_2w": {"mode": "dedup", "workers": 2},
        "dedup_2t": {"mode": "dedup", "workers": 2, "threads": True},
        "dedup_pipeline": {"mode": "dedup", "batch_size": pipeline_batch},
        "baseline_pipeline": {"mode": "baseline", "batch_size": pipeline_batch},
    }
    runs: dict[str, list[dict]] = {k: [] for k in arms}
    for _ in range(repeats):
        for k, args in arms.items():
            given = {"warehouse": wh.uri, "ds": ds, "batch_size": batch_size, **args}
            runs[k].append(run_stage("preprocess", given))

    def median(figure) -> dict[str, float]:
        return {k: statistics.median(figure(r) for r in v) for k, v in runs.items()}

    def transform_s(r: dict) -> float:  # the splits' work, summed over the workers
        return r["dpp.samples"] / r["dpp.worker_samples_per_s"]

    med = median(lambda r: r["dpp.seconds"])
    work = median(transform_s)
    fixed = median(lambda r: r["dpp.seconds"] - transform_s(r))
    samples = runs["dedup"][0]["dpp.samples"]
    return {
        "bench.dpp_speedup": med["baseline"] / med["dedup"],
        "bench.dpp_worker_speedup": work["baseline"] / work["dedup"],
        "bench.dpp_pipeline_batch_speedup": med["baseline_pipeline"] / med["dedup_pipeline"],
        "bench.dpp_scaling_2_workers": med["dedup"] / med["dedup_2w"],
        "bench.dpp_scaling_2_threads": med["dedup"] / med["dedup_2t"],
        "bench.dpp_batch_size": batch_size,
        "bench.dpp_pipeline_batch_size": pipeline_batch,
        "bench.dpp_repeats": repeats,
        "dpp.samples_per_s.dedup": samples / med["dedup"],
        "dpp.samples_per_s.baseline": samples / med["baseline"],
        "dpp.transform_samples_per_s.dedup": samples / work["dedup"],
        "dpp.transform_samples_per_s.baseline": samples / work["baseline"],
        "dpp.fixed_seconds.dedup": fixed["dedup"],
        "dpp.fixed_seconds.baseline": fixed["baseline"],
        "dpp.samples_per_s.dedup_2_workers": samples / med["dedup_2w"],
        "dpp.samples_per_s.dedup_2_threads": samples / med["dedup_2t"],
        "dpp.bytes_out.dedup": runs["dedup"][0]["dpp.bytes_out"],
        "dpp.bytes_out.baseline": runs["baseline"][0]["dpp.bytes_out"],
    }
