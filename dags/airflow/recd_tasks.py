"""Shared by the recd DAGs: where the pipeline runs (settings) and the factory that turns a
graph of `recd_core.orchestration.graph` into Airflow tasks (`build`), each stage of `recd_core.orchestration.stages`
either

    inprocess   a TaskFlow task calling `run_stage` on the Airflow worker (the embedded
                default: `make run`, one machine)
    kubernetes  a KubernetesPodOperator running `python -m components.<stage>` in the
                components image (clusters; the chart's ServiceAccount may launch these pods)

Both receive the same templated arguments and return the same summary (XCom), so the DAG
files read the same for either. Settings come from `RECD_*` environment variables, read once
here at parse time (the Helm values for the Airflow chart set them).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Literal

from airflow.sdk import Asset, Param, task
from pydantic import BaseModel, ConfigDict, Field

from recd_core.config_files import load_pipeline_config
from recd_core.data.logs_root import MARKER
from recd_core.mlops.tracking import headline_rank
from recd_core.orchestration.alerts import DEFAULT as ALERTS_DEFAULT
from recd_core.orchestration.graph import STAGES, Graph
from recd_core.orchestration.overlay import config_words
from recd_core.orchestration.stage_args import for_stage, override_fields, param_schema

# the standard provider's sensor imports a path Airflow 3.3 deprecates: a WARNING at the top
# of every task's log that no user can act on (ours is `@task.sensor`, the current API)
warnings.filterwarnings(
    "ignore", message=r"The `airflow\.utils\.operator_helpers\.determine_kwargs`"
)

REPO = Path(__file__).resolve().parents[2]


class Settings(BaseModel):
    """`RECD_EXECUTOR=kubernetes`, `RECD_WAREHOUSE=s3://…`, … (defaults: the local embedded
    setup of this checkout). Plain pydantic: the Airflow image needs nothing extra."""

    model_config = ConfigDict(extra="forbid")

    executor: Literal["inprocess", "kubernetes"] = "inprocess"
    warehouse: str = str(REPO / "data/default/warehouse")
    logs: str = str(REPO / "data/default/logs")
    compare_root: str = str(REPO / "data/compare")
    tracking_uri: str | None = f"sqlite:///{REPO}/data/mlflow.db"
    config: str | None = None
    # fabricate logs for days without any: the embedded default only, never in production
    synthesize: bool = True
    schedule: str = "@daily"  # a cron expression; empty: no schedule (runs are triggered)
    start_date: dt.date = dt.date(2026, 11, 1)
    catchup: bool = False  # on: every missed day since start_date runs, in order
    retries: int = 2
    # a run waits for the marker its log producer writes when a day is complete (empty: no
    # wait), looking every logs_poke_s, failing with the missing days after logs_wait_hours
    logs_marker: str = MARKER
    logs_wait_hours: float = 6.0
    logs_poke_s: int = 300
    # every task but train (train's: the config's train.timeout_minutes)
    task_timeout_minutes: int = 60
    dagrun_timeout_hours: float = 12.0
    deadline_hours: float = 8.0  # a run not done this long after it was queued is reported
    notifier: str = ALERTS_DEFAULT  # module:function called with (message, **details)
    # kubernetes executor
    image: str = "ghcr.io/recd-project/recd-components:0.1.0"
    namespace: str = "recd"
    service_account: str = "recd-pipeline"
    train_gpus: int = 0
    gpu_node_selector: dict[str, str] = {}
    env_from_secret: str | None = None  # a Secret with e.g. AWS_* for an s3:// warehouse
    # raw logs are files: a PVC mounted at `logs` in every pod (synth writes, ingest reads)
    logs_claim: str | None = None
    # training across machines: the train task submits a Kubeflow Trainer TrainJob of
    # `train_nodes` nodes of `train_nproc_per_node` processes on the ClusterTrainingRuntime
    # `train_runtime` (the chart's `<release>-recd-torch`, distributedTraining.enabled) and
    # waits for it (orchestration/trainjob.py)
    train_nodes: int = Field(default=1, ge=1)
    train_nproc_per_node: int = Field(default=1, ge=1)
    train_runtime: str = "recd-torch"

    @property
    def start(self) -> dt.datetime:
        return dt.datetime.combine(self.start_date, dt.time(), dt.UTC)

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        """`RECD_<FIELD>` variables; mappings as JSON (`RECD_GPU_NODE_SELECTOR='{"a": "b"}'`)."""
        values = {}
        for name, field in cls.model_fields.items():
            raw = env.get(f"RECD_{name.upper()}")
            if raw is None:
                continue
            values[name] = json.loads(raw) if field.annotation == dict[str, str] else raw
        return cls.model_validate(values)


SETTINGS = Settings.from_env(dict(os.environ))


def xcom(task_id: str, key: str) -> str:
    """A template pulling one key of an upstream stage's summary."""
    return "{{ ti.xcom_pull(task_ids='" + task_id + "')['" + key + "'] }}"


