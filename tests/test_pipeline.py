"""`recd run` and `recd compare`: every stage for a day, MLflow's record of both arms, the
registered model and the champion/challenger decision across days."""

import json
import re
import shutil
import urllib.parse
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pyarrow as pa
import pytest
from mlflow.tracking import MlflowClient
from recd_cli import recd

from recd_core.mlops.metric_names import metric_name as M
from recd_core.mlops.registry import decide
from recd_core.modeling.saved import load_model, predict
from recd_core.warehouse import Warehouse

DAY, NEXT, THIRD = "2026-11-01", "2026-11-02", "2026-11-03"
ARM_KEYS = ("storage.bytes", "dpp.samples_per_s", "train.samples_per_s", "eval.ne", "eval.auc")


def test_promotion_rule():
    assert decide(0.9, None, 0.0) is True  # the first model becomes champion
    assert decide(0.9, 0.95, 0.0) and decide(0.95, 0.95, 0.0)
    assert not decide(0.96, 0.95, 0.0)
    assert decide(0.96, 0.95, 0.02)  # within tolerance
    assert not decide(float("nan"), 0.95, 0.02)


@pytest.fixture(scope="module")
def daily(tmp_path_factory):
    """Two days of `recd run`: day one with both arms, day two the dedup arm."""
    root = tmp_path_factory.mktemp("daily")
    uri = f"sqlite:///{root}/mlflow.db"
    common = (
        "--warehouse",
        root / "wh",
        "--logs",
        root / "logs",
        "--out",
        root / "out",
        "--config",
        Path(__file__).parent / "configs/small.yaml",
    )
    first = recd(
        "--tracking-uri",
        uri,
        "run",
        *common,
        "--ds",
        DAY,
        "--mode",
        "both",
        "--summary",
        root / "day1.json",
    )
    recd("--tracking-uri", uri, "run", *common, "--ds", NEXT, "--summary", root / "day2.json")
    return root, uri, first.stdout + first.stderr  # the answer on stdout, progress on stderr


