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
import os
from pathlib import Path
from typing import Literal

from airflow.sdk import Asset, task
from pydantic import BaseModel, ConfigDict

from recd_core.orchestration.graph import STAGES, Graph

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
    schedule: str = "@daily"  # empty: no schedule (runs are triggered)
    start_date: dt.date = dt.date(2026, 11, 1)
    retries: int = 2
    # kubernetes executor
    image: str = "ghcr.io/recd-project/recd-components:0.1.0"
    namespace: str = "recd"
    service_account: str = "recd-pipeline"
    train_gpus: int = 0
    gpu_node_selector: dict[str, str] = {}
    env_from_secret: str | None = None  # a Secret with e.g. AWS_* for an s3:// warehouse
    # raw logs are files: a PVC mounted at `logs` in every pod (synth writes, ingest reads)
    logs_claim: str | None = None

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


def asset(table: str, warehouse: str = SETTINGS.warehouse) -> Asset:
    """The Asset a stage produces: one warehouse table (partitions per ds in the event extra)."""
    uri = warehouse if "://" in warehouse else Path(warehouse).resolve().as_uri()
    # named by its URI: two warehouses are two assets
    return Asset(uri=f"{uri.rstrip('/')}/{table}", group="recd")


def build(graph: Graph, args: dict, assets: bool = True) -> dict:
    """`graph` as this DAG's tasks, in its declared order: each task's arguments are `args`
    plus its own (`Task.args`: its arm, fixed arguments) and the values it pulls from
    upstream summaries (XCom templates), its upstream tasks its edges. With `assets`, the tables a stage writes in `args`'s warehouse
    are its outlets (a warehouse path with templates cannot name an Asset)."""
    tasks: dict = {}
    for t in graph.order():
        targs = {**args, **t.args()}
        targs |= {pull.arg: xcom(src, pull.key) for pull, src in graph.pulls(t)}
        tables = [w for w in STAGES[t.stage].writes if w != "logs"] if assets else []
        tasks[t.id] = stage(t.stage, targs, t.id, list(t.gathers), tables)
        for upstream in t.after:
            tasks[upstream] >> tasks[t.id]
    return tasks


def stage(name: str, args: dict, task_id: str, upstream: list[str], tables: list[str]):
    """The task running stage `name` with (templated) `args`; `upstream`: task ids whose
    summaries the stage needs (finish, compare); `tables`: the Assets it updates."""
    outlets = [asset(t, args["warehouse"]) for t in tables]
    upstream_json = xcoms_json(upstream) if upstream else None
    if SETTINGS.executor == "kubernetes":
        return _pod(name, task_id, args, outlets, upstream_json)

    @task(task_id=task_id, outlets=outlets)
    def run(stage_args: dict, upstream_json: str | None = None, **context) -> dict:
        from airflow.sdk.exceptions import AirflowFailException

        from recd_core.errors import RecdError
        from recd_core.orchestration.stages import run_stage

        try:
            summary = run_stage(
                name, stage_args, json.loads(upstream_json) if upstream_json else None
            )
        except RecdError as e:
            if e.retryable:  # e.g. the tracking server: the task's retries apply
                raise
            raise AirflowFailException(f"recd {name}: {e}") from None
        for out in outlets:
            context["outlet_events"][out].extra = {"ds": stage_args["ds"]}
        return summary

    return run(args, upstream_json)


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
                        allow_privilege_escalation=False, read_only_root_filesystem=True,
                        run_as_non_root=True, capabilities=k8s.V1Capabilities(drop=["ALL"]),
                    )  # fmt: skip
            pod.spec.automount_service_account_token = False
            return pod

    return RestrictedPodOperator


def _pod(name: str, task_id: str, args: dict, outlets: list, upstream_json: str | None):
    from kubernetes.client import models as k8s

    argv = []
    for key, value in args.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    if upstream_json:
        argv += ["--upstream-json", upstream_json]
    argv += ["--output-metadata", "/airflow/xcom/return.json"]
    gpus = SETTINGS.train_gpus if STAGES[name].accelerated else 0
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
        get_logs=True,
        on_finish_action="delete_succeeded_pod",
        outlets=outlets,
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
        ),  # fmt: skip
        container_security_context=k8s.V1SecurityContext(
            allow_privilege_escalation=False,
            read_only_root_filesystem=True,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
        ),  # fmt: skip
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
        labels={"app.kubernetes.io/component": "pipeline", "recd.ai/mlflow-client": "true"},
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
    }