def xcoms_json(task_ids: list[str]) -> str:
    """A template rendering upstream summaries as one JSON list (for finish and compare)."""
    return "{{ ti.xcom_pull(task_ids=" + json.dumps(task_ids) + ") | tojson }}"


def override_params(exclude: tuple[str, ...] = ()) -> dict[str, Param]:
    """Every config override (`stage_args.override_fields`, declared once in `StageArgs`)
    as a trigger-form param in a section of its own, labelled for people, each saying the
    value the config (RECD_CONFIG, or the built-in one) gives it: empty, that value holds."""
    cfg = parse_time_config()
    out = {}
    for n in override_fields():
        if n in exclude:
            continue
        schema, current = param_schema(n, nullable=True), config_words(n, cfg)
        schema["description"] = f"{schema['description']} (empty: the config's {current})"
        if "enum" in schema:  # the empty choice named by what it means, not "null"
            shown = {v: str(v) for v in schema["enum"] if v is not None}
            schema["values_display"] = {None: f"the config's: {current}", **shown}
        title = n.replace("_", " ").capitalize()
        out[n] = Param(None, title=title, section="Config overrides", **schema)
    return out


def override_args(exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """Each override's param as a task argument (a template; empty when the param is:
    unset, and `build` hands it only to the stages that take it)."""
    # params['items'], not params.items: a dict's attribute is its method
    return {
        n: "{{ '' if params['" + n + "'] is none else params['" + n + "'] }}"
        for n in override_fields()
        if n not in exclude
    }


def asset(table: str, warehouse: str = SETTINGS.warehouse) -> Asset:
    """The Asset a stage produces: one warehouse table (partitions per ds in the event extra)."""
    uri = warehouse if "://" in warehouse else Path(warehouse).resolve().as_uri()
    # named by its URI: two warehouses are two assets
    return Asset(uri=f"{uri.rstrip('/')}/{table}", group="recd")


def build(graph: Graph, args: dict, assets: bool = True) -> dict:
    """`graph` as this DAG's tasks, in its declared order: each task's arguments are `args`
    plus its own (`Task.args`: its arm, fixed arguments; a `mode` in `args` chooses the arm
    of a one-arm graph) and the values it pulls from upstream summaries (XCom templates),
    its upstream tasks its edges. The tasks that read raw logs first wait for them to be
    complete (`wait_for_logs`, with `logs_marker` set). With `assets`, the tables a stage
    writes in `args`'s warehouse are its outlets (a warehouse path with templates cannot
    name an Asset)."""
    tasks: dict = {}
    arms = {t.mode for t in graph.tasks} - {None}
    for t in graph.order():
        targs = {**for_stage(t.stage, args), **t.args()}
        if t.mode and len(arms) == 1 and args.get("mode"):
            targs["mode"] = args["mode"]
        targs |= {pull.arg: xcom(src, pull.key) for pull, src in graph.pulls(t)}
        tables = [w for w in STAGES[t.stage].writes if w != "logs"] if assets else []
        tasks[t.id] = stage(t.stage, targs, t.id, list(t.gathers), tables)
        after = [tasks[u] for u in t.after]
        if "logs" in STAGES[t.stage].reads and SETTINGS.logs_marker:
            if "wait_for_logs" not in tasks:  # in place of the first reader's upstreams
                tasks["wait_for_logs"] = wait_for_logs(args)
                for upstream in after:
                    upstream >> tasks["wait_for_logs"]
                after = []
            after = [tasks["wait_for_logs"], *after]  # a later reader keeps its own too
        for upstream in after:
            upstream >> tasks[t.id]
    return tasks


def wait_for_logs(args: dict):
    """A sensor: every day the run reads (its training and evaluation days) has its logs
    marked complete (`recd_core.data.logs_root`). It looks every `logs_poke_s` without
    holding a worker slot (reschedule mode) and fails after `logs_wait_hours` naming the
    days still missing."""
    from airflow.sdk import PokeReturnValue

    wait_s = SETTINGS.logs_wait_hours * 3600

    # the sensor's own timeout is a backstop a poke past the wait never reaches. It retries
    # at least once, whatever `retries` says: Airflow (3.2-3.3) can fail a reschedule-mode
    # sensor when one poke's executor success arrives after the next poke started
    # (apache/airflow#71172); a poke is harmless to repeat, and the real failure (the wait
    # ran out) raises AirflowFailException, which never retries
    @task.sensor(
        task_id="wait_for_logs",
        poke_interval=SETTINGS.logs_poke_s,
        mode="reschedule",
        timeout=wait_s + 2 * SETTINGS.logs_poke_s,
        retries=max(SETTINGS.retries, 1),
    )
    def waiting(run_args: dict, **context) -> PokeReturnValue:
        from airflow.sdk.exceptions import AirflowFailException

        from recd_core.data.logs_root import incomplete_days, marker_path
        from recd_core.orchestration.stage_args import parse_args

        # the run's days and where their logs are
        a = parse_args({k: run_args.get(k) for k in ("ds", "days", "eval_ds", "logs")})
        days = a.all_days()
        missing = incomplete_days(a.logs, days, SETTINGS.logs_marker)
        if not missing:
            return PokeReturnValue(is_done=True, xcom_value={"days": days})
        first = context["ti"].get_first_reschedule_date(context)
        waited = (dt.datetime.now(dt.UTC) - first).total_seconds() if first else 0.0
        where = ", ".join(str(marker_path(a.logs, d, SETTINGS.logs_marker)) for d in missing)
        if waited >= wait_s:
            raise AirflowFailException(
                f"the logs of {', '.join(missing)} are not complete after "
                f"{SETTINGS.logs_wait_hours:g} h of waiting: no {where}"
            )
        print(f"waiting for the logs of {', '.join(missing)}: no {where} yet", flush=True)
        return PokeReturnValue(is_done=False)

    return waiting(args)


def stage(name: str, args: dict, task_id: str, upstream: list[str], tables: list[str]):
    """The task running stage `name` with (templated) `args`; `upstream`: task ids whose
    summaries the stage needs (finish, compare); `tables`: the Assets it updates."""
    outlets = [asset(t, args["warehouse"]) for t in tables]
    upstream_json = xcoms_json(upstream) if upstream else None
    if SETTINGS.executor == "kubernetes":
        return _pod(name, task_id, args, outlets, upstream_json)

    # the summary is logged as one table (report.summary_text) and goes on as the XCom;
    # Airflow's "Returned value was: {...}" line of hundreds of keys would only repeat it
    @task(
        task_id=task_id,
        outlets=outlets,
        execution_timeout=timeout(name),
        show_return_value_in_logs=False,
    )
    def run(stage_args: dict, upstream_json: str | None = None, **context) -> dict:
        from airflow.sdk.exceptions import AirflowFailException

        from recd_core.errors import RecdError
        from recd_core.orchestration.stages import run_stage
        from recd_core.report import progress, summary_text

        quiet_third_parties()
        ds = stage_args.get("ds")
        try:
            summary = run_stage(
                name,
                stage_args,
                json.loads(upstream_json) if upstream_json else None,
                progress=progress,
            )
        except RecdError as e:
            if e.retryable:  # e.g. the tracking server: the task's retries apply
                raise
            # the reason as the log's last line before Airflow's own report of the failure
            logging.getLogger("recd").error("recd %s failed for ds=%s: %s", name, ds, e)
            raise AirflowFailException(f"recd {name}: {e}") from None
        for out in outlets:
            context["outlet_events"][out].extra = {"ds": stage_args["ds"]}
        # the log ends on the answer, read like the CLI's output: the headline figures first;
        # a gathering stage's merged summary (finish, compare) only its headline (each
        # stage's own log, and MLflow, hold the rest)
        table = summary_text(f"recd {name}", headline_first(summary, only=STAGES[name].gathers))
        logging.getLogger("recd").info("%s", table)
        return summary

    return run(args, upstream_json)


def headline_first(summary: dict, only: bool = False) -> dict:
    """The summary with the headline figures first (`tracking.HEADLINE`, the order MLflow
    shows them in); `only`: those and the run's ids alone."""
    head = sorted((k for k in summary if headline_rank(k)), key=headline_rank)
    ids = (k for k in summary if k.startswith(("mlflow.run_id", "registry.", "run.")))
    return {k: summary[k] for k in dict.fromkeys([*head, *(ids if only else summary)])}


def quiet_third_parties() -> None:
    """MLflow's loggers write to stderr with handlers of their own, so their INFO lines
    ("Created version 3 of model recd-dlrm") showed as red ERROR lines in the task log: here
    they go through the root logger (Airflow's), at their own level, WARNING and above; and
    its progress bars are off."""
    import contextlib
    import logging

    # its artifact download bars are a terminal's, a task log shows them as ERROR lines
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with contextlib.suppress(ImportError):  # its import installs the handlers: first
        import mlflow  # noqa: F401
    for name in ("mlflow", "alembic"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.WARNING)


XCOM_SIDECAR_IMAGE = "alpine:3.22"


@functools.cache
def _pod_operator():
    """KubernetesPodOperator whose XCom sidecar (added by the provider, unpinned and without a
    security context) is pinned and locked down too, so every container of the pod passes
    the restricted Pod Security profile the chart asks namespaces to enforce."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from kubernetes.client import models as k8s

    class RestrictedPodOperator(KubernetesPodOperator):
        def build_pod_request_obj(self, context=None):
            pod = super().build_pod_request_obj(context)
            for c in pod.spec.containers:
                if c.name == "airflow-xcom-sidecar":
                    c.image = XCOM_SIDECAR_IMAGE
                    c.resources.limits = {"memory": "32Mi"}
                    c.security_context = k8s.V1SecurityContext(
                        allow_privilege_escalation=False,
                        read_only_root_filesystem=True,
                        run_as_non_root=True,
                        capabilities=k8s.V1Capabilities(drop=["ALL"]),
                    )
            # no token unless the pod talks to the API (a TrainJob's submitter)
            pod.spec.automount_service_account_token = bool(self.automount_service_account_token)
            return pod

    return RestrictedPodOperator


def trainjob_flags() -> list[str]:
    """The train component's flags that make it submit a TrainJob across `train_nodes`
    machines (orchestration/trainjob.py) with this pod's image, logs volume and secret."""
    flags = [
        "--nodes",
        str(SETTINGS.train_nodes),
        "--nproc-per-node",
        str(SETTINGS.train_nproc_per_node),
        "--trainer-runtime",
        SETTINGS.train_runtime,
        "--image",
        SETTINGS.image,
        "--namespace",
        SETTINGS.namespace,
    ]
    if SETTINGS.logs_claim:
        flags += ["--volume", f"{SETTINGS.logs_claim}:{SETTINGS.logs}"]
    if SETTINGS.env_from_secret:
        flags += ["--s3-secret", SETTINGS.env_from_secret]
    return flags


def _pod(name: str, task_id: str, args: dict, outlets: list, upstream_json: str | None):
    """The pod running stage `name`, its summary the task's XCom; train across machines
    (`train_nodes` > 1): the pod submits the TrainJob and waits for it, its token mounted
    for that (the chart's Role lets it create TrainJobs and read their pods' logs)."""
    from kubernetes.client import models as k8s

    argv = []
    for key, value in args.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    if upstream_json:
        argv += ["--upstream-json", upstream_json]
    argv += ["--output-metadata", "/airflow/xcom/return.json"]
    across = STAGES[name].accelerated and SETTINGS.train_nodes > 1
    if across:
        argv += trainjob_flags()
    gpus = SETTINGS.train_gpus if STAGES[name].accelerated and not across else 0
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return _pod_operator()(
        task_id=task_id,
        name=f"recd-{name}",
        namespace=SETTINGS.namespace,
        image=SETTINGS.image,
        cmds=["python", "-m", f"components.{name}"],
        arguments=argv,
        service_account_name=SETTINGS.service_account,
        do_xcom_push=True,
        automount_service_account_token=across,
        get_logs=True,
        on_finish_action="delete_succeeded_pod",
        outlets=outlets,
        execution_timeout=timeout(name),
        container_resources=k8s.V1ResourceRequirements(
            requests={"cpu": "1", "memory": "4Gi"}, limits={"memory": "16Gi", **limits}
        ),
        node_selector=SETTINGS.gpu_node_selector if gpus else None,
        tolerations=[k8s.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")]
        if gpus
        else None,
        security_context=k8s.V1PodSecurityContext(
            run_as_non_root=True,
            run_as_user=10001,
            fs_group=10001,
            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
        ),
        container_security_context=k8s.V1SecurityContext(
            allow_privilege_escalation=False,
            read_only_root_filesystem=True,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
        ),
        # the root filesystem is read-only: scratch and $HOME are emptyDirs
        volumes=[
            k8s.V1Volume(name="tmp", empty_dir=k8s.V1EmptyDirVolumeSource()),
            k8s.V1Volume(name="home", empty_dir=k8s.V1EmptyDirVolumeSource()),
            *_logs_volume(k8s),
        ],
        volume_mounts=[
            k8s.V1VolumeMount(name="tmp", mount_path="/tmp"),
            k8s.V1VolumeMount(name="home", mount_path="/home/recd"),
            *(
                [k8s.V1VolumeMount(name="logs", mount_path=SETTINGS.logs)]
                if SETTINGS.logs_claim
                else []
            ),
        ],
        labels={
            "app.kubernetes.io/component": "pipeline",
            "recd.ai/mlflow-client": "true",
            **({"recd.ai/trainjob-client": "true"} if across else {}),
        },
        env_from=[
            k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=SETTINGS.env_from_secret))
        ]
        if SETTINGS.env_from_secret
        else None,
    )


