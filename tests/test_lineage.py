"""Lineage: late data, reruns, redeliveries and config changes never pass silently into a
model. Each test is a case an operator of the daily pipeline meets."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from recd_core.config import (
    GenerateConfig,
    IngestConfig,
    ModelConfig,
    PreprocessConfig,
    TrainConfig,
)
from recd_core.config_files import load_yaml
from recd_core.data.generate import generate
from recd_core.data.ingest import ingest
from recd_core.dpp.preprocess import preprocess
from recd_core.lineage import FeaturesDiffer, StaleInput, status
from recd_core.modeling.evaluate import EvaluationLeak, evaluate
from recd_core.modeling.train import train
from recd_core.warehouse import Warehouse

DAY, NEXT = "2026-11-01", "2026-11-02"
SMALL = ModelConfig(embedding_dim=8, bottom_mlp=[16], top_mlp=[16], history_ff=16)
TRAIN = TrainConfig(batch_size=512, epochs=1, max_steps=6, model=SMALL, warm_start=False)


def lines_of(day_dir: Path) -> list[bytes]:
    out = []
    for f in sorted(day_dir.glob("*.jsonl.gz")):
        out += gzip.decompress(f.read_bytes()).splitlines()
    return out


def shifted(lines: list[bytes], n: int, by: int = 50_000_000) -> list[bytes]:
    """`n` events of the day as new ones (new event and session ids, same time): late data."""
    out = []
    for line in lines[:n]:
        e = json.loads(line)
        e["event_id"] += by
        e["session_id"] += by
        out.append(json.dumps(e).encode())
    return out


def day(tmp_path, small_logs, ds=DAY) -> Path:
    dst = tmp_path / "logs" / f"ds={ds}"
    shutil.copytree(small_logs / f"ds={ds}", dst)
    return dst


def build(wh, src, features, ds=DAY, cfg=IngestConfig()):
    ing = ingest(src, wh, ds, features, cfg)
    generate(wh, ds, GenerateConfig(), ("clustered",), features=features)
    return ing


def recd(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "recd_core.cli", *args], capture_output=True, text=True, timeout=300
    )


def error_line(proc) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_late_data_re_ingested_makes_the_days_samples_and_batches_stale(
    tmp_path, small_logs, features
):
    wh = Warehouse(tmp_path / "wh")
    src = day(tmp_path, small_logs)
    first = build(wh, src, features)
    preprocess(wh, DAY, PreprocessConfig(batch_size=512), features=features)
    before = wh.manifest("batches", DAY, mode="dedup")["write_id"]
    # 1,000 late events of the day arrive and the day is re-ingested
    late = shifted(lines_of(src), 1000)
    (src / "late.jsonl").write_bytes(b"\n".join(late) + b"\n")
    assert status(wh, DAY)[0]["state"] == "stale"  # events: its logs changed
    again = ingest(src, wh, DAY, features, IngestConfig())
    assert again["ingest.rows_ok"] == first["ingest.rows_ok"] + 1000
    with pytest.raises(StaleInput) as e:
        preprocess(wh, DAY, PreprocessConfig(batch_size=512), features=features)
    msg = str(e.value)
    assert "\n" not in msg and f"samples/layout=clustered/ds={DAY} is stale" in msg
    assert f"rerun `recd generate --ds {DAY}`" in msg
    assert wh.manifest("batches", DAY, mode="dedup")["write_id"] == before  # nothing written
    # the CLI says the same in one line, exit 2
    proc = recd("preprocess", "--warehouse", str(wh.uri), "--ds", DAY)
    assert proc.returncode == 2 and "is stale" in error_line(proc)
    # rebuilt in order, every row of the new events reaches the batches
    generate(wh, DAY, GenerateConfig(), ("clustered",), features=features)
    s = preprocess(wh, DAY, PreprocessConfig(batch_size=512), features=features)
    assert s["dpp.samples"] == again["ingest.rows_ok"]
    assert {r["partition"]: r["state"] for r in status(wh, DAY)} == {
        f"events/ds={DAY}": "fresh",
        f"quarantine/ds={DAY}": "fresh",
        f"samples/layout=clustered/ds={DAY}": "fresh",
        f"batches/mode=dedup/ds={DAY}": "fresh",
    }


def test_a_split_read_sees_one_version_while_the_partition_is_replaced(fresh_warehouse):
    wh = fresh_warehouse
    old = wh.read("samples", DAY, layout="clustered")
    ids_old = np.asarray(old["event_id"])
    seen = []

    def rewrite_midway(label, n=1):  # after the first split: the partition is replaced
        if len(seen) == 0:
            with wh.writing("samples", DAY, layout="clustered") as w:
                w.write(old.slice(0, 1000).replace_schema_metadata(old.schema.metadata))
        seen.append(label)

    cfg = PreprocessConfig(batch_size=256, batches_per_split=2, validation_fraction=0.0)
    s = preprocess(wh, DAY, cfg, progress=rewrite_midway)
    assert len(seen) > 2  # several splits read around the rewrite
    assert s["dpp.samples"] == old.num_rows  # the pinned version, whole: none twice, none lost
    assert wh.manifest("samples", DAY, layout="clustered")["rows"] == 1000  # the rewrite landed
    # the batches' lineage names the version they were read from, now replaced: stale
    with pytest.raises(StaleInput, match="rewritten since"):
        train(wh, DAY, TRAIN.model_copy(update={"batch_size": 256}))
    # a worker process reads the pinned version too, and a pin leaves nothing behind
    with wh.pinned("samples", DAY, layout="clustered"):
        token = wh.pin_token("samples", DAY, layout="clustered")
        with wh.writing("samples", DAY, layout="clustered") as w:
            w.write(old.slice(0, 10).replace_schema_metadata(old.schema.metadata))
        other = Warehouse(wh.uri).adopt(token)
        assert other.read_range("samples", DAY, 0, 1000, layout="clustered").num_rows == 1000
    assert not list(Path(wh.root, "samples", "_pins").iterdir())
    assert ids_old.size == old.num_rows


def test_evaluation_on_a_training_day_or_another_days_model_is_refused(fresh_warehouse, features):
    wh = fresh_warehouse
    preprocess(wh, DAY, PreprocessConfig(batch_size=512), features=features)
    uri = train(wh, DAY, TRAIN, features=features)["train.model_uri"]
    with pytest.raises(EvaluationLeak, match="not after its last training day") as e:
        evaluate(wh, uri, DAY)
    assert "\n" not in str(e.value)
    with pytest.raises(EvaluationLeak, match=f"was not trained on --ds {NEXT}"):
        evaluate(wh, uri, "2026-11-03", trained_on=NEXT)
    ok = evaluate(wh, uri, NEXT, trained_on=DAY)
    assert ok["eval.ds"] == NEXT and ok["eval.samples"] > 0
    proc = recd(
        "evaluate", "--warehouse", str(wh.uri), "--ds", DAY, "--eval-ds", DAY, "--model-uri", uri
    )
    assert proc.returncode == 2 and "would score rows it learned from" in error_line(proc)
    assert ok["eval.model_lineage"] == "fresh"
    # a model whose batches were rebuilt since it trained (another DPP config): scored (it
    # is an artifact of its own), and said to be stale, here and in `recd status`
    preprocess(wh, DAY, PreprocessConfig(batch_size=512, batches_per_split=3), features=features)
    again = evaluate(wh, uri, NEXT)
    assert again["eval.ne"] == ok["eval.ne"] and "rerun `recd train" in again["eval.model_lineage"]
    row = next(r for r in status(wh, DAY) if r["partition"].startswith("models/"))
    assert row["state"] == "stale" and "rewritten since" in row["why"]


@pytest.mark.parametrize("change", ["drop", "halve"])
def test_a_config_whose_features_differ_from_the_stored_data_is_refused(
    fresh_warehouse, tmp_path, change
):
    from recd_core.config import PACKAGE_CONFIGS

    data = load_yaml(PACKAGE_CONFIGS / "synthetic.yaml")
    feats = data["features"]["features"]
    if change == "drop":
        name = feats.pop()["name"]
        expected = f"'{name}' not in the config"
    else:
        spec = next(
            f
            for f in feats
            if f.get("table_size")
            and f["name"] not in ("user_id", "item_id")
            and not f.get("table")
        )
        spec["table_size"] //= 2
        expected = f"'{spec['name']}' defined differently"
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = recd(
        "preprocess", "--warehouse", str(fresh_warehouse.uri), "--ds", DAY, "--config", str(path)
    )
    line = error_line(proc)
    assert proc.returncode == 2 and expected in line and "feature set" in line
    assert not fresh_warehouse.exists("batches", DAY, mode="dedup")
    with pytest.raises(FeaturesDiffer):
        from recd_core.config_files import load_pipeline_config

        cfg = load_pipeline_config(path)
        generate(fresh_warehouse, DAY, GenerateConfig(), ("clustered",), features=cfg.features)


def test_a_redelivery_across_midnight_is_quarantined_with_the_day_first_published(
    tmp_path, small_logs, features
):
    wh = Warehouse(tmp_path / "wh")
    first = ingest(day(tmp_path, small_logs), wh, DAY, features, IngestConfig())
    nxt = day(tmp_path, small_logs, NEXT)
    again = lines_of(small_logs / f"ds={DAY}")[-500:]  # the end of the day, delivered twice
    (nxt / "redelivered.jsonl").write_bytes(b"\n".join(again) + b"\n")
    cfg = IngestConfig(max_quarantine_fraction=0.2)
    s = ingest(nxt, wh, NEXT, features, cfg)
    assert s["ingest.rows_redelivered"] == 500
    assert s["ingest.rows_in"] == s["ingest.rows_ok"] + s["ingest.rows_quarantined"]
    q = wh.read("quarantine", NEXT)
    reasons = [r for r in q["reason"].to_pylist() if r.startswith("redelivered")]
    assert len(reasons) == 500 and all(f"published on ds={DAY}" in r for r in reasons)
    published = set(np.asarray(wh.read("events", DAY, ["event_id"])["event_id"]).tolist())
    nxt_ids = set(np.asarray(wh.read("events", NEXT, ["event_id"])["event_id"]).tolist())
    assert not published & nxt_ids  # the evaluation day holds no training day's event
    assert s["ingest.inputs"] == {f"events/ds={DAY}": wh.manifest("events", DAY)["write_id"]}
    assert first["ingest.rows_redelivered"] == 0
    # the day before re-ingested: the next day's redelivery check read another version
    ingest(day(tmp_path / "again", small_logs), wh, DAY, features, IngestConfig())
    rows = {r["partition"]: r for r in status(wh, NEXT)}
    assert rows[f"events/ds={NEXT}"]["state"] == "stale"
    assert f"rerun `recd ingest --ds {NEXT}`" in rows[f"events/ds={NEXT}"]["why"]


def test_a_redelivery_is_caught_whichever_of_the_two_days_is_ingested_first(
    tmp_path, small_logs, features
):
    """The next day ingested before the day (a backfill): 50 of the day's events, delivered
    again in the next day's logs, were published there first; the day's own ingest then
    quarantines them, naming the next day, and each event is published once. The later day
    is no peer of the earlier one in its lineage (each would make the other stale)."""
    wh = Warehouse(tmp_path / "wh")
    nxt = day(tmp_path, small_logs, NEXT)
    again = lines_of(small_logs / f"ds={DAY}")[-50:]
    (nxt / "redelivered.jsonl").write_bytes(b"\n".join(again) + b"\n")
    later = ingest(nxt, wh, NEXT, features, IngestConfig())
    assert later["ingest.rows_redelivered"] == 0  # nothing published before it: kept there
    s = ingest(day(tmp_path, small_logs), wh, DAY, features, IngestConfig())
    assert s["ingest.rows_redelivered"] == 50
    reasons = [
        r for r in wh.read("quarantine", DAY)["reason"].to_pylist() if r.startswith("redelivered")
    ]
    assert len(reasons) == 50 and all(f"published on ds={NEXT}" in r for r in reasons)
    ids = [
        set(np.asarray(wh.read("events", d, ["event_id"])["event_id"]).tolist())
        for d in (DAY, NEXT)
    ]
    assert not ids[0] & ids[1]
    assert s["ingest.inputs"] == {}  # no day before; the later day read, not a peer
    assert {r["state"] for r in status(wh, DAY) + status(wh, NEXT)} == {"fresh"}


@pytest.mark.parametrize("damage", ["not json", "lineage a string", "inputs a list", "rows a dict"])
def test_status_lists_a_damaged_manifest_as_damaged_and_goes_on(fresh_warehouse, damage):
    """`recd status` on a day whose events manifest is damaged: that row `damaged` (why),
    the rest listed, exit 0; no traceback."""
    from recd_core.warehouse import MANIFEST

    path = Path(fresh_warehouse.partition_path("events", DAY)) / MANIFEST
    m = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{ not json")
    else:
        field, value = {
            "lineage a string": ("lineage", "x"),
            "rows a dict": ("rows", {"a": 1}),
            "inputs a list": ("lineage", {**m["lineage"], "inputs": [1]}),
        }[damage]
        path.write_text(json.dumps({**m, field: value}))
    rows = {r["partition"]: r for r in status(fresh_warehouse, DAY)}
    assert rows[f"events/ds={DAY}"]["state"] == "damaged", rows[f"events/ds={DAY}"]
    # what was built from it: stale where its lineage cannot be followed up through it
    follows = "fresh" if damage == "rows a dict" else "stale"  # its write id still matches
    assert rows[f"samples/layout=clustered/ds={DAY}"]["state"] == follows
    status_cmd = [sys.executable, "-m", "recd_core.cli", "status", "--ds", DAY]
    status_cmd += ["--warehouse", fresh_warehouse.uri]
    r = subprocess.run(status_cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "damaged" in r.stdout + r.stderr


def test_every_file_of_a_day_is_read_by_its_content_or_named(tmp_path, small_logs, features):
    src = day(tmp_path, small_logs)
    lines = lines_of(src)
    for f in src.glob("*.jsonl.gz"):
        f.unlink()
    quarter = len(lines) // 4
    parts = [lines[i * quarter : (i + 1) * quarter] for i in range(3)] + [lines[3 * quarter :]]
    (src / "A.JSONL.GZ").write_bytes(gzip.compress(b"\n".join(parts[0]) + b"\n"))
    (src / "b.jsonl.gz.1").write_bytes(gzip.compress(b"\n".join(parts[1]) + b"\n"))
    (src / "c.log").write_bytes(b"\n".join(parts[2]) + b"\n")
    (src / "d.jsonl").write_bytes(b"\n".join(parts[3]) + b"\n")
    (src / "notes.bin").write_bytes(b"\x00\x01binary dump")
    (src / "_SUCCESS").write_bytes(b"")  # a marker: named, not read
    wh = Warehouse(tmp_path / "wh")
    s = ingest(src, wh, DAY, features, IngestConfig())
    assert s["ingest.rows_ok"] == len(lines)  # all four read, whatever their names
    assert s["ingest.files"] == 5 and s["ingest.files_refused"] == 1
    ((name, why),) = s["ingest.refused_files"].items()
    assert name.endswith("notes.bin") and "not a recognized format" in why
    q = wh.read("quarantine", DAY).to_pylist()
    assert [r["source"] for r in q] == [name]  # named in the quarantine, counted
    assert s["ingest.rows_in"] == len(lines) + 1
    assert any(n.endswith("_SUCCESS") for n in s["ingest.ignored_files"])


def test_a_validation_slice_of_one_class_chooses_nothing(tmp_path, small_logs, features):
    src = day(tmp_path, small_logs)
    events = [json.loads(x) for x in lines_of(src)]
    late = np.quantile([e["ts"] for e in events], 0.8)
    for e in events:
        if e["ts"] >= late:
            e["label"] = 0  # the day's latest rows hold no click
    for f in src.glob("*.jsonl.gz"):
        f.unlink()
    (src / "events.jsonl").write_bytes(b"\n".join(json.dumps(e).encode() for e in events))
    wh = Warehouse(tmp_path / "wh")
    build(wh, src, features)
    preprocess(wh, DAY, PreprocessConfig(batch_size=512), features=features)
    s = train(wh, DAY, TRAIN.model_copy(update={"max_steps": None, "epochs": 2}))
    assert s["train.validation"].startswith("one class (no clicks")
    assert s["train.validated"] is False and "train.val_ne" not in s
    assert (
        "train.calibration_slope" not in s and s["train.steps"] == 2 * s["train.steps_per_epoch"]
    )  # the configured passes


def test_status_shows_a_days_lineage_stale_after_a_re_ingest_and_fresh_after_a_run(
    tmp_path, small_logs
):
    wh, logs = tmp_path / "wh", tmp_path / "logs"
    for ds in (DAY, NEXT):
        shutil.copytree(small_logs / f"ds={ds}", logs / f"ds={ds}")
    args = ["--warehouse", str(wh), "--logs", str(logs), "--ds", DAY, "--no-synthesize"]
    cfg = tmp_path / "quick.yaml"
    base = load_yaml(Path(__file__).parents[1] / "recd_core/configs/synthetic.yaml")
    base["train"] = {
        **base.get("train", {}),
        "batch_size": 512,
        "epochs": 1,
        "max_steps": 6,
        "model": SMALL.model_dump(),
    }
    cfg.write_text(yaml.safe_dump(base))
    assert recd("run", *args, "--config", str(cfg)).returncode == 0
    states = {r["partition"]: r["state"] for r in status(Warehouse(wh), DAY)}
    assert set(states.values()) == {"fresh"} and any(p.startswith("models/") for p in states)
    # the same logs again: nothing changes (the day's events kept, everything stays fresh)
    assert recd("ingest", "--logs", str(logs), "--warehouse", str(wh), "--ds", DAY).returncode == 0
    assert {r["state"] for r in status(Warehouse(wh), DAY)} == {"fresh"}
    late = next((logs / f"ds={DAY}").glob("events-*"))  # a file of the day redelivered
    os.utime(late, (late.stat().st_atime, late.stat().st_mtime + 60))
    assert recd("ingest", "--logs", str(logs), "--warehouse", str(wh), "--ds", DAY).returncode == 0
    proc = recd(
        "status", "--warehouse", str(wh), "--ds", DAY, "--summary", str(tmp_path / "s.json")
    )
    assert proc.returncode == 0 and "stale" in proc.stderr + proc.stdout
    rows = json.loads((tmp_path / "s.json").read_text())["partitions"]
    assert rows[f"events/ds={DAY}"]["state"] == "fresh"
    assert {
        r["state"] for p, r in rows.items() if p.startswith(("samples", "batches", "models"))
    } == {"stale"}
    assert recd("run", *args, "--config", str(cfg)).returncode == 0
    after = status(Warehouse(wh), DAY)
    data = [r for r in after if not r["partition"].startswith("models/")]
    assert {r["state"] for r in data} == {"fresh"}
    models = {r["state"] for r in after if r["partition"].startswith("models/")}
    assert "fresh" in models  # the re-run's model; the one before it stays stale, named


def test_status_of_a_day_with_nothing_says_so_and_fails(fresh_warehouse):
    """A day the warehouse holds nothing of (a typo, the wrong warehouse): one line naming
    the day and the warehouse, exit 2, never an empty table and `ok`."""
    r = recd("status", "--ds", "2026-01-05", "--warehouse", fresh_warehouse.uri)
    assert r.returncode == 2, r.stdout + r.stderr
    line = error_line(r)
    assert "no partition of 2026-01-05" in line and fresh_warehouse.uri in line
    assert recd("status", "--ds", DAY, "--warehouse", fresh_warehouse.uri).returncode == 0
