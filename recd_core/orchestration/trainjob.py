"""Training across machines on Kubeflow Trainer: the train stage as a TrainJob on the
TrainingRuntime the chart installs (Kubeflow Trainer's torch-distributed runtime:
its ML policy gives every node torchrun's settings as PET_* variables, the node count,
processes a node, this node's rank and node 0's address; the Trainer runs the pods, their
headless service, restarts and status). recd builds the TrainJob with the Trainer's own API
models and follows it with the Kubeflow SDK:

    TrainJob recd-train-<ds>-<arm>-<attempt>        trainer.kubeflow.org/v1alpha1
      runtimeRef      <release>-recd-torch          (the chart's TrainingRuntime)
      trainer         image: the components image
                      command: torchrun -m components.train   (PET_* make it one run)
                      args: the stage's arguments, and where rank 0 writes its summary
                      numNodes, numProcPerNode, resourcesPerNode
      runtimePatches  the node container: the step's volumes and mounts, the S3 secret's keys

`run_trainjob` (the train step of a run across machines, in Kubeflow, Airflow or `recd run`)
creates it, shows node 0's log as it comes, waits for its end and turns it into the step's
exit: rank 0's summary, written to `<warehouse>/_trainjobs/<name>.json`, says the stage's
own end (0; 2 bad input, final; ...); a TrainJob that failed without one (a node lost past
the runtime's restarts, its deadline) is exit 1, retryable, and the retry (a new TrainJob,
a new name) resumes from the run's checkpoint. Every attempt is its own TrainJob: a reused
name is refused by the API, never joined.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from recd_core.errors import BadInput, RecdError, of_exit
from recd_core.report import read_summary

GROUP, VERSION, PLURAL, KIND = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
NODE = "node"  # the torch runtime's replicated job and container
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


class TrainJobConfig(BaseModel):
    """A train stage across machines as a Kubeflow Trainer TrainJob: the options of the
    train component and of `recd run` that say so (`--nodes 2 --image ...`), one flag a
    field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(
        default=1,
        ge=1,
        description="machines (TrainJob nodes) to train on; "
        "more than 1: the train stage runs as a Kubeflow Trainer TrainJob",
    )
    nproc_per_node: int = Field(default=1, ge=1, description="training processes a node")
    trainer_runtime: str = Field(
        default="recd-torch",
        description="the TrainJob's runtime (the chart's TrainingRuntime <release>-recd-torch)",
    )
    trainer_runtime_kind: Literal["TrainingRuntime", "ClusterTrainingRuntime"] = Field(
        default="TrainingRuntime",
        description="the runtime's kind: the chart's is namespaced (TrainingRuntime)",
    )
    image: str = Field(default="", description="the TrainJob nodes' image (the components image)")
    namespace: str = Field(default="", description="the TrainJob's namespace (default: this pod's)")
    node_cpu: str = Field(default="", description="CPU a TrainJob node requests and may use")
    node_memory: str = Field(default="", description="memory a TrainJob node requests and may use")
    volume: list[str] = Field(
        default_factory=list,
        description="CLAIM:PATH, a PersistentVolumeClaim every TrainJob node mounts (repeatable)",
    )
    s3_secret: str = Field(
        default="",
        description="a Secret with the S3 keys, set in every TrainJob node's environment",
    )
    trainjob_timeout_s: int = Field(
        default=6 * 3600, gt=0, description="the longest a TrainJob may run, in seconds"
    )

    @classmethod
    def from_flags(cls, given: dict) -> TrainJobConfig:
        """The config from parsed flags (None or empty: the default); a bad value is one
        line naming the flag."""

        try:
            return cls(**{k: v for k, v in given.items() if v not in (None, [])})
        except ValidationError as e:
            first = e.errors()[0]
            flag = "--" + str(first["loc"][0]).replace("_", "-")
            raise BadInput(f"{flag} {first.get('input')!r}: {first['msg']}") from None


class TrainJobFailed(RecdError):
    """The TrainJob ended without a result from rank 0 (exit 1, retryable: the retry's new
    TrainJob resumes from the run's checkpoint)."""


def job_name(ds: str, mode: str) -> str:
    """A TrainJob name of its own for each attempt (DNS-1035: lower case, at most 63)."""
    return f"recd-train-{ds}-{mode}-{uuid.uuid4().hex[:8]}"


def summary_uri(warehouse: str, name: str) -> str:
    """Where rank 0 of TrainJob `name` writes its summary: in the warehouse every node
    reaches (a URI's query, `?endpoint_override=...`, kept after the path)."""
    root, query = (warehouse.split("?", 1) + [""])[:2]
    return f"{root.rstrip('/')}/_trainjobs/{name}.json" + (f"?{query}" if query else "")


