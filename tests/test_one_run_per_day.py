"""One run per day and arm, however it is started: two runs of the same day (a manual run
beside the scheduled one) build each partition once, train once and register one version;
a training resumes or reuses only what was built from its own batches."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mlflow.tracking import MlflowClient
from recd_cli import RECD

from recd_core.config import PreprocessConfig, TrainConfig
from recd_core.dpp.preprocess import preprocess
from recd_core.modeling.train import train

DAY = "2026-11-01"
CONFIG = Path(__file__).parent / "configs/small.yaml"


def test_two_runs_of_a_day_started_together_train_once_and_register_one_version(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = ["--warehouse", tmp_path / "wh", "--logs", tmp_path / "logs", "--config", CONFIG]
    procs = [
        subprocess.Popen(
            list(
                map(
                    str,
                    [
                        RECD,
                        "--tracking-uri",
                        uri,
                        "run",
                        *common,
                        "--ds",
                        DAY,
                        "--summary",
                        tmp_path / f"run{i}.json",
                    ],
                )
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    said = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, said, strict=True):
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
        assert " ERROR " not in err and "WARNING" not in err, err[-3000:]
    runs = [json.loads((tmp_path / f"run{i}.json").read_text()) for i in (1, 2)]
    # one trained, the other used its model (and said so, in its log)
    assert sorted(bool(r.get("train.reused")) for r in runs) == [False, True]
    second = next(i for i, r in enumerate(runs) if r.get("train.reused"))
    assert "was trained by an earlier run on the same batches" in said[second][0]
    assert runs[0]["train.model_uri"] == runs[1]["train.model_uri"]
    # every partition of the day built once: the later build of each kept the first's
    for key in ("ingest.kept", "storage.kept", "dpp.kept"):
        assert sorted(bool(r[key]) for r in runs) == [False, True], key
    client = MlflowClient(tracking_uri=uri)
    versions = client.search_model_versions("name = 'recd-dlrm'")
    assert [str(v.version) for v in versions] == ["1"]
    assert {r["registry.version"] for r in runs} == {1}
    assert sorted(bool(r.get("registry.already_registered")) for r in runs) == [False, True]
    assert str(client.get_model_version_by_alias("recd-dlrm", "champion").version) == "1"
    # one LoggedModel of the day's model, listed as the output of both train runs
    exp = client.get_experiment_by_name("recd")
    models = client.search_logged_models([exp.experiment_id])
    assert len(models) == 1
    for r in runs:
        outputs = client.get_run(r["mlflow.run_id.train.dedup"]).outputs.model_outputs
        assert [o.model_id for o in outputs] == [models[0].model_id]


def test_a_training_resumes_or_reuses_only_what_its_own_batches_built(fresh_warehouse):
    """The run's key holds its batches' write id: the same batches, rebuilt from the same
    samples, are kept (one training); batches rebuilt differently start afresh, never onto
    the other batches' checkpoint or model."""
    wh = fresh_warehouse
    cfg = TrainConfig(batch_size=512, epochs=1, max_steps=3)
    preprocess(wh, DAY, PreprocessConfig(batch_size=512))
    first = train(wh, DAY, cfg)
    assert preprocess(wh, DAY, PreprocessConfig(batch_size=512))["dpp.kept"]
    again = train(wh, DAY, cfg)
    assert again["train.reused"] and again["train.run"] == first["train.run"]
    rebuilt = preprocess(wh, DAY, PreprocessConfig(batch_size=512, batches_per_split=3))
    assert not rebuilt["dpp.kept"]
    other = train(wh, DAY, cfg)
    assert other["train.run"] != first["train.run"] and not other.get("train.reused")
    assert other["train.resumed_from_step"] == 0 and other["train.steps"] == 3
    assert Path(wh.root, "models", first["train.run"], "model.json").exists()  # untouched


def test_a_damaged_model_of_the_same_run_is_trained_again_not_used(fresh_warehouse):
    """A model.json cut short (a crash mid-save, a damaged copy) is no model to reuse: the
    run trains again and saves it whole."""
    wh = fresh_warehouse
    cfg = TrainConfig(batch_size=512, epochs=1, max_steps=3)
    preprocess(wh, DAY, PreprocessConfig(batch_size=512))
    first = train(wh, DAY, cfg)
    meta = Path(wh.root, "models", first["train.run"], "model.json")
    meta.write_text(meta.read_text()[:40])
    again = train(wh, DAY, cfg)
    assert not again.get("train.reused") and again["train.model_uri"] == first["train.model_uri"]
    assert train(wh, DAY, cfg)["train.reused"]  # whole again: used
