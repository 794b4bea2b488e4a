"""The screenshots in docs/operations.md, taken from the real UIs (`make screenshots`).

An Airflow standalone on the project's DAGs (the tests' small config, no schedule), one
daily run triggered over its REST API as the docs say and one that fails (a config file that
does not exist); `mlflow server` on the runs' store; a headless Chromium (Debian's
`chromium`, driven by Playwright) opens the pages a user opens first and saves them to
docs/images/. Everything it starts lives under build/screenshots/ and is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DAG = "recd_daily_retrain"
DAY = "2026-11-01"
SIZE = {"width": 1500, "height": 1000}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, method: str, path: str, body: dict | None = None, token: str = "") -> dict:
    req = urllib.request.Request(
        base + path,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        },
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def wait(what: str, probe, timeout: float, every: float = 3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := probe():
                return value
        except OSError:
            pass
        time.sleep(every)
    raise SystemExit(f"screenshots: gave up waiting for {what}")


@contextmanager
def started(cmd: list[str], env: dict, log: Path):
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def airflow_env(root: Path, port: int) -> dict:
    return {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "AIRFLOW_HOME": str(root / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags" / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "RECD_WAREHOUSE": str(root / "wh"),
        "RECD_LOGS": str(root / "logs"),
        "RECD_TRACKING_URI": f"sqlite:///{root}/mlflow.db",
        "RECD_CONFIG": str(REPO / "tests" / "configs" / "small.yaml"),
        "RECD_SCHEDULE": "",
        "RECD_RETRIES": "0",
    }


def run_dags(root: Path, base: str) -> tuple[str, str]:
    """A daily run that succeeds and one that fails, both ended: their run ids."""
    token = call(base, "GET", "/auth/token")["access_token"]  # every user an admin here
    call(base, "PATCH", f"/api/v2/dags/{DAG}", {"is_paused": False}, token)
    runs = f"/api/v2/dags/{DAG}/dagRuns"
    good = call(base, "POST", runs, {"logical_date": None, "conf": {"ds": DAY}}, token)
    time.sleep(2)
    missing = str(root / "no-such-config.yaml")
    bad = call(
        base, "POST", runs, {"logical_date": None, "conf": {"ds": DAY, "config": missing}}, token
    )
    for run in (good, bad):
        path = f"{runs}/{run['dag_run_id']}"
        wait(
            f"run {run['dag_run_id']}",
            lambda p=path: call(base, "GET", p, token=token)["state"] in ("success", "failed"),
            1200,
        )
    return good["dag_run_id"], bad["dag_run_id"]


def shoot(af: str, ml: str, good: str, bad: str, root: Path, out: Path) -> None:
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import sync_playwright

    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("recd").experiment_id
    parents = client.search_runs([exp], "tags.`recd.stage` = 'pipeline'")
    daily = next(r for r in parents if r.info.status == "FINISHED").info.run_id
    failed = next(r for r in parents if r.info.status == "FAILED").info.run_id
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport=SIZE, device_scale_factor=1)

        # Airflow: the trigger form, its overrides open
        page.goto(f"{af}/dags/{DAG}")
        page.get_by_role("button", name="Trigger").first.click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_text("Config overrides").first.click()
        page.wait_for_timeout(1500)
        dialog.get_by_text("Config overrides").first.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        page.screenshot(path=out / "airflow-trigger-form.png")
        page.keyboard.press("Escape")

        # Airflow: the end of a train task's log, and the failed run's failing task
        shots = ((good, "train", "airflow-train-log"), (bad, "start", "airflow-failed-run"))
        page.set_viewport_size({"width": SIZE["width"], "height": 1400})  # the table whole
        for run, task, name in shots:
            page.goto(f"{af}/dags/{DAG}/runs/{run}/tasks/{task}")
            for _ in range(4):  # the viewer loads a long log as it is scrolled
                page.wait_for_timeout(2000)
                page.mouse.move(800, 600)
                page.mouse.wheel(0, 100000)
            page.screenshot(path=out / f"{name}.png")

        page.set_viewport_size(SIZE)
        # MLflow (its model-training view): the daily run, its description stating the
        # outcome, its charts by section, and the failed run
        view = "?workflowType=machine_learning"
        for run, tab, name in (
            (daily, "", "mlflow-daily-run"),
            (daily, "/model-metrics", "mlflow-daily-charts"),
            (failed, "", "mlflow-failed-run"),
        ):
            page.goto(f"{ml}/#/experiments/{exp}/runs/{run}{tab}{view}")
            page.wait_for_timeout(5000)
            close = page.get_by_role("button", name="Close")
            if close.count():  # the assistant's side panel
                close.first.click()
                page.wait_for_timeout(500)
            if not tab:
                page.get_by_text("Description", exact=True).first.scroll_into_view_if_needed()
            else:  # every section's header and first charts in one view
                page.evaluate("document.body.style.zoom = '0.5'")
            page.wait_for_timeout(1500)
            page.screenshot(path=out / f"{name}.png")
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    args = parser.parse_args()
    root = REPO / "build" / "screenshots"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    af_port, ml_port = free_port(), free_port()
    af, ml = f"http://127.0.0.1:{af_port}", f"http://127.0.0.1:{ml_port}"
    env = airflow_env(root, af_port)
    with started([str(BIN / "airflow"), "standalone"], env, root / "airflow.log"):
        wait("Airflow's API", lambda: call(af, "GET", "/auth/token"), 300)
        wait(
            f"{DAG} parsed",
            lambda: call(
                af,
                "GET",
                f"/api/v2/dags/{DAG}",
                token=call(af, "GET", "/auth/token")["access_token"],
            ),
            300,
        )
        good, bad = run_dags(root, af)
        print(f"screenshots: runs {good} and {bad} ended", flush=True)
        mlflow = [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--host",
            "127.0.0.1",
            "--port",
            str(ml_port),
        ]
        with started(mlflow, env, root / "mlflow.log"):
            wait(
                "MLflow",
                lambda: urllib.request.urlopen(f"{ml}/health", timeout=5).status == 200,
                120,
            )
            args.out.mkdir(parents=True, exist_ok=True)
            shoot(af, ml, good, bad, root, args.out)
    print(f"screenshots: written to {args.out}")


if __name__ == "__main__":
    main()
