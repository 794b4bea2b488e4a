"""The Airflow DAGs: they parse, their structure and schedule, a full `dag.test()` of the daily
retraining on the small preset (partitions, MLflow run, registry alias), idempotent re-runs,
and a failing stage that stops its downstream with its one-line reason in the task log.

Airflow reads its configuration at import, so every Airflow process here is a subprocess
with its own AIRFLOW_HOME (SQLite metadata, migrated once per session)."""

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pyarrow.parquet as pq
import pytest
from airflow_env import DAGS, airflow_env
from k8s_checks import assert_restricted
from mlflow.tracking import MlflowClient

from recd_core.orchestration.graph import DAILY
from recd_core.orchestration.stages import STAGES as ALL_STAGES

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
LOGICAL = "2026-11-02"  # trains 2026-11-01, evaluates 2026-11-02
TRAIN_DAY = "2026-11-01"


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow")
    env = airflow_env(home, home)
    r = subprocess.run([str(Path(PY).parent / "airflow"), "db", "migrate"], env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return home


KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: offline, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: offline, user: {token: none}}]
contexts: [{name: offline, context: {cluster: offline, user: offline}}]
current-context: offline
"""


PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag

def _pod_dict(task):
    if not hasattr(task, "build_pod_request_obj"):
        return None
    from kubernetes.client import ApiClient
    return ApiClient().sanitize_for_serialization(task.build_pod_request_obj())

bag = DagBag(dag_folder=sys.argv[1], safe_mode=False)
out = {"errors": {k: str(v)[-500:] for k, v in bag.import_errors.items()}, "dags": {}}
for dag_id, dag in bag.dags.items():
    out["dags"][dag_id] = {
        "schedule": str(dag.schedule), "catchup": dag.catchup,
        "params": sorted(dag.params.keys()),
        "tasks": {t.task_id: {
            "type": type(t).__name__, "bases": [c.__name__ for c in type(t).__mro__], "downstream": sorted(t.downstream_task_ids),
            "retries": t.retries, "backoff": t.retry_exponential_backoff,
            "outlets": [o.uri for o in t.outlets],
            "image": getattr(t, "image", None), "cmds": getattr(t, "cmds", None),
            "arguments": getattr(t, "arguments", None),
            "gpu": str(getattr(getattr(t, "container_resources", None), "limits", "") or ""),
            "volumes": [v.name for v in getattr(t, "volumes", None) or []],
            "pod": _pod_dict(t),
        } for t in dag.tasks},
    }
print("PROBE" + json.dumps(out, default=str))
"""


