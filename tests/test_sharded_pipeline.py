"""The daily pipeline with a table no process may hold: `recd run` from a config alone (the
items table past the per-process budget, 2 processes, row-wise shards) trains, evaluates,
registers and promotes day one, and day two warm-starts from that champion, sharded; the
champion is served from the registry; no stage's process ever holds the table whole."""

from pathlib import Path

import mlflow.pyfunc
import pytest
from mlflow.tracking import MlflowClient
from test_pipeline import DAY, NEXT

from recd_core.bench.sharded import (
    PIPELINE_BUDGET_MB,
    PIPELINE_ITEMS_ROWS,
    pipeline_days,
    serve_champion,
)
from recd_core.modeling.mapped_model import MappedDLRM

BUDGET_MB, ITEMS_ROWS = PIPELINE_BUDGET_MB, PIPELINE_ITEMS_ROWS  # 396 MB past 256 MB


@pytest.mark.slow
def test_two_days_with_a_table_past_the_budget_train_score_register_and_warm_start(tmp_path):
    day1, day2 = pipeline_days(str(tmp_path), (DAY, NEXT))  # as the bench runs it
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    table_bytes = ITEMS_ROWS * 32 * 4
    for day in (day1, day2):
        assert day["train.saved_layout"] == "shards" and day["train.world_size"] == 2
        model = Path(day["train.model_uri"])
        largest = max(p.stat().st_size for p in model.rglob("*") if p.is_file())
        assert largest < table_bytes / 1.9  # the items table in 2 row ranges, one a rank
        assert day["eval.ne"] > 0 and day["registry.decision"] in ("promoted", "kept champion")
        # each rank: the runtime (TorchRec's included) and the batches, then its shards and
        # a copy of one while a checkpoint is written; no rank gathers the table
        grown = [
            peak - before
            for before, peak in zip(
                day["train.rss_before_model_bytes_per_rank"],
                day["train.peak_mem_bytes_per_rank"],
                strict=True,
            )
        ]
        shards = day["train.shard_bytes_per_rank"]
        assert all(g < 3 * s for g, s in zip(grown, shards, strict=True)), (grown, shards)
        assert max(shards) < (BUDGET_MB << 20) < table_bytes
        assert abs(grown[0] - grown[1]) < table_bytes / 4, grown
        # the stages scoring and registering it map the rows they read, not the table
        for stage in ("evaluate", "register"):
            more = day[f"{stage}.peak_rss_bytes"] - day[f"{stage}.start_rss_bytes"]
            assert more < 0.75 * table_bytes, (stage, more)
    # served from the registry: the champion's tables stay in its shard files
    served = serve_champion(str(tmp_path), day2["eval.ds"])
    assert served["sharded.pipeline.serve_p50_ms"] > 0
    assert (
        served["sharded.pipeline.serve_peak_bytes"] - served["sharded.pipeline.serve_idle_bytes"]
        < table_bytes / 2
    )
    version = MlflowClient(tracking_uri=uri).get_model_version_by_alias("recd-dlrm", "champion")
    champion = mlflow.pyfunc.load_model(version.source).unwrap_python_model()  # no global URI
    assert isinstance(champion.scorer.model, MappedDLRM)
    assert not any(k.startswith("bags.") for k in champion.scorer.model.state_dict())
    assert day1["registry.promoted"] is True
    assert day2["train.init_from"] == "models:/recd-dlrm/1"
    assert "warm start" in day2["train.init_reason"]
    v1 = MlflowClient(tracking_uri=uri).get_model_version("recd-dlrm", "1")
    assert v1.tags["recd.lineage_key"]
