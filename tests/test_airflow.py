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
from recd_core.orchestration.graph import STAGES as ALL_STAGES
from recd_core.orchestration.stage_args import override_fields

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
RUN_DATE = "2026-11-03"  # the run of this date scores 2026-11-02, trains 2026-11-01
EVAL_DAY = "2026-11-02"
TRAIN_DAY = "2026-11-01"


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow")
    env = airflow_env(home, home)
    r = subprocess.run(
        [str(Path(PY).parent / "airflow"), "db", "migrate"], env=env, capture_output=True, text=True
    )
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

def _validated(dag):
    # the params as the trigger form submits them with nothing typed, validated as
    # Airflow validates a triggered run's conf; the error if they are refused
    try:
        return dict(dag.params.validate())
    except Exception as e:
        return f"refused: {e}"

bag = DagBag(dag_folder=sys.argv[1], safe_mode=False)
out = {"errors": {k: str(v)[-500:] for k, v in bag.import_errors.items()}, "dags": {}}
for dag_id, dag in bag.dags.items():
    out["dags"][dag_id] = {
        "schedule": str(dag.schedule), "catchup": dag.catchup,
        "timetable": type(dag.timetable).__name__, "summary": getattr(dag.timetable, "summary", None),
        "params": sorted(dag.params.keys()), "description": dag.description,
        "param_schemas": {k: dag.params.get_param(k).schema for k in dag.params},
        "param_descriptions": {k: dag.params.get_param(k).description for k in dag.params},
        "params_as_shown": _validated(dag),
        "dagrun_timeout": str(dag.dagrun_timeout), "deadline": bool(dag.deadline),
        "max_active_runs": dag.max_active_runs,
        "on_failure": getattr(dag.on_failure_callback, "__name__", str(dag.on_failure_callback)),
        "tasks": {t.task_id: {
            "type": type(t).__name__, "bases": [c.__name__ for c in type(t).__mro__], "downstream": sorted(t.downstream_task_ids),
            "retries": t.retries, "backoff": t.retry_exponential_backoff,
            "timeout": t.execution_timeout.total_seconds() if t.execution_timeout else None,
            "outlets": [o.uri for o in t.outlets],
            "image": getattr(t, "image", None), "cmds": getattr(t, "cmds", None),
            "arguments": getattr(t, "arguments", None), "hostname": getattr(t, "hostname", None),
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
    return subprocess.run(
        [PY, str(DAGS / "run_local.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _after(tasks: dict, task_id: str) -> list[str]:
    """The tasks right after `task_id`, seen through the wait for complete logs."""
    out = tasks[task_id]["downstream"]
    return [x for t in out for x in (tasks[t]["downstream"] if t == "wait_for_logs" else [t])]


# the daily pipeline: every stage but the two-arm comparison, in order
STAGES = [s for s in ALL_STAGES if s != "compare"]


def test_the_dags_parse_with_their_schedule_and_structure(airflow_home, tmp_path):
    bag = _probe(airflow_env(airflow_home, tmp_path))
    assert bag["errors"] == {}
    assert set(bag["dags"]) == {"recd_daily_retrain", "recd_dedup_vs_baseline"}
    daily = bag["dags"]["recd_daily_retrain"]
    # the timetable declared, not left to `create_cron_data_intervals`
    assert daily["timetable"] == "CronTriggerTimetable" and daily["summary"] == "0 0 * * *"
    assert daily["catchup"] is False and daily["description"]
    # a manual run is not queued behind a scheduled run waiting for its logs
    assert daily["max_active_runs"] == 2
    overrides = set(override_fields())  # the config overrides, each a param (empty: unset)
    assert set(daily["params"]) == {"config", "ds", "mode"} | overrides
    # the trigger form: nothing to type (Airflow marks a non-null empty param required and
    # keeps Trigger disabled); the day with a date picker
    shown = daily["params_as_shown"]
    assert isinstance(shown, dict), shown
    assert shown["ds"] is None and shown["mode"] == "dedup"  # config: RECD_CONFIG or None
    for name in ("ds", "config", *overrides - {"mode"}):
        assert "null" in daily["param_schemas"][name]["type"], name
        assert shown[name] is None or name == "config", name
    assert daily["param_schemas"]["ds"]["format"] == "date"
    # the form shows what will run: a label for people, the config's value for the empty
    # choice (never the text "null")
    engine = daily["param_schemas"]["engine"]
    # (values_display's None key: "null" once the schema is JSON, as the UI receives it)
    assert engine["title"] == "Engine" and engine["values_display"]["null"] == "the config's: local"
    described = daily["param_descriptions"]
    assert described["nproc"].endswith("(empty: the config's 1)"), described["nproc"]
    assert "generate 4096" in described["batch_size"], described["batch_size"]
    assert daily["dagrun_timeout"] == "12:00:00" and daily["deadline"]
    assert daily["on_failure"] == "on_run_failure"
    tasks = daily["tasks"]
    assert set(tasks) == {t.id for t in DAILY.tasks} | {"wait_for_logs"}
    # the tasks that read raw logs wait for them to be complete; the graph's edges otherwise
    assert tasks["synth"]["downstream"] == ["wait_for_logs"]
    assert tasks["wait_for_logs"]["downstream"] == ["ingest", "ingest_eval"]
    for t in DAILY.tasks:
        if t.id != "synth":
            assert tasks[t.id]["downstream"] == sorted(d.id for d in DAILY.tasks if t.id in d.after)
    assert tasks["train"]["timeout"] == 180 * 60  # the config's train.timeout_minutes
    assert all(t["timeout"] == 3600 for k, t in tasks.items() if k != "train")
    for a, b in zip(STAGES, STAGES[1:], strict=False):  # the chain of stages, in order
        assert b in _after(tasks, a), a
    assert tasks["ingest_eval"]["downstream"] == ["generate_eval"]
    assert sorted(tasks["generate_eval"]["downstream"]) == ["evaluate"]
    assert all(t["retries"] == 2 and t["backoff"] for t in tasks.values())
    # with retries off, the sensor still retries once (an Airflow race can fail a poke)
    no_retries = _probe(airflow_env(airflow_home, tmp_path, retries=0))["dags"]
    retries = {k: t["retries"] for k, t in no_retries["recd_daily_retrain"]["tasks"].items()}
    assert retries.pop("wait_for_logs") == 1 and set(retries.values()) == {0}
    wh = (tmp_path / "wh").as_uri()
    assert tasks["ingest"]["outlets"] == [f"{wh}/events", f"{wh}/quarantine"]
    assert tasks["generate"]["outlets"] == [f"{wh}/samples"]
    assert tasks["train"]["outlets"] == [f"{wh}/models"]
    cmp = bag["dags"]["recd_dedup_vs_baseline"]
    assert cmp["description"] and cmp["deadline"] and cmp["on_failure"] == "on_run_failure"
    assert cmp["timetable"] == "NullTimetable"  # triggered only
    assert set(cmp["params"]) == {"batch_size", "days", "ds", "preset"} | overrides - {"mode"}
    assert cmp["params_as_shown"]["ds"] == "2026-11-01"
    ct = cmp["tasks"]
    for mode in ("dedup", "baseline"):
        assert ct[f"preprocess_{mode}"]["downstream"] == [f"train_{mode}"]
        assert ct[f"evaluate_{mode}"]["downstream"] == ["compare"]
    assert sorted(ct["generate"]["downstream"]) == ["preprocess_baseline", "preprocess_dedup"]
    assert ct["compare"]["downstream"] == ["finish"]


NEXT_RUNS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from airflow.dag_processing.dagbag import DagBag
from airflow.timetables.base import TimeRestriction
import recd_daily_retrain

dag = DagBag(dag_folder=sys.argv[1], safe_mode=False).dags["recd_daily_retrain"]
template = dag.get_template_env().from_string(recd_daily_retrain.TRAIN_DAY)
restriction = TimeRestriction(earliest=dag.start_date, latest=None, catchup=True)
runs, last = [], None
for _ in range(5):  # the timetable's own next runs, as the scheduler asks for them
    info = dag.timetable.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)
    last = info.data_interval
    ds = template.render(params={"ds": ""}, data_interval_end=info.data_interval.end,
                         dag_run=None, **dag.user_defined_macros)
    runs.append({"run_after": info.run_after.isoformat(), "ds": ds})
print("RUNS" + json.dumps(runs))
"""


@pytest.mark.parametrize("cron_intervals", ["False", "True"])
def test_every_day_a_scheduled_run_reads_is_over_when_it_starts(
    airflow_home, tmp_path, cron_intervals
):
    """Under Airflow 3's default (`create_cron_data_intervals = False`: a cron trigger whose
    logical date is the trigger time) and the Airflow 2 behaviour alike."""
    import datetime as dt

    from recd_core.orchestration.schedule import day_end

    env = {
        **airflow_env(airflow_home, tmp_path),
        "AIRFLOW__SCHEDULER__CREATE_CRON_DATA_INTERVALS": cron_intervals,
    }
    r = subprocess.run([PY, "-c", NEXT_RUNS, str(DAGS)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.split("RUNS", 1)[1])
    days = [run["ds"] for run in runs]
    assert days == sorted(set(days)) and len(days) == 5  # a new day each run, in order
    for run in runs:
        start = dt.datetime.fromisoformat(run["run_after"])
        train = dt.date.fromisoformat(run["ds"])
        evaluation = (train + dt.timedelta(days=1)).isoformat()
        assert day_end(run["ds"]) <= start and day_end(evaluation) <= start, run
        assert day_end(evaluation) + dt.timedelta(days=1) > start  # the newest complete day


def test_the_kubernetes_switch_runs_each_stage_as_a_pod_of_the_components_image(
    airflow_home, tmp_path
):
    env = airflow_env(
        airflow_home,
        tmp_path,
        executor="kubernetes",
        image="registry.example/recd:1.2.3",
        logs_claim="recd-raw-logs",
        logs="/data/logs",
        train_gpus=1,
        synthesize="false",
        warehouse="s3://bucket/wh",
        tracking_uri="http://recd-mlflow:5000",
    )
    kubeconfig = tmp_path / "kubeconfig"  # the operator builds its client; nothing connects
    kubeconfig.write_text(KUBECONFIG)
    bag = _probe({**env, "KUBECONFIG": str(kubeconfig)})
    assert bag["errors"] == {}
    every = bag["dags"]["recd_daily_retrain"]["tasks"]
    # the wait for complete logs is a sensor on an Airflow worker (it mounts the logs volume)
    assert "BaseSensorOperator" in every["wait_for_logs"]["bases"]
    tasks = {k: t for k, t in every.items() if k != "wait_for_logs"}
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
        assert b in _after(every, a)


def test_training_across_machines_is_one_task_that_submits_a_trainjob(airflow_home, tmp_path):
    """`RECD_TRAIN_NODES=2`: train is one pod, the train component submitting a Kubeflow
    Trainer TrainJob of 2 nodes of 4 processes on the chart's runtime with the DAG's image,
    logs volume and secret, and waiting for it; its pod has the API token (only it), no GPU
    (the TrainJob's nodes have them), and its summary is the task's XCom."""
    env = airflow_env(
        airflow_home,
        tmp_path,
        executor="kubernetes",
        train_nodes=2,
        train_nproc_per_node=4,
        train_runtime="rel-recd-torch",
        train_gpus=1,
        synthesize="false",
        warehouse="s3://bucket/wh",
    )
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    bag = _probe({**env, "KUBECONFIG": str(kubeconfig)})
    assert bag["errors"] == {}
    every = bag["dags"]["recd_daily_retrain"]["tasks"]
    assert not any("node" in t for t in every)
    train = every["train"]
    assert train["cmds"] == ["python", "-m", "components.train"]
    args = train["arguments"]
    flags = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert (flags["--nodes"], flags["--nproc-per-node"], flags["--trainer-runtime"]) == (
        "2",
        "4",
        "rel-recd-torch",
    )
    assert flags["--image"] == train["image"]
    assert flags["--output-metadata"] == "/airflow/xcom/return.json"
    pod = json.loads(json.dumps(train["pod"]).replace("{{ ts_nodash | lower }}", "20261127t0000"))
    kubernetes_validate.validate(pod, "1.33.0", strict=True)
    assert_restricted("train", pod["spec"], api_client=True)
    assert "nvidia.com/gpu" not in json.dumps(pod["spec"]["containers"][0]["resources"])
    assert pod["metadata"]["labels"]["recd.ai/trainjob-client"] == "true"
    assert every["ingest"]["pod"]["spec"]["automountServiceAccountToken"] is False


@pytest.fixture(scope="module")
def daily_run(airflow_home, tmp_path_factory):
    root = tmp_path_factory.mktemp("daily")
    env = airflow_env(airflow_home, root)
    first = _run_dag(env, "--date", RUN_DATE)
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
    assert (wh / "samples/layout=clustered" / f"ds={EVAL_DAY}" / "_manifest.json").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("recd")
    pipeline = client.search_runs([exp.experiment_id], "tags.`recd.stage` = 'pipeline'")
    assert len(pipeline) == 1 and pipeline[0].info.status == "FINISHED"
    m = pipeline[0].data.metrics
    for key in ("storage/bytes", "dpp/samples_per_s", "train/samples_per_s", "eval/ne", "eval/auc"):
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


def test_a_second_run_of_the_same_day_keeps_its_data_and_model_with_a_new_mlflow_run(daily_run):
    root, env, _ = daily_run
    before = _partition_files(root)
    second = _run_dag(env, "--date", RUN_DATE)
    assert second.returncode == 0, second.stdout[-3000:]
    after = _partition_files(root)
    # the same partitions, the same files: built from the same inputs, each kept
    assert after == before
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("recd")
    assert len(client.search_runs([exp.experiment_id], "tags.`recd.stage` = 'pipeline'")) == 2
    # the same model (the same batches, config and start): one registered version
    assert len(client.search_model_versions("name='recd-dlrm'")) == 1


def test_a_failing_stage_fails_its_task_with_its_reason_and_nothing_downstream_runs(
    airflow_home, tmp_path
):
    strict = tmp_path / "strict.yaml"
    strict.write_text("features: synthetic\ningest: {max_quarantine_fraction: 0.0}\n")
    logs = tmp_path / "logs" / f"ds={TRAIN_DAY}"
    logs.mkdir(parents=True)
    (logs / "events-00000.jsonl").write_text('{"event_id": 1, "ts": "not a time"}\n')
    env = airflow_env(airflow_home, tmp_path, config=strict, retries=0)
    r = _run_dag(env, "--date", RUN_DATE)
    out = r.stdout + r.stderr
    assert r.returncode == 1
    assert "recd ingest: " in out and "quarantine" in out
    # the alert names the task, the day and the reason, in the task's log
    alert = next(ln for ln in out.splitlines() if "recd alert: " in ln)
    assert f"task ingest failed for ds={TRAIN_DAY}: recd ingest: " in alert, alert
    assert "quarantine" in alert and "task_failure" not in out
    assert "starting task_id=ingest " in out and "starting task_id=generate " not in out
    assert not list((tmp_path / "wh").glob(f"samples/*/ds={TRAIN_DAY}"))
    assert not (tmp_path / "wh" / "events" / f"ds={TRAIN_DAY}").exists()


SUMMARY_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from recd_tasks import headline_first
summary = {"status": "ok", "stage": "finish", "dpp.samples": 5, "eval.ne.dedup": 0.9,
           "storage.ratio": 3.1, "mlflow.run_id": "x", "registry.decision": "promoted"}
print("PROBE" + json.dumps([list(headline_first(summary)),
                            list(headline_first(summary, only=True))]))
"""


def test_a_task_log_ends_on_its_headline_figures_first(airflow_home, tmp_path):
    """A stage's summary table in its task log: the headline figures first, in MLflow's
    order; finish's (every stage's figures merged) its headline and the run's ids alone."""
    env = airflow_env(airflow_home, tmp_path)
    r = subprocess.run(
        [PY, "-c", SUMMARY_PROBE, str(DAGS)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    whole, finish = json.loads(r.stdout.split("PROBE", 1)[1])
    assert whole[:2] == ["storage.ratio", "eval.ne.dedup"] and len(whole) == 7
    assert finish == ["storage.ratio", "eval.ne.dedup", "mlflow.run_id", "registry.decision"]
