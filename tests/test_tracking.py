"""MLflow run records from the commands: a SQLite store and a real `mlflow server` on loopback."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from recd_cli import recd

DAY = "2026-11-01"


def _runs(uri, stage):
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("recd")
    return client, client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`recd.stage` = '{stage}'"
    )


def test_each_command_records_a_run_in_a_sqlite_store(tmp_path, day_logs):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    wh = tmp_path / "wh"
    recd(
        "--tracking-uri",
        uri,
        "ingest",
        "--source",
        day_logs,
        "--warehouse",
        wh,
        "--ds",
        DAY,
        "--summary",
        tmp_path / "i.json",
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}  # the environment works too
    recd("generate", "--warehouse", wh, "--ds", DAY, "--layout", "both", env=env)
    client, runs = _runs(uri, "ingest")
    assert len(runs) == 1
    run = runs[0]
    summary = json.loads((tmp_path / "i.json").read_text())
    assert summary["mlflow.run_id"] == run.info.run_id
    assert run.data.metrics["ingest/rows_ok"] == summary["ingest.rows_ok"]
    assert run.data.params["ds"] == DAY and run.data.tags["ds"] == DAY
    assert run.info.status == "FINISHED"
    assert "summary.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    _, gen = _runs(uri, "generate")
    assert gen[0].data.metrics["storage/ratio"] > 1
    assert "storage/dedup.factor.mean" in gen[0].data.metrics


def test_a_failed_stage_is_recorded_as_failed(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    r = recd(
        "--tracking-uri", uri, "generate", "--warehouse", tmp_path / "wh", "--ds", DAY, code=None
    )
    assert r.returncode == 2
    _, runs = _runs(uri, "generate")
    assert runs[0].info.status == "FAILED" and runs[0].data.tags["recd.status"] == "failed"
    # where users look: which stage failed and why, as tags and as the run's description
    tags = runs[0].data.tags
    assert tags["recd.failed_stage"] == "generate" and "no partition" in tags["recd.error"]
    assert tags["mlflow.note.content"].startswith("**Failed** at generate: no partition")


def test_a_pipeline_whose_config_cannot_be_read_ends_its_run_failed_with_the_reason(tmp_path):
    """The pipeline's MLflow run is opened by `start`; a config that does not exist fails
    it there, and the run ends FAILED saying so, never RUNNING for good."""
    from recd_core.errors import BadInput
    from recd_core.orchestration.stages import run_stage

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = {"tracking_uri": uri, "ds": DAY, "config": str(tmp_path / "missing.yaml")}
    with pytest.raises(BadInput, match="not found"):
        run_stage("start", args)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("recd").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["recd.failed_stage"] == "start"
    assert "missing.yaml" in run.data.tags["mlflow.note.content"]


def test_an_unreachable_server_fails_fast_with_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    t0 = time.monotonic()
    r = recd(
        "--tracking-uri",
        f"http://127.0.0.1:{port}",
        "synth",
        "--logs",
        tmp_path / "logs",
        "--ds",
        "2026-11-01",
        code=None,
    )
    assert r.returncode == 4 and time.monotonic() - t0 < 10
    assert "unreachable" in r.stderr and r.stderr.strip().count("\n") == 0
    assert not (tmp_path / "logs").exists(), "nothing was done"


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on loopback, started and stopped by the test."""
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            exe,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp_path}/server.db",
            "--default-artifact-root",
            str(tmp_path / "artifacts"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("mlflow server did not come up within 90 s")
    yield uri
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow
def test_commands_log_to_a_real_mlflow_server(mlflow_server, tmp_path):
    recd(
        "--tracking-uri",
        mlflow_server,
        "synth",
        "--logs",
        tmp_path / "logs",
        "--ds",
        "2026-11-01",
        "--preset",
        "small",
    )
    _, runs = _runs(mlflow_server, "synth")
    assert len(runs) == 1 and runs[0].data.metrics["ingest/synth.rows"] > 1000
    # the daily run registers its model through the server and names a champion
    recd(
        "--tracking-uri",
        mlflow_server,
        "run",
        "--warehouse",
        tmp_path / "wh",
        "--logs",
        tmp_path / "logs",
        "--ds",
        "2026-11-01",
        "--summary",
        tmp_path / "run.json",
        "--config",
        Path(__file__).parent / "configs/small.yaml",
    )
    summary = json.loads((tmp_path / "run.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_server)
    champion = client.get_model_version_by_alias("recd-dlrm", "champion")
    assert str(champion.version) == str(summary["registry.version"]) == "1"
    assert champion.run_id == summary["mlflow.run_id.train.dedup"]  # the model lives with its run


def test_a_ratio_is_worded_by_the_way_it_goes():
    """The comparison's verdict never calls a slowdown a gain: 0.82x DPP throughput reads
    '1.22x slower with dedup', not '0.82x DPP'."""
    from recd_core.mlops.run_notes import by_direction

    assert by_direction(3.08, "smaller", "larger") == "**3.08x smaller** with dedup"
    assert by_direction(0.82, "faster", "slower") == "**1.22x slower** with dedup"
    assert by_direction(1.0, "faster", "slower") == "**1.00x faster** with dedup"


def test_a_throughput_ratio_inside_its_run_to_run_noise_is_said_to_be():
    """Each arm's throughput over five stretches of its run: a ratio whose part-by-part band
    spans 1x claims nothing; one clear of it says how far it moves."""
    from recd_core.metrics import ratio_band, throughput_parts
    from recd_core.mlops.compare import ratios, table_rows
    from recd_core.mlops.run_notes import by_direction

    parts = throughput_parts([100] * 10, [1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0])
    assert parts == [100.0, 50.0, 100.0, 200.0, 100.0]
    assert ratio_band([110, 95, 120, 100, 105], [100] * 5) == (0.95, 1.2)
    assert ratio_band([1.0, 2.0], [1.0, 1.0]) is None  # too few parts to speak of a spread
    noisy = by_direction(1.07, "faster", "slower", (0.95, 1.2))
    assert "inside its run-to-run noise" in noisy and "no difference shown" in noisy
    clear = by_direction(1.9, "faster", "slower", (1.7, 2.1))
    assert clear == "**1.90x faster** with dedup (1.70x-2.10x over the runs' parts)"
    summary = {
        **{
            f"{k}.{a}": v
            for k, v in {
                "storage.bytes": 100.0,
                "eval.ne": 0.9,
                "eval.auc": 0.7,
                "eval.calibration": 1.0,
            }.items()
            for a in ("dedup", "baseline")
        },
        "dpp.samples_per_s.dedup": 107.0,
        "dpp.samples_per_s.baseline": 100.0,
        "train.samples_per_s.dedup": 190.0,
        "train.samples_per_s.baseline": 100.0,
        "dpp.parts_samples_per_s.dedup": [110, 95, 120, 100, 105],
        "dpp.parts_samples_per_s.baseline": [100] * 5,
        "train.parts_samples_per_s.dedup": [170, 190, 210, 180, 200],
        "train.parts_samples_per_s.baseline": [100] * 5,
    }
    r = ratios(summary)
    assert r["compare.dpp_speedup_low"] == 0.95 and r["compare.train_speedup_low"] == 1.7
    gains = {label: gain for label, _, _, gain in table_rows(summary)}
    assert gains["DPP samples/s"] == "1.07x (0.95-1.20, noise)"
    assert gains["train samples/s"] == "1.90x (1.70-2.10)"