def test_a_run_with_both_arms_records_each_arm_and_registers_a_champion(daily):
    root, uri, output = daily
    summary = json.loads((root / "day1.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(summary["mlflow.run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["recd.stage"] == "run"
    exp = parent.info.experiment_id
    children = client.search_runs(
        [exp], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    # one child run per stage, as under Airflow; an arm's stages tagged with its mode
    runs = {(r.data.tags["recd.stage"], r.data.tags.get("mode", "")): r for r in children}
    for mode in ("dedup", "baseline"):
        assert {"preprocess", "train", "evaluate"} <= {s for s, m in runs if m == mode}
        for key, stage in zip(
            ARM_KEYS[1:], ("preprocess", "train", "evaluate", "evaluate"), strict=True
        ):
            run = runs[(stage, mode)]
            assert run.data.metrics[M(key)] == pytest.approx(summary[f"{key}.{mode}"]), (mode, key)
            assert summary[f"mlflow.run_id.{stage}.{mode}"] == run.info.run_id
    generate = runs[("generate", "")].data.metrics
    for mode in ("dedup", "baseline"):
        assert generate[M(f"storage.bytes.{mode}")] == summary[f"storage.bytes.{mode}"]
    # the arms: clustered storage is smaller, the same next-day quality
    assert summary["storage.bytes.dedup"] < summary["storage.bytes.baseline"]
    assert abs(summary["eval.ne.dedup"] - summary["eval.ne.baseline"]) < 0.01
    assert summary["run.eval_ds"] == NEXT
    assert "dedup vs baseline" in output and "next-day NE" in output  # the comparison table
    artifacts = [a.path for a in client.list_artifacts(parent.info.run_id)]
    assert f"compare-{DAY}.png" in artifacts and "config.yaml" in artifacts
    assert (root / "out" / f"compare-{DAY}.png").read_bytes()[:4] == b"\x89PNG"
    v1 = client.get_model_version("recd-dlrm", "1")
    assert v1.run_id == runs[("train", "dedup")].info.run_id  # the model lives with its run
    assert v1.tags["recd.decision"] == "promoted" and v1.tags["recd.champion_ne"] == ""


def test_the_mlflow_experiment_reads_at_a_glance(daily):
    """As a reader of the MLflow UI meets it: a model-training experiment; the two-arm run
    named for its arms and days with the answer first; stage runs named with stage, arm and
    day; stable metric keys; the model a LoggedModel with its metrics, linked to the
    registered version; the partitions read as datasets; system metrics on training."""
    root, uri, _ = daily
    summary = json.loads((root / "day1.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(summary["mlflow.run_id"])
    exp = client.get_experiment(parent.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # not the GenAI view
    assert parent.info.run_name == f"dedup vs baseline {DAY} → {NEXT}"
    assert parent.data.tags["mode"] == "dedup+baseline"  # no single arm
    history = client.get_metric_history(parent.info.run_id, "storage/ratio")
    assert history and history[0].value > 1
    # the answer at a glance: the verdict and the table as its description, a short set of
    # metrics (its stage runs keep the rest), settings as params, the conditions recorded
    note = parent.data.tags["mlflow.note.content"]
    assert "Dedup matches the baseline" in note and "| next-day NE |" in note, note
    assert "with dedup" in note and "storage " in note, note
    assert "dedup − baseline" in note and "CPUs" in note
    assert len(parent.data.metrics) < 30 and "eval/ne" not in parent.data.metrics
    assert {"eval/ne.dedup", "eval/ne.baseline", "eval/ne_gap"} <= set(parent.data.metrics)
    assert "train/batch_size" not in parent.data.metrics
    # every chart in a section of the UI (the part before '/'), none in a wall of its own
    sections = {k.split("/")[0] for k in parent.data.metrics if "/" in k}
    assert len(sections) == len({k.split("/")[0] for k in parent.data.metrics})
    assert sections <= {"storage", "dpp", "train", "eval", "ingest", "system", "run"}
    assert parent.data.params["compare.quality_ok"] == "true"
    assert "tracking_uri" not in parent.data.params and "sys.cpu_budget" in parent.data.params
    assert "sys.load_1m_end" in parent.data.tags
    assert not [k for k in parent.data.metrics if re.search(r"\d{4}-\d{2}-\d{2}", k)]  # stable keys
    assert parent.data.tags["recd.days"] == f"{DAY},{NEXT}"  # the dates: a tag
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    names = {r.info.run_name for r in children}
    assert {
        f"ingest {DAY}",
        f"ingest {NEXT}",
        f"train dedup {DAY}",
        f"train baseline {DAY}",
        f"evaluate dedup {DAY} → {NEXT}",
    } <= names
    train = next(r for r in children if r.info.run_name == f"train dedup {DAY}")
    assert "train.batch_size" in train.data.params and "train.lr_dense" in train.data.params
    inputs = {d.dataset.name: d for d in train.inputs.dataset_inputs}
    assert set(inputs) == {f"batches/mode=dedup/ds={DAY}"}
    assert json.loads(inputs[f"batches/mode=dedup/ds={DAY}"].dataset.profile)["num_rows"] > 0
    # the exact version it read: the dataset's digest is the partition's write id (lineage)
    wid = Warehouse(root / "wh").manifest("batches", DAY, mode="dedup")["write_id"]
    assert inputs[f"batches/mode=dedup/ds={DAY}"].dataset.digest == wid
    evaluate = next(r for r in children if r.info.run_name == f"evaluate dedup {DAY} → {NEXT}")
    scored = evaluate.inputs.dataset_inputs
    assert [d.dataset.name for d in scored] == [f"samples/layout=clustered/ds={NEXT}"]
    assert [t.value for t in scored[0].tags if t.key == "mlflow.data.context"] == ["evaluation"]
    # the registered version is a LoggedModel of the train run, with its next-day figures
    v1 = client.get_model_version("recd-dlrm", "1")
    model = client.get_logged_model(v1.tags["recd.model_id"])
    assert model.source_run_id == v1.run_id and v1.source == model.artifact_location
    outputs = client.get_run(v1.run_id).outputs.model_outputs  # the train run's output
    assert [o.model_id for o in outputs] == [model.model_id]
    linked = json.loads(model.tags["mlflow.modelVersions"])  # as MLflow's register_model links
    assert [(v["name"], str(v["version"])) for v in linked] == [("recd-dlrm", "1")]
    assert {m.key for m in model.metrics} >= {"eval/ne", "eval/auc"}
    found = client.search_logged_models([exp.experiment_id])
    assert model.model_id in {m.model_id for m in found}  # the Models tab lists it
    # each arm's model, named for its arm and day, with the figures its evaluate run found
    arms = {m.name: m for m in found if m.source_run_id in {r.info.run_id for r in children}}
    assert set(arms) == {f"dlrm-dedup-{DAY}", f"dlrm-baseline-{DAY}"}
    ne = {m.key: m.value for m in arms[f"dlrm-baseline-{DAY}"].metrics}["eval/ne"]
    assert ne == pytest.approx(summary["eval.ne.baseline"])


def test_the_next_day_promotes_or_keeps_the_champion_by_ne_and_logs_why(daily):
    root, uri, _ = daily
    day2 = json.loads((root / "day2.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    v2 = client.get_model_version("recd-dlrm", "2")
    assert str(client.get_model_version_by_alias("recd-dlrm", "challenger").version) == "2"
    champion = str(client.get_model_version_by_alias("recd-dlrm", "champion").version)
    better = day2["registry.challenger_ne"] <= day2["registry.champion_ne"]
    assert champion == ("2" if better else "1")
    assert v2.tags["recd.decision"] == ("promoted" if better else "kept champion")
    assert v2.tags["recd.eval_ds"] == THIRD
    # both NEs were scored on the same day: the champion's here is day one's model on day three
    assert float(v2.tags["recd.champion_ne"]) == pytest.approx(day2["registry.champion_ne"])
    run = client.get_run(day2["mlflow.run_id"])
    # a yes/no fact: a param, not a one-bar chart
    assert run.data.params["registry.promoted"] == str(better).lower()
    assert not [k for k in run.data.metrics if "promoted" in k]
    assert run.data.metrics["eval/registry.champion_ne"] == pytest.approx(
        day2["registry.champion_ne"]
    )
    # a one-arm run records each figure once (not also `eval/ne.dedup`), in its sections
    assert "eval/ne" in run.data.metrics and "eval/ne.dedup" not in run.data.metrics


def test_the_registered_model_scores_sample_rows_like_the_trained_model(daily):
    root, uri, _ = daily
    client = MlflowClient(tracking_uri=uri)
    v1 = client.get_model_version("recd-dlrm", "1")
    loaded = mlflow.pyfunc.load_model(f"{v1.source}")
    sig = loaded.metadata.signature
    assert "user_history" in sig.inputs.input_names() and "label" not in sig.inputs.input_names()
    table = Warehouse(root / "wh").read_range("samples", NEXT, 0, 300, layout="clustered")
    scored = loaded.predict(table.drop_columns(["label", "event_id", "ts"]).to_pandas())
    model, meta = load_model(json.loads((root / "day1.json").read_text())["train.model_uri.dedup"])
    np.testing.assert_allclose(scored, predict(model, meta, table), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="item_id"):
        loaded.predict(table.drop_columns(["item_id"]).to_pandas())


def test_compare_fails_loudly_when_the_arms_differ_beyond_tolerance(daily, tmp_path):
    root, uri, _ = daily
    cfg = tmp_path / "strict.yaml"
    cfg.write_text(
        "features: synthetic\nregistry: {compare_ne_tolerance: 0.0, compare_auc_tolerance: 0.0}\n"
    )
    r = recd(
        "--tracking-uri",
        uri,
        "compare",
        "--warehouse",
        root / "wh",
        "--logs",
        root / "logs",
        "--ds",
        DAY,
        "--config",
        cfg,
        "--out",
        tmp_path,
        code=None,
    )
    assert r.returncode == 3, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("recd compare: error:") and "differ in quality" in last
    assert (tmp_path / f"compare-{DAY}.png").exists()  # the evidence is kept
    runs = MlflowClient(tracking_uri=uri).search_runs(
        [MlflowClient(tracking_uri=uri).get_experiment_by_name("recd").experiment_id],
        filter_string="tags.`recd.stage` = 'compare'",
    )
    assert runs[0].info.status == "FAILED"
    assert len(MlflowClient(tracking_uri=uri).search_model_versions("name='recd-dlrm'")) == 2


def test_the_next_day_warm_starts_from_the_champion_and_its_version_records_the_lineage(daily):
    root, uri, _ = daily
    day1 = json.loads((root / "day1.json").read_text())
    day2 = json.loads((root / "day2.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    v1, v2 = (client.get_model_version("recd-dlrm", v) for v in ("1", "2"))
    # the first model trains from scratch and says why; the next starts from the champion
    assert day1["train.init_from"] == "" and v1.tags["recd.init_from"] == ""
    assert "no champion yet" in day1["train.init_reason"] == v1.tags["recd.init_reason"]
    assert day2["train.init_from"] == "models:/recd-dlrm/1" == v2.tags["recd.init_from"]
    assert v2.tags["recd.trained_on"] == NEXT
    # the workload's optimum next to the model's NE, in the summary and in the arm's run
    assert 0.5 < day1["eval.oracle_ne"] < day1["eval.ne"]
    scored = client.get_run(day1["mlflow.run_id.evaluate.dedup"])
    assert scored.data.metrics["eval/oracle_ne"] == pytest.approx(day1["eval.oracle_ne"])
    # the validation curve is a metric history, one point per validation
    curve = client.get_metric_history(day1["mlflow.run_id.train.dedup"], "train/val_ne")
    assert len(curve) >= 3 and sorted(p.step for p in curve)[0] == 0
    assert min(p.value for p in curve) == pytest.approx(day1["train.val_ne"])


def test_the_champion_warm_starts_only_days_after_those_it_was_trained_on(daily):
    """A backfill or a comparison of an earlier day must not start from a champion that saw
    that day or later (its labels would leak into the day being evaluated)."""
    from recd_core.mlops.starting_version import init_model
    from recd_core.mlops.tracking import Tracker

    root, uri, _ = daily
    current = MlflowClient(tracking_uri=uri).get_model_version_by_alias("recd-dlrm", "champion")
    last = max(current.tags["recd.trained_on"].split(","))
    with init_model(Tracker(uri), "champion", "recd-dlrm", DAY) as (local, label):
        assert local is None
        assert label == (
            f"from scratch: the champion (models:/recd-dlrm/{current.version}) was trained "
            f"on {last}, not before {DAY}"
        )
    with init_model(Tracker(uri), "champion", "recd-dlrm", "2026-12-01") as (local, label):
        assert label == f"models:/recd-dlrm/{current.version}"
        # the registry's copy carries the optimizer state the warm start continues
        assert {"model.pt", "model.json", "optimizer.pt"} <= {p.name for p in Path(local).iterdir()}


def test_a_changed_model_continues_its_own_lineage_instead_of_the_champions(daily):
    """Every version records its lineage key (its model features and model config). When the
    champion's differs from the run's (the model config changed), the pipeline's warm start
    continues the newest version of the run's own lineage, so a changed model accumulates
    days as the champion did; with none of its own, the champion is offered and training
    starts from scratch, saying why (test_train)."""
    from recd_core.mlops.starting_version import init_model
    from recd_core.mlops.tracking import Tracker
    from recd_core.modeling.saved import saved_lineage_key

    root, uri, _ = daily
    client = MlflowClient(tracking_uri=uri)
    current = client.get_model_version_by_alias("recd-dlrm", "champion")
    ours = current.tags["recd.lineage_key"]
    with init_model(Tracker(uri), f"models:/recd-dlrm/{current.version}", "recd-dlrm") as (
        local,
        _,
    ):
        assert saved_lineage_key(local) == ours
    other = next(
        v
        for v in client.search_model_versions("name = 'recd-dlrm'")
        if v.version != current.version
    )
    assert other.tags["recd.lineage_key"] == ours  # the same config all along
    later = "2026-12-01"
    client.set_model_version_tag("recd-dlrm", other.version, "recd.lineage_key", "changed")
    try:  # as if `other` had been trained with another model config, and not promoted
        with init_model(Tracker(uri), "champion", "recd-dlrm", later, "changed") as (_, label):
            assert label == f"models:/recd-dlrm/{other.version}"
        with init_model(Tracker(uri), "champion", "recd-dlrm", later, ours) as (_, label):
            assert label == f"models:/recd-dlrm/{current.version}"
        with init_model(Tracker(uri), "champion", "recd-dlrm", later, "unseen") as (_, label):
            assert label == f"models:/recd-dlrm/{current.version}"
        # its own lineage's versions are held to the same rule: trained before the day
        with init_model(Tracker(uri), "champion", "recd-dlrm", DAY, "changed") as (local, _):
            assert local is None
    finally:
        client.set_model_version_tag("recd-dlrm", other.version, "recd.lineage_key", ours)


def test_a_day_without_clicks_decides_nothing_and_the_champion_stays(daily):
    """An evaluation day whose labels are all 0: AUC is undefined and NE divides by a zero
    entropy, so no decision is made, with the reason, and the champion keeps serving."""
    from recd_core.config import RegistryConfig
    from recd_core.mlops.registry import register_and_promote
    from recd_core.mlops.tracking import Tracker
    from recd_core.modeling.evaluate import evaluate

    root, uri, _ = daily
    wh = Warehouse(root / "wh")
    rows = wh.read("samples", NEXT, layout="clustered")
    rows = rows.set_column(
        rows.schema.get_field_index("label"),
        rows.schema.field("label"),
        pa.array(np.zeros(rows.num_rows, np.int8)),
    )
    quiet = "2026-11-09"
    with wh.writing("samples", quiet, layout="clustered") as w:
        w.write(rows)
    client = MlflowClient(tracking_uri=uri)
    before = client.get_model_version_by_alias("recd-dlrm", "champion").version
    model = json.loads((root / "day2.json").read_text())["train.model_uri"]
    scored = evaluate(wh, model, quiet)
    tracker = Tracker(uri)
    run_id = tracker.start("register", {"ds": quiet})
    out = register_and_promote(tracker, wh, model, run_id, quiet, scored, RegistryConfig())
    assert out["registry.decision"] == "no decision" and not out["registry.promoted"]
    assert "no clicks" in out["registry.reason"]
    assert client.get_model_version_by_alias("recd-dlrm", "champion").version == before
    tags = client.get_model_version("recd-dlrm", str(out["registry.version"])).tags
    assert tags["recd.decision"] == "no decision" and "no clicks" in tags["recd.decision_reason"]


def test_a_backfilled_day_cannot_judge_a_champion_that_learned_from_it(daily):
    """A run for an earlier day (a backfill) scores on a day the champion trained on: no
    comparison is fair, so nothing is decided and the champion stays, saying why."""
    root, uri, _ = daily
    client = MlflowClient(tracking_uri=uri)
    before = client.get_model_version_by_alias("recd-dlrm", "champion")
    assert before.tags["recd.trained_on"] >= DAY  # a day after the one backfilled
    common = (
        "--warehouse",
        root / "wh",
        "--logs",
        root / "logs",
        "--out",
        root / "out",
        "--config",
        Path(__file__).parent / "configs/small.yaml",
    )
    recd(
        "--tracking-uri",
        uri,
        "run",
        *common,
        "--ds",
        "2026-10-31",
        "--summary",
        root / "backfill.json",
    )
    out = json.loads((root / "backfill.json").read_text())  # trained 10-31, scored 11-01
    assert (
        out["registry.decision"] == "no decision"
        and "cannot be judged on" in out["registry.reason"]
    )
    assert client.get_model_version_by_alias("recd-dlrm", "champion").version == before.version


def test_a_champion_whose_artifacts_vanished_does_not_stick_the_daily_run(daily):
    """The champion's artifacts deleted from the store: the next day warm-starts from the
    newest readable ancestor (or scratch), says why, tags the champion unreadable, and the
    new model is promoted (an unreadable champion cannot serve). Runs last: it breaks the
    module's champion."""

    root, uri, _ = daily
    client = MlflowClient(tracking_uri=uri)
    gone = client.get_model_version_by_alias("recd-dlrm", "champion")
    location = client.get_logged_model(gone.tags["recd.model_id"]).artifact_location
    stored = Path(urllib.parse.urlparse(location).path)
    assert location.startswith("file://") and stored.is_dir(), location
    shutil.rmtree(stored)
    common = (
        "--warehouse",
        root / "wh",
        "--logs",
        root / "logs",
        "--out",
        root / "out",
        "--config",
        Path(__file__).parent / "configs/small.yaml",
    )
    recd("--tracking-uri", uri, "run", *common, "--ds", THIRD, "--summary", root / "day3.json")
    day3 = json.loads((root / "day3.json").read_text())
    assert f"models:/recd-dlrm/{gone.version} cannot be read" in day3["train.init_from"]
    assert client.get_model_version("recd-dlrm", gone.version).tags["recd.unreadable"]
    assert day3["registry.decision"] == "promoted" and "cannot be read" in day3["registry.reason"]
    assert client.get_model_version_by_alias("recd-dlrm", "champion").version != gone.version


def test_a_daily_runs_description_states_its_outcome(daily):
    """The daily parent run opens on its answer: the next-day NE against the oracle's and
    the registry's decision, as its description (the run page's first line)."""
    root, uri, _ = daily
    day2 = json.loads((root / "day2.json").read_text())
    parent = MlflowClient(tracking_uri=uri).get_run(day2["mlflow.run_id"])
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith(f"Next-day NE **{day2['eval.ne']:.4f}**"), note
    assert f"on {THIRD}" in note and f"v{day2['registry.version']}: " in note, note
