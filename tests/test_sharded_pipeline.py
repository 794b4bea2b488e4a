"""The daily pipeline with a table no process may hold: `recd run` from a config alone (the
items table past the per-process budget, 2 processes, row-wise shards) trains, evaluates,
registers and promotes day one, and day two warm-starts from that champion, sharded; no
stage's process ever holds the table whole."""

import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from test_pipeline import DAY, NEXT, recd

from recd_core.config import load_feature_set

BUDGET_MB = 256
ITEMS_ROWS = 3_000_000  # x 33 float32 (32 weights, 1 accumulator): 396 MB, past the budget


def _config(path: Path) -> Path:
    features = load_feature_set("synthetic").model_dump(mode="json")
    for f in features["features"]:
        if f.get("table") == "items":
            f["table_size"] = ITEMS_ROWS
    path.write_text(yaml.safe_dump({
        "features": features,
        "synth": {"users": 400, "items": 2000, "samples_per_day": 4000},
        # no validation slice: its best state and the tables' restart point would be more
        # copies of each rank's shards (see docs/operations.md)
        "preprocess": {"validation_fraction": 0.0},
        "train": {"nproc": 2, "sharding": "row_wise", "memory_budget_mb": BUDGET_MB,
                  "restart_tables": False, "epochs": 2},
    }))  # fmt: skip
    return path


@pytest.mark.slow
def test_two_days_with_a_table_past_the_budget_train_score_register_and_warm_start(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = ("--warehouse", tmp_path / "wh", "--logs", tmp_path / "logs", "--out",
              tmp_path / "out", "--config", _config(tmp_path / "big.yaml"))  # fmt: skip
    recd("--tracking-uri", uri, "run", *common, "--ds", DAY, "--summary", tmp_path / "d1.json")
    recd("--tracking-uri", uri, "run", *common, "--ds", NEXT, "--summary", tmp_path / "d2.json")
    day1, day2 = (json.loads((tmp_path / f"d{i}.json").read_text()) for i in (1, 2))
    table_bytes = ITEMS_ROWS * 32 * 4
    for day in (day1, day2):
        assert day["train.saved_layout"] == "shards" and day["train.world_size"] == 2
        model = Path(day["train.model_uri"])
        largest = max(p.stat().st_size for p in model.rglob("*") if p.is_file())
        assert largest < table_bytes / 1.9  # the items table in 2 row ranges, one a rank
        assert day["eval.ne"] > 0 and day["registry.decision"] in ("promoted", "kept champion")
        # each rank: the runtime (TorchRec's included) and the batches, then its shards and
        # a copy of one while a checkpoint is written; no rank gathers the table
        grown = [peak - before for before, peak in zip(
            day["train.rss_before_model_bytes_per_rank"], day["train.peak_mem_bytes_per_rank"],
            strict=True)]  # fmt: skip
        shards = day["train.shard_bytes_per_rank"]
        assert all(g < 3 * s for g, s in zip(grown, shards, strict=True)), (grown, shards)
        assert max(shards) < (BUDGET_MB << 20) < table_bytes
        assert abs(grown[0] - grown[1]) < table_bytes / 4, grown
        # the stages scoring and registering it map the rows they read, not the table
        for stage in ("evaluate", "register"):
            more = day[f"{stage}.peak_rss_bytes"] - day[f"{stage}.start_rss_bytes"]
            assert more < 0.75 * table_bytes, (stage, more)
    assert day1["registry.promoted"] is True
    assert day2["train.init_from"] == "models:/recd-dlrm/1"
    assert "warm start" in day2["train.init_reason"]
    v1 = MlflowClient(tracking_uri=uri).get_model_version("recd-dlrm", "1")
    assert v1.tags["recd.lineage_key"]
