"""The recd daily pipeline for Kubeflow Pipelines (kfp 2.x): `recd_core.orchestration.graph.DAILY`, the
graph the Airflow DAG runs too, each stage a container component of the components image
(`python -m components.<stage>`).

    python dags/kubeflow/recd_pipeline.py [--image IMG] [--out build/kfp/recd_pipeline.yaml]

compiles it (`make pipeline`); upload the YAML in the Kubeflow UI (docs/operations.md).
`lightweight_pipeline` is the same graph, with the same inputs, of lightweight Python
components calling `recd_core.orchestration.stages.run_stage` in the current environment: the
tests run it end to end with `kfp.local.SubprocessRunner(use_venv=False)`.

Every container component has one shape: `args` (a StageArgs JSON object), one input per
upstream stage it takes arguments from (`graph.PULLED_FROM`: its MLflow parent run, the
trained model), `u_<task>` per summary it merges (`finish`), and its own summary as the
output string; only the inputs its stage is given, all derived from the graph, none written
here.
"""

import argparse
import inspect
from pathlib import Path

from kfp import compiler, dsl, kubernetes

from recd_core.orchestration.graph import DAILY, PULLED_FROM, STAGES

IMAGE = "ghcr.io/recd-project/recd-components:0.1.0"
# the summaries finish merges, one input each (`u_<task>`): KFP components have fixed inputs
UPSTREAM = DAILY.gathered()


def _upstream_inputs(stage: str | None = None) -> list[str]:
    """The upstream inputs of `stage`'s component (every stage's: None): one JSON summary per
    stage it pulls arguments from (`graph.PULLED_FROM`), one `u_<task>` per summary it merges;
    a component has only the inputs some task of its stage is given."""
    tasks = [t for t in DAILY.tasks if stage in (None, t.stage)]
    pulled = {p.stage for t in tasks for p in STAGES[t.stage].pulls}
    gathered = {g for t in tasks for g in t.gathers}
    return [*(s for s in PULLED_FROM if stage is None or s in pulled),
            *(f"u_{t}" for t in UPSTREAM if stage is None or t in gathered)]  # fmt: skip