def _logs_volume(k8s) -> list:
    if not SETTINGS.logs_claim:
        return []
    claim = k8s.V1PersistentVolumeClaimVolumeSource(claim_name=SETTINGS.logs_claim)
    return [k8s.V1Volume(name="logs", persistent_volume_claim=claim)]


def default_args() -> dict:
    return {
        "owner": "recd",
        "retries": SETTINGS.retries,
        "retry_delay": dt.timedelta(seconds=30),
        "retry_exponential_backoff": True,
        "max_retry_delay": dt.timedelta(minutes=10),
        "execution_timeout": dt.timedelta(minutes=SETTINGS.task_timeout_minutes),
        "on_failure_callback": on_task_failure,
    }


@functools.cache
def parse_time_config():
    """The config as the DAG file sees it when parsed: RECD_CONFIG's where it is readable
    here, else the built-in one (the file may be a path inside the pods of the kubernetes
    executor)."""
    path = SETTINGS.config if SETTINGS.config and Path(SETTINGS.config).is_file() else None
    return load_pipeline_config(path)


def timeout(stage_name: str) -> dt.timedelta:
    """A stage's execution_timeout: training's from its config, every other stage's
    `task_timeout_minutes`. Past it the task fails and its retries apply."""
    if STAGES[stage_name].accelerated:
        return dt.timedelta(minutes=parse_time_config().train.timeout_minutes)
    return dt.timedelta(minutes=SETTINGS.task_timeout_minutes)