def _probe(env: dict) -> dict:
    r = subprocess.run([PY, "-c", PROBE, str(DAGS)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("PROBE", 1)[1])


def _run_dag(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(DAGS / "run_local.py"), *args], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


# the daily pipeline: every stage but the two-arm comparison, in order
STAGES = [s for s in ALL_STAGES if s != "compare"]


def test_the_dags_parse_with_their_schedule_and_structure(airflow_home, tmp_path):
    bag = _probe(airflow_env(airflow_home, tmp_path))
    assert bag["errors"] == {}
    assert set(bag["dags"]) == {"recd_daily_retrain", "recd_dedup_vs_baseline"}
    daily = bag["dags"]["recd_daily_retrain"]
    assert daily["schedule"] == "@daily" and daily["catchup"] is False
    tasks = daily["tasks"]
    assert set(tasks) == {t.id for t in DAILY.tasks}
    for t in DAILY.tasks:  # the graph's edges, no other
        assert tasks[t.id]["downstream"] == sorted(d.id for d in DAILY.tasks if t.id in d.after)
    for a, b in zip(STAGES, STAGES[1:], strict=False):
        assert b in tasks[a]["downstream"], a  # the chain of stages, in order
    assert tasks["ingest_eval"]["downstream"] == ["generate_eval"]
    assert sorted(tasks["generate_eval"]["downstream"]) == ["evaluate"]
    assert all(t["retries"] == 2 and t["backoff"] for t in tasks.values())
    wh = (tmp_path / "wh").as_uri()
    assert tasks["ingest"]["outlets"] == [f"{wh}/events", f"{wh}/quarantine"]
    assert tasks["generate"]["outlets"] == [f"{wh}/samples"]
    assert tasks["train"]["outlets"] == [f"{wh}/models"]
    cmp = bag["dags"]["recd_dedup_vs_baseline"]
    assert cmp["schedule"] == "None" or cmp["schedule"].lower().startswith("none")
    assert cmp["params"] == ["batch_size", "days", "ds", "preset"]
    ct = cmp["tasks"]
    for mode in ("dedup", "baseline"):
        assert ct[f"preprocess_{mode}"]["downstream"] == [f"train_{mode}"]
        assert ct[f"evaluate_{mode}"]["downstream"] == ["compare"]
    assert sorted(ct["generate"]["downstream"]) == ["preprocess_baseline", "preprocess_dedup"]
    assert ct["compare"]["downstream"] == ["finish"]


def test_the_kubernetes_switch_runs_each_stage_as_a_pod_of_the_components_image(
    airflow_home, tmp_path
):
    env = airflow_env(airflow_home, tmp_path, executor="kubernetes", image="registry.example/recd:1.2.3",
               logs_claim="recd-raw-logs", logs="/data/logs",
               train_gpus=1, synthesize="false", warehouse="s3://bucket/wh", tracking_uri="http://recd-mlflow:5000")  # fmt: skip
    kubeconfig = tmp_path / "kubeconfig"  # the operator builds its client; nothing connects
    kubeconfig.write_text(KUBECONFIG)
    bag = _probe({**env, "KUBECONFIG": str(kubeconfig)})
    assert bag["errors"] == {}
    tasks = bag["dags"]["recd_daily_retrain"]["tasks"]
    for name, t in tasks.items():  # the pods Airflow would create, as the API server sees them
        pod = t["pod"]
        kubernetes_validate.validate(pod, "1.33.0", strict=True)
        assert_restricted(name, pod["spec"])
        assert pod["spec"]["serviceAccountName"] == "recd-pipeline"
        assert {c["name"] for c in pod["spec"]["containers"]} == {"base", "airflow-xcom-sidecar"}
    for name, t in tasks.items():
        stage = DAILY.task(name).stage
        assert "KubernetesPodOperator" in t["bases"], name
        assert t["image"] == "registry.example/recd:1.2.3"
        assert t["cmds"] == ["python", "-m", f"components.{stage}"]
        assert (REPO / "components" / f"{stage}.py").exists()
        assert "--output-metadata" in t["arguments"] and "s3://bucket/wh" in t["arguments"]
        assert t["arguments"][t["arguments"].index("--synthesize") + 1] == "False"
    assert (
        "nvidia.com/gpu" in tasks["train"]["gpu"] and "nvidia.com/gpu" not in tasks["ingest"]["gpu"]
    )
    for a, b in zip(STAGES, STAGES[1:], strict=False):
        assert b in tasks[a]["downstream"]


@pytest.fixture(scope="module")
def daily_run(airflow_home, tmp_path_factory):
    root = tmp_path_factory.mktemp("daily")
    env = airflow_env(airflow_home, root)
    first = _run_dag(env, "--date", LOGICAL)
    return root, env, first


def _partition_files(root: Path) -> dict:
    wh = root / "wh"
    return {
        str(p.relative_to(wh)): pq.read_metadata(p).num_rows
        for p in sorted(wh.glob(f"*/**/ds={TRAIN_DAY}/*.parquet"))
    }


def test_a_daily_dag_run_writes_the_partitions_records_mlflow_and_names_a_champion(daily_run):
    root, _, first = daily_run
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    wh = root / "wh"
    for part in (
        "events",
        "samples/layout=clustered",
        "samples/layout=shuffled",
        "batches/mode=dedup",
    ):
        assert (wh / part / f"ds={TRAIN_DAY}" / "_manifest.json").exists(), part
    assert (wh / "samples/layout=clustered" / f"ds={LOGICAL}" / "_manifest.json").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("recd")
    pipeline = client.search_runs([exp.experiment_id], "tags.`recd.stage` = 'pipeline'")
    assert len(pipeline) == 1 and pipeline[0].info.status == "FINISHED"
    m = pipeline[0].data.metrics
    for key in ("storage.bytes", "dpp.samples_per_s", "train.samples_per_s", "eval.ne", "eval.auc"):
        assert m[key] > 0, key
    children = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{pipeline[0].info.run_id}'"
    )
    assert {r.data.tags["recd.stage"] for r in children} == set(STAGES) - {"start", "finish"}
    artifacts = {a.path for a in client.list_artifacts(pipeline[0].info.run_id)}
    assert {"config.yaml", "summary.json"} <= artifacts
    champion = client.get_model_version_by_alias("recd-dlrm", "champion")
    train_run = next(r for r in children if r.data.tags["recd.stage"] == "train")
    assert champion.run_id == train_run.info.run_id
    assert "champion decision: promoted" in first.stdout + first.stderr


def test_a_second_run_of_the_same_day_is_idempotent_with_a_new_mlflow_run(daily_run):
    root, env, _ = daily_run
    before = _partition_files(root)
    second = _run_dag(env, "--date", LOGICAL)
    assert second.returncode == 0, second.stdout[-3000:]
    after = _partition_files(root)
    # the same partitions with the same rows; files replaced, never duplicated
    strip = lambda files: sorted((str(Path(f).parent), n) for f, n in files.items())  # noqa: E731
    assert strip(after) == strip(before)
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("recd")
    assert len(client.search_runs([exp.experiment_id], "tags.`recd.stage` = 'pipeline'")) == 2
    assert len(client.search_model_versions("name='recd-dlrm'")) == 2


def test_a_failing_stage_fails_its_task_with_its_reason_and_nothing_downstream_runs(
    airflow_home, tmp_path
):
    strict = tmp_path / "strict.yaml"
    strict.write_text("features: synthetic\ningest: {max_quarantine_fraction: 0.0}\n")
    logs = tmp_path / "logs" / f"ds={TRAIN_DAY}"
    logs.mkdir(parents=True)
    (logs / "events-00000.jsonl").write_text('{"event_id": 1, "ts": "not a time"}\n')
    env = airflow_env(airflow_home, tmp_path, config=strict, retries=0)
    r = _run_dag(env, "--date", LOGICAL)
    out = r.stdout + r.stderr
    assert r.returncode == 1
    assert "recd ingest: " in out and "quarantine" in out
    assert "starting task_id=ingest " in out and "starting task_id=generate " not in out
    assert not list((tmp_path / "wh").glob(f"samples/*/ds={TRAIN_DAY}"))
    assert not (tmp_path / "wh" / "events" / f"ds={TRAIN_DAY}").exists()
