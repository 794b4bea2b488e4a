"""Both DAGs under a real Airflow: `airflow standalone` on loopback (API server, scheduler,
DAG processor, triggerer, LocalExecutor, SQLite), each DAG triggered over the public REST API
as a client would (a JWT from /auth/token, then /api/v2), then polled until it ends.

Unlike `dag.test()`, this goes through DAG serialization, the scheduler, the executor and
the task supervisor talking to the execution API: the path production runs take."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from airflow_env import airflow_env
from doc_blocks import block_with, run_block
from mlflow.tracking import MlflowClient

from recd_core.modeling.launch import free_port
from recd_core.orchestration.graph import COMPARISON, DAILY

AIRFLOW = Path(sys.executable).parent / "airflow"
REPO = Path(__file__).resolve().parents[1]
USER, PASSWORD = "recd", "recd-test-password"


class Api:
    """A minimal REST client: JSON in, JSON out, the bearer token on every call."""

    def __init__(self, base: str):
        self.base, self.token = base, None

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(
            self.base + path,
            method=method,
            data=json.dumps(body).encode() if body else None,
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.token}"} if self.token else {}),
            },
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")

    def login(self) -> None:
        self.token = self.call("POST", "/auth/token", {"username": USER, "password": PASSWORD})[
            "access_token"
        ]


def _wait(what: str, probe, timeout: float, server: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
            if value:
                return value
        except (urllib.error.URLError, OSError, KeyError):
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what}: gave up; airflow standalone log:\n{log.read_text()[-4000:]}")
        time.sleep(3)


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    root = tmp_path_factory.mktemp("airflow-server")
    home = root / "home"
    home.mkdir()
    (home / "passwords.json").write_text(json.dumps({USER: PASSWORD}))
    port = free_port()
    env = {
        # trigger only (no scheduled run); real logs: the daily run waits for their markers
        **airflow_env(home, root, schedule="", retries=0, synthesize="false", logs_poke_s=3),
        "PATH": f"{AIRFLOW.parent}:{os.environ['PATH']}",  # standalone execs `airflow`
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        # the task supervisor reaches the execution API here: it must match the port
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
    }
    log = root / "standalone.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [str(AIRFLOW), "standalone"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = Api(f"http://127.0.0.1:{port}")
    try:
        _wait("the API server", lambda: api.login() or True, 240, server, log)
        for dag in (DAILY.name, COMPARISON.name):  # parsed by the DAG processor, serialized
            _wait(
                f"{dag} parsed",
                lambda d=dag: api.call("GET", f"/api/v2/dags/{d}"),
                240,
                server,
                log,
            )
        yield api, root, server, log
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def _trigger_and_wait(airflow, dag_id: str, body: dict) -> tuple[dict, list[dict]]:
    api = airflow[0]
    api.call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
    run = api.call("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)
    path = f"/api/v2/dags/{dag_id}/dagRuns/{run['dag_run_id']}"
    return _ended(airflow, path)


def _ended(airflow, path: str) -> tuple[dict, list[dict]]:
    """The DAG run at `path` once it has ended, and its task instances."""
    api, _, server, log = airflow

    def ended():
        api.login()  # tokens expire; a long run outlives one
        state = api.call("GET", path)
        return state if state["state"] in ("success", "failed") else None

    final = _wait(f"{path.split('/')[4]} run", ended, 900, server, log)
    return final, api.call("GET", f"{path}/taskInstances")["task_instances"]


def test_a_scheduled_style_daily_run_waits_for_complete_logs_then_succeeds(airflow):
    """A run for 2026-11-03 00:00 (as the scheduler would create it) reads 2026-11-01 and
    2026-11-02; their logs arrive only after it has started waiting for them."""
    from recd_core.config_files import load_pipeline_config
    from recd_core.data.synth import synthesize_missing

    api, root, server, log = airflow
    api.call("PATCH", f"/api/v2/dags/{DAILY.name}", {"is_paused": False})
    body = {"logical_date": "2026-11-03T00:00:00Z", "conf": {}}
    run = api.call("POST", f"/api/v2/dags/{DAILY.name}/dagRuns", body)
    path = f"/api/v2/dags/{DAILY.name}/dagRuns/{run['dag_run_id']}"

    def waiting():
        api.login()
        ti = api.call("GET", f"{path}/taskInstances/wait_for_logs")
        return ti["state"] == "up_for_reschedule"

    _wait("wait_for_logs looking for the logs", waiting, 300, server, log)
    assert api.call("GET", path)["state"] == "running"
    assert not (root / "wh" / "events").exists()  # nothing read before the logs are complete
    cfg = load_pipeline_config(REPO / "tests" / "configs" / "small.yaml")
    synthesize_missing(root / "logs", ["2026-11-01", "2026-11-02"], cfg.features, cfg.synth)
    final, tis = _ended(airflow, path)
    states = {t["task_id"]: t["state"] for t in tis}
    assert final["state"] == "success", states
    assert set(states) == {t.id for t in DAILY.tasks} | {"wait_for_logs"}
    assert set(states.values()) == {"success"}
    assert (root / "wh" / "events" / "ds=2026-11-01" / "_manifest.json").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    champion = client.get_model_version_by_alias("recd-dlrm", "champion")
    assert champion.tags["recd.trained_on"] == "2026-11-01"
    # the task logs read like the CLI: training's progress, the stage's summary; MLflow's
    # INFO lines are not errors
    train = _log(api, f"{path}/taskInstances/train/logs/1")
    events = [str(e.get("event", "")) for e in train]
    assert any(e.startswith("train 2026-11-01 dedup: step") for e in events), events[-40:]
    assert any("recd train" in e for e in events) and any("train.val_ne" in e for e in events)
    # nothing normal at WARNING or ERROR in any task's log of the successful run
    for task_id in states:
        records = _log(api, f"{path}/taskInstances/{task_id}/logs/1")
        loud = [e for e in records if e.get("level") in ("warning", "error", "critical")]
        assert loud == [], (task_id, loud[:3])
    # its MLflow run named for its kind, day, trigger and start
    parent = client.search_runs(
        [client.get_experiment_by_name("recd").experiment_id], "tags.`recd.stage` = 'pipeline'"
    )[0]
    assert parent.info.run_name.startswith("recd_daily_retrain 2026-11-01 manual · started ")


def test_a_manual_run_of_the_scheduled_runs_day_trains_nothing_and_registers_nothing_new(airflow):
    """Triggered from the form for the day the scheduled-style run above trained: its data
    stages keep that run's partitions, its training uses that run's model, its register
    stage adds no version; its logs say so, with no error."""
    api, root, _, _ = airflow
    # triggered as docs/operations.md says, pasted into a shell (this server's address)
    said = run_block(
        block_with("/api/v2/dags/recd_daily_retrain/dagRuns"),
        {"http://localhost:8080": api.base, '"username": "admin"': f'"username": "{USER}"'},
        env={"PASSWORD": PASSWORD},
    )
    assert said.returncode == 0, said.stderr
    run = json.loads(said.stdout)
    assert run["conf"] == {"ds": "2026-11-01"}, run
    path = f"/api/v2/dags/{DAILY.name}/dagRuns/{run['dag_run_id']}"
    final, tis = _ended(airflow, path)
    assert final["state"] == "success", {t["task_id"]: t["state"] for t in tis}
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    assert [str(v.version) for v in client.search_model_versions("name = 'recd-dlrm'")] == ["1"]
    train = _log(api, f"{path}/taskInstances/train/logs/1")
    events = [str(e.get("event", "")) for e in train]
    assert any("was trained by an earlier run" in e for e in events), events[-40:]
    register = _log(api, f"{path}/taskInstances/register/logs/1")
    said = " ".join(" ".join(str(e.get("event", "")).split()) for e in register)  # wrapped
    assert "already registered as version 1" in said, said[-2000:]
    errors = [e for e in train + register if e.get("level") in ("error", "critical")]
    assert errors == [], errors[:5]


def _log(api: Api, path: str) -> list[dict]:
    """A task try's log as Airflow's REST API serves it: structured records."""
    api.login()
    return api.call("GET", path + "?full_content=true")["content"]


def test_the_comparison_dag_runs_both_arms_over_days_when_triggered_over_the_rest_api(airflow):
    conf = {"ds": "2026-11-01", "days": 2, "preset": "small", "batch_size": 512}
    final, tis = _trigger_and_wait(airflow, COMPARISON.name, {"logical_date": None, "conf": conf})
    states = {t["task_id"]: t["state"] for t in tis}
    assert final["state"] == "success", states
    assert set(states) == {t.id for t in COMPARISON.tasks} | {"wait_for_logs"}
    _, root, _, _ = airflow
    compare_logs = "".join(
        p.read_text()
        for p in (root / "home" / "logs").rglob("*.log")
        if "task_id=compare" in str(p)
    )
    assert "next-day NE" in compare_logs and "train samples/s" in compare_logs  # the table
    wh = root / "compare" / "small" / "warehouse"
    for day in ("2026-11-01", "2026-11-02"):  # two training days, both arms
        for mode in ("dedup", "baseline"):
            assert (wh / f"batches/mode={mode}/ds={day}/_manifest.json").exists()
    chart = wh / "reports" / "compare" / "ds=2026-11-01" / "compare-2026-11-01.png"
    assert chart.read_bytes()[:4] == b"\x89PNG"
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("recd")
    runs = client.search_runs([exp.experiment_id], "tags.`recd.stage` = 'pipeline'")
    run = next(r for r in runs if "eval/ne.baseline" in r.data.metrics)
    metrics = run.data.metrics
    # throughput is a benchmark figure (two cores shared with a scheduler make it noisy):
    # here both arms' figures and their ratio are recorded; storage shrinks deterministically
    for arm in ("dedup", "baseline"):
        assert metrics[f"train/samples_per_s.{arm}"] > 0 and metrics[f"dpp/samples_per_s.{arm}"] > 0
    assert metrics["train/speedup"] == pytest.approx(
        metrics["train/samples_per_s.dedup"] / metrics["train/samples_per_s.baseline"]
    )
    assert metrics["storage/ratio"] > 1.5
    assert abs(metrics["eval/ne.dedup"] - metrics["eval/ne.baseline"]) < 0.01
    assert chart.name in [a.path for a in client.list_artifacts(run.info.run_id)]