def dag_options(name: str) -> dict:
    """What every recd DAG declares beside its schedule: a run timeout, a failure callback
    and a Deadline Alert, both through the pluggable notifier."""
    from airflow.sdk.definitions.callback import AsyncCallback
    from airflow.sdk.definitions.deadline import DeadlineAlert, DeadlineReference

    from recd_core.orchestration.alerts import deadline_missed

    message = f"{name}: a run is not done {SETTINGS.deadline_hours:g} h after it was queued"
    return {
        "dagrun_timeout": dt.timedelta(hours=SETTINGS.dagrun_timeout_hours),
        "on_failure_callback": on_run_failure,
        "deadline": DeadlineAlert(
            reference=DeadlineReference.DAGRUN_QUEUED_AT,
            interval=dt.timedelta(hours=SETTINGS.deadline_hours),
            callback=AsyncCallback(
                deadline_missed,  # awaited in the triggerer, imported there by its path
                kwargs={"notifier_path": SETTINGS.notifier, "message": message},
            ),
        ),
        "default_args": default_args(),
    }


def on_task_failure(context) -> None:
    """A task failed for good (its retries spent): the task, the day and the one-line reason
    to the notifier. It runs in the task's process, so the default notifier's ERROR line is
    the last line of the task's own log, where a user looks first."""
    from recd_core.errors import first_line
    from recd_core.orchestration.alerts import notifier

    ti, task = context.get("ti"), context.get("task")
    args = (getattr(task, "op_args", None) or [None])[0]  # the stage's arguments, rendered
    ds = args.get("ds") if isinstance(args, dict) else None
    error = context.get("exception")
    notifier(SETTINGS.notifier)(
        f"{getattr(ti, 'dag_id', '?')} task {getattr(ti, 'task_id', '?')} failed"
        + (f" for ds={ds}" if ds else "")
        + (f": {first_line(error, 500)}" if error else ""),
        run_id=getattr(ti, "run_id", None),
        try_number=getattr(ti, "try_number", None),
    )


def on_run_failure(context) -> None:
    """A failed DAG run, when no task said so itself (a run timeout): which run, which tasks
    failed, why (the scheduler's reason), to the notifier. A task's failure was told by the
    task (`on_task_failure`), with its reason: not told twice."""
    from recd_core.orchestration.alerts import notifier

    if context.get("reason") == "task_failure":
        return
    run = context.get("dag_run")
    failed = []
    if run is not None:
        try:
            failed = [
                ti.task_id for ti in run.get_task_instances(state=["failed", "upstream_failed"])
            ]
        except Exception:  # the callback must never fail the callback runner
            failed = []
    dag_id = getattr(run, "dag_id", None) or getattr(context.get("dag"), "dag_id", "recd")
    reason = context.get("reason") or "a task failed"
    notifier(SETTINGS.notifier)(
        f"{dag_id} run {getattr(run, 'run_id', '?')} failed: {reason}",
        failed_tasks=",".join(failed) or None,
    )