def _with_inputs(fn, variadic, names: list[str]):
    """`fn` with the upstream inputs `names` in place of its variadic parameter (KFP reads a
    component's inputs from its signature)."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind != variadic]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params += [inspect.Parameter(n, kind, default="{}", annotation=str) for n in names]
    ret = inspect.signature(fn).return_annotation
    fn.__signature__ = inspect.Signature(params, return_annotation=ret)
    return fn


def stage_command(name: str, args, sources: list, upstream: list, metadata) -> list:
    """A stage container's command line (`components/_entry.py`): its arguments, one summary
    per stage it pulls arguments from (in `PULLED_FROM` order), the summaries it gathers,
    where its own summary goes. Values or KFP placeholders alike."""
    return ["python", "-m", f"components.{name}", "--args-json", args,
            *[x for s, v in zip(PULLED_FROM, sources, strict=True) for x in (f"--{s}-json", v)],
            *[x for u in upstream for x in ("--upstream-item", u)],
            "--output-metadata", metadata]  # fmt: skip


def container_stage(name: str, image: str = IMAGE):
    """The container component of one stage."""

    names = _upstream_inputs(name)

    def stage(args: dict, metadata: dsl.OutputPath(str), *values: str):
        given = dict(zip(names, values, strict=True))  # KFP passes them in signature order
        sources = [given.get(s, "{}") for s in PULLED_FROM]
        upstream = [given[n] for n in names if n.startswith("u_")]
        cmd = stage_command(name, args, sources, upstream, metadata)
        return dsl.ContainerSpec(image=image, command=cmd[:3], args=cmd[3:])

    stage.__name__ = f"recd_{name}"
    stage.__doc__ = f"recd stage `{name}` (recd_core.orchestration.stages)."
    return dsl.container_component(_with_inputs(stage, inspect.Parameter.VAR_POSITIONAL, names))


def recd_stage(
    name: str,
    args: dict,
    executor_input: str = dsl.PIPELINE_TASK_EXECUTOR_INPUT_PLACEHOLDER,
    **upstream: str,
) -> str:
    """Lightweight twin of the container components: the same inputs, the same call, in this
    environment. KFP runs a lightweight component from its source, where `**upstream` cannot
    name the inputs the graph gives it (`_with_inputs` does, for the component's spec); it
    reads them from its executor input instead."""
    import json

    from recd_core.orchestration.graph import PULLED_FROM
    from recd_core.orchestration.stages import run_stage, with_upstream

    given = json.loads(executor_input)["inputs"].get("parameterValues", {})
    pulled = {s: given[s] for s in PULLED_FROM if s in given}
    items = [json.loads(v) for k, v in given.items() if k.startswith("u_") and v != "{}"]
    return json.dumps(run_stage(name, with_upstream(name, args, pulled), items or None))


recd_stage = dsl.component(base_image=IMAGE)(
    _with_inputs(recd_stage, inspect.Parameter.VAR_KEYWORD, _upstream_inputs())
)


def graph(op, args: dict) -> None:
    """`DAILY` as KFP tasks; `op(stage, task id, **inputs)` makes one. A stage's upstream summaries
    arrive as inputs named after the stage they come from (`start`, `train`) or, for the
    summaries finish merges, `u_<task>`; the declared order becomes `.after()`."""
    tasks: dict = {}
    for task in DAILY.order():
        inputs = {"args": {**args, **task.args()}}
        inputs |= {p.stage: tasks[src].output for p, src in DAILY.pulls(task)}
        inputs |= {f"u_{t}": tasks[t].output for t in task.gathers}
        tasks[task.id] = op(task.stage, task.id, **inputs).after(*(tasks[a] for a in task.after))


LOGS_MOUNT = "/mnt/recd-logs"  # where every pod sees the logs volume (`logs_pvc`)
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
RETRIES = 2
# what a step asks of the cluster: the accelerated stage (train) the most
RESOURCES = {False: ("1", "2G", "8G"), True: ("2", "8G", "16G")}  # cpu, memory request, limit


def build_pipeline(image: str = IMAGE):
    components = {t.stage: container_stage(t.stage, image) for t in DAILY.tasks}

    def op(name, task_id, accelerator: tuple | None = None, **inputs):
        """One task. Never served from KFP's cache: every stage reads or writes state its
        inputs do not name (the warehouse, the MLflow store), so equal inputs do not mean
        an equal result (a rerun of a day must rerun it)."""
        task = components[name](**inputs)
        task.set_display_name(task_id).set_caching_options(False)
        # KFP retries by count, not by exit code: a lost tracking server or a killed pod
        # (exits 4, 1) clears on a retry; bad input and gates (2, 3) fail again, fast
        task.set_retry(num_retries=RETRIES, backoff_duration="60s", backoff_factor=2.0,
                       backoff_max_duration="600s")  # fmt: skip
        cpu, memory, limit = RESOURCES[STAGES[name].accelerated]
        task.set_cpu_request(cpu).set_memory_request(memory).set_memory_limit(limit)
        if STAGES[name].accelerated and accelerator is not None:
            task.set_accelerator_type(accelerator[0]).set_accelerator_limit(accelerator[1])
        return task

    @dsl.pipeline(
        name="recd-daily-retrain", description="recd: one day of dedup-aware DLRM retraining"
    )
    def recd_pipeline(
        ds: str,
        logs: str = LOGS_MOUNT,  # raw logs are files: the logs volume, mounted in every pod
        warehouse: str = "s3://recd/warehouse",
        tracking_uri: str = "http://recd-mlflow:5000",
        config: str = "",
        synthesize: bool = False,
        train_accelerator: str = "nvidia.com/gpu",  # the train step's accelerator resource
        train_accelerators: int = 0,  # how many (0: train on CPUs)
        logs_pvc: str = "recd-logs",  # the PersistentVolumeClaim holding the raw logs
        s3_secret: str = "recd-s3",  # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (the chart's)
    ):
        def wired(name, task_id, **inputs):
            task = op(name, task_id, (train_accelerator, train_accelerators), **inputs)
            kubernetes.mount_pvc(task, pvc_name=logs_pvc, mount_path=LOGS_MOUNT)
            # optional: a warehouse that is not on S3 needs no keys
            kubernetes.use_secret_as_env(task, secret_name=s3_secret, optional=True,
                                         secret_key_to_env={k: k for k in S3_KEYS})  # fmt: skip
            return task

        graph(wired, {"warehouse": warehouse, "ds": ds, "logs": logs,
                      "tracking_uri": tracking_uri, "config": config,
                      "synthesize": synthesize, "pipeline": "recd kubeflow"})  # fmt: skip

    return recd_pipeline


@dsl.pipeline(name="recd-daily-retrain-lightweight")
def lightweight_pipeline(
    warehouse: str, ds: str, logs: str, tracking_uri: str = "", config: str = ""
):
    def op(name, task_id, **inputs):
        return recd_stage(name=name, **inputs).set_display_name(task_id)

    graph(op, {"warehouse": warehouse, "ds": ds, "logs": logs, "tracking_uri": tracking_uri,
               "config": config, "pipeline": "recd kubeflow (local)"})  # fmt: skip


def compile_pipeline(out: Path, image: str = IMAGE) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(image), str(out))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="compile the recd Kubeflow pipeline")
    p.add_argument("--image", default=IMAGE)
    p.add_argument("--out", type=Path, default=Path("build/kfp/recd_pipeline.yaml"))
    a = p.parse_args()
    print(f"compiled {compile_pipeline(a.out, a.image)} (image {a.image})")
