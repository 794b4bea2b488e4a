"""The benchmark code paths on small data: every figure is produced and consistent. (Speed
targets are measured by `make bench`, never asserted in tests.)"""

import math

import pytest

from recd_core.bench import dpp_figures, markdown
from recd_core.bench_train import bench_embeddings, bench_train, peak_memory
from recd_core.config import ModelConfig, TrainConfig

DAY = "2026-11-01"
SMALL = TrainConfig(
    batch_size=256, model=ModelConfig(embedding_dim=8, bottom_mlp=[16], top_mlp=[16], history_ff=16)
)


def test_training_bench_figures(fresh_warehouse, tmp_path):
    table = fresh_warehouse.read("samples", DAY, layout="clustered")
    r = bench_train(table, SMALL, repeats=2, n_batches=2)
    for key in (
        "bench.train_speedup",
        "bench.train_speedup_bound",
        "bench.train_speedup_component_bound",
    ):
        assert r[key] > 0 and math.isfinite(r[key]), key
    assert r["train.group_dedup_factor"] > 1
    assert r["train.samples_per_s.dedup"] == pytest.approx(256 / (r["train.step_ms.dedup"] / 1000))
    mem = peak_memory(table, SMALL, str(tmp_path))
    assert (
        mem["train.peak_mem_bytes.dedup"] > 100e6 and mem["train.peak_mem_bytes.baseline"] > 100e6
    )
    pytest.importorskip("torchrec", reason="the torchrec extra is not installed")
    e = bench_embeddings(table, SMALL, repeats=1)
    assert {
        "embedding.step_ms.torchrec_kjt",
        "embedding.step_ms.torchrec_vbe",
        "embedding.step_ms.ours_dedup",
    } <= e.keys()


def test_dpp_bench_figures_and_report(fresh_warehouse):
    r = dpp_figures(fresh_warehouse, DAY, repeats=1)
    assert r["bench.dpp_speedup"] > 0 and r["dpp.bytes_out.dedup"] < r["dpp.bytes_out.baseline"]
    report = markdown({"bench.preset": "small", **r})
    assert "DPP preprocessing" in report