def trainjob(name: str, argv: list[str], cfg: TrainJobConfig):
    """The TrainJob `name` running `python -m components.train argv` on `cfg.nodes` nodes of
    `cfg.nproc_per_node` processes, as the Trainer's API model (`TrainerV1alpha1TrainJob`,
    which types every field; `.to_dict()` is the body the API takes)."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    if not cfg.image:
        raise BadInput("a TrainJob needs the components image (--image)")
    mounts, volumes = [], []
    for k, spec in enumerate(cfg.volume):
        claim, _, path = spec.partition(":")
        if not claim or not path.startswith("/"):
            raise BadInput(f"--volume {spec!r}: expected CLAIM:/mount/path")
        volumes.append({"name": f"recd-{k}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"recd-{k}", "mountPath": path})
    secret = [
        {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": cfg.s3_secret, "key": key, "optional": True}},
        }
        for key in S3_KEYS
        if cfg.s3_secret
    ]
    node = {
        "name": NODE,
        **({"env": secret} if secret else {}),
        **({"volumeMounts": mounts} if mounts else {}),
    }
    pod = {"containers": [node], **({"volumes": volumes} if volumes else {})}
    patch = {
        "manager": "recd",
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
                    ]
                }
            }
        },
    }
    resources = {k: v for k, v in (("cpu", cfg.node_cpu), ("memory", cfg.node_memory)) if v}
    trainer = {
        "image": cfg.image,
        "command": ["torchrun", "-m", "components.train"],
        "args": argv,
        "numNodes": cfg.nodes,
        "numProcPerNode": cfg.nproc_per_node,
        **({"resourcesPerNode": {"requests": resources, "limits": resources}} if resources else {}),
    }
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/part-of": "recd", "recd.ai/stage": "train"},
        },
        "spec": {
            "runtimeRef": {"name": cfg.trainer_runtime, "kind": cfg.trainer_runtime_kind},
            "activeDeadlineSeconds": cfg.trainjob_timeout_s,
            "trainer": trainer,
            **({"runtimePatches": [patch]} if secret or mounts else {}),
        },
    }
    return TrainerV1alpha1TrainJob.from_dict(body)


def _namespace(cfg: TrainJobConfig) -> str:
    if cfg.namespace:
        return cfg.namespace
    try:  # the pod's own, as every in-cluster client finds it
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip()
    except OSError:
        return "default"


def run_trainjob(
    argv: list[str],
    warehouse: str,
    ds: str,
    mode: str,
    cfg: TrainJobConfig,
    say: Callable[[str], None] = print,
) -> dict:
    """The train stage (`argv`: the component's arguments) as a TrainJob: created, node 0's
    log shown, waited for; rank 0's summary, or the failure as the stage's exit."""
    from kubeflow.trainer import KubernetesBackendConfig, TrainerClient
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    name = job_name(ds, mode)
    out = summary_uri(warehouse, name)
    job = trainjob(name, [*argv, "--output-metadata", out], cfg)
    namespace = _namespace(cfg)
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config()
        except (k8s_config.ConfigException, OSError):
            raise BadInput(
                f"--nodes {cfg.nodes}: no Kubernetes API to submit a TrainJob to "
                "(neither in a pod nor a kubeconfig)"
            ) from None
    try:
        k8s.CustomObjectsApi().create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, job.to_dict()
        )
    except k8s.exceptions.ApiException as e:  # refused (4xx: final) or unavailable (retry)
        kind = BadInput if 400 <= (e.status or 0) < 500 else RecdError
        raise kind(
            f"TrainJob {namespace}/{name} not created: {e.status} {e.reason} "
            f"({' '.join(str(e.body or '').split())[:200]})"
        ) from None
    say(
        f"recd train: TrainJob {namespace}/{name}, {cfg.nodes} node(s) x "
        f"{cfg.nproc_per_node} process(es), runtime {cfg.trainer_runtime}"
    )
    trainer = TrainerClient(KubernetesBackendConfig(namespace=namespace))
    trainer.wait_for_job_status(
        name, {"Running", "Complete", "Failed"}, timeout=cfg.trainjob_timeout_s
    )
    for line in trainer.get_job_logs(name, step=f"{NODE}-0", follow=True):
        say(line.rstrip("\n"))
    failure = None
    try:
        trainer.wait_for_job_status(name, {"Complete"}, timeout=cfg.trainjob_timeout_s)
    except (RuntimeError, TimeoutError) as e:
        failure = f"{type(e).__name__}: {str(e)[:200]}"
    return outcome(f"{namespace}/{name}", out, failure)


def outcome(job: str, summary_at: str, failure: str | None) -> dict:
    """A TrainJob's end as the train step's: rank 0's summary (at `summary_at`) when it
    completed; when it failed (`failure`: why the Trainer says so), rank 0's own failure
    (its exit code: a bad input stays final) or, without one, a retryable `TrainJobFailed`."""

    summary = read_summary(summary_at)
    if summary and summary.get("status") == "failed":  # rank 0 said why: its exit
        raise of_exit(summary.get("exit_code", 1), summary.get("error", ""))
    if failure is not None:
        raise TrainJobFailed(f"TrainJob {job} failed without a result from rank 0 ({failure})")
    if not summary:
        raise TrainJobFailed(
            f"TrainJob {job} completed, but rank 0 wrote no summary at {summary_at}"
        )
    return {**summary, "train.trainjob": job}


def trainjob_body(name: str, argv: list[str], cfg: TrainJobConfig) -> str:
    """The TrainJob as JSON (what `kubectl create -f` takes): for docs and inspection."""
    return json.dumps(trainjob(name, argv, cfg).to_dict(), indent=1)


def flag_options() -> list[tuple[str, type, object, str, bool]]:
    """Each field of `TrainJobConfig` as a flag: (name, type, default, help, repeatable)."""
    out = []
    for name, f in TrainJobConfig.model_fields.items():
        many = f.annotation == list[str]
        kind = f.annotation if f.annotation in (int, str) else str  # a Literal: its text
        default = None if many else f.default
        out.append((name, kind, default, f.description or "", many))
    return out


def stage_trainjob(cfg: TrainJobConfig) -> Callable[[str, dict, list | None], dict]:
    """How `recd run` runs its accelerated stage (train) across `cfg.nodes` machines: as a
    TrainJob of the train component with the stage's arguments (the runner's hook)."""

    def run(stage: str, args: dict, upstream: list | None = None) -> dict:
        if upstream:
            raise BadInput(f"{stage} gathers other stages' summaries: it runs on one machine")
        argv = ["--args-json", json.dumps(args, default=str)]
        return run_trainjob(argv, args["warehouse"], args["ds"], args.get("mode") or "dedup", cfg)

    return run
