"""The recd pipelines for Kubeflow Pipelines (kfp 2.x): `recd_core.orchestration.graph.DAILY`
(the graph the Airflow DAG runs too) and `COMPARISON` (both arms, side by side), each stage a
container component of the components image (`python -m components.<stage>`).

    python dags/kubeflow/recd_pipeline.py [--image IMG] [--out-dir build/kfp]

compiles both (`make pipeline`: `recd_pipeline.yaml`, `recd_comparison.yaml`); upload them in
the Kubeflow UI (docs/operations.md). `lightweight_pipeline` is the daily graph of lightweight
Python components calling `recd_core.orchestration.stages.run_stage` in the current
environment: the tests run it end to end with `kfp.local.SubprocessRunner(use_venv=False)`.

Every container component has one shape, all derived from the graph, none written here:
flat typed inputs (the run's own: `ds`, `warehouse`, …; the task's: `mode`, `days_of`), one
input per upstream stage it takes arguments from (`graph.PULLED_FROM`: its MLflow parent
run, the trained model), `u_<task>` per summary it merges (`finish`, `compare`); its
summary as the output string and its typed outputs (`graph.outputs`: Datasets, a Model,
Metrics, a Markdown report) as artifacts, written by `components/_kfp.py`. Without `ds`, a
recurring run's days come from its scheduled time (`orchestration.schedule`).
"""

import argparse
import inspect
from pathlib import Path

from kfp import compiler, dsl, kubernetes

from recd_core.orchestration.graph import (
    COMPARISON,
    DAILY,
    OUTPUT_NAMES,
    PULLED_FROM,
    STAGES,
    Graph,
    outputs,
)
from recd_core.orchestration.stage_args import for_stage, override_fields, param_schema
from recd_core.orchestration.trainjob import S3_KEYS

IMAGE = "ghcr.io/recd-project/recd-components:0.1.0"
# the run's arguments every stage takes, as pipeline inputs, typed as `StageArgs` declares
# them; and the schedule's time, which components turn into the days (components/_entry.py)
RUN_INPUTS = ("ds", "warehouse", "logs", "tracking_uri", "config", "synthesize", "pipeline")
KFP_TYPES = {"boolean": bool, "integer": int, "number": float}
SHARED = {
    **{n: KFP_TYPES.get(param_schema(n)["type"], str) for n in RUN_INPUTS},
    "scheduled_time": str,
}
# the config overrides (`StageArgs`, `arg(config=...)`) as pipeline inputs, empty by default
# (the config's value holds); `mode` is the graph's (a task's arm), not the run's. Text, not
# `Optional[int] = None`: kfp.local (2.17) cannot run a pipeline whose optional inputs have
# no default, and a number has no empty value; the stage validates the text as StageArgs
# types it (a bad value is one line, exit 2).
OVERRIDES = tuple(n for n in override_fields() if n != "mode")
ARTIFACTS = {
    "dataset": dsl.Dataset,
    "model": dsl.Model,
    "metrics": dsl.Metrics,
    "markdown": dsl.Markdown,
}
GRAPHS = (DAILY, COMPARISON)


def _overrides(stage: str) -> list[str]:
    """The overrides `stage` takes (the common ones and its own)."""
    return [n for n in OVERRIDES if for_stage(stage, {n: None})]


def _task_args(stage: str) -> list[str]:
    """The arguments some task of `stage` fixes (`graph.Task.args`: `mode`, `days_of`)."""
    tasks = [t for g in GRAPHS for t in g.tasks if t.stage == stage]
    return sorted({k for t in tasks for k in t.args()})


def _upstream_inputs(stage: str | None = None, graph: Graph = DAILY) -> list[str]:
    """The upstream inputs of `stage`'s component (every stage's: None): one JSON summary per
    stage it pulls arguments from (`graph.PULLED_FROM`), one `u_<task>` per summary it merges
    (over every graph built here); a component has only the inputs some task gives it."""
    graphs = GRAPHS if stage is not None else (graph,)
    tasks = [t for g in graphs for t in g.tasks if stage in (None, t.stage)]
    pulled = {p.stage for t in tasks for p in STAGES[t.stage].pulls}
    gathered = list(dict.fromkeys(g for t in tasks for g in t.gathers))
    return [
        *(s for s in PULLED_FROM if stage is None or s in pulled),
        *(f"u_{t}" for t in gathered),
    ]


def _with_inputs(fn, variadic, params: list[inspect.Parameter]):
    """`fn` with `params` in place of its variadic parameter (KFP reads a component's inputs
    and outputs from its signature)."""
    own = [p for p in inspect.signature(fn).parameters.values() if p.kind != variadic]
    ret = inspect.signature(fn).return_annotation
    fn.__signature__ = inspect.Signature([*own, *params], return_annotation=ret)
    return fn


def _param(name: str, annotation, default=inspect.Parameter.empty) -> inspect.Parameter:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Parameter(name, kind, default=default, annotation=annotation)


def stage_command(
    name: str, flags: dict, sources: list, upstream: list, metadata, executor_input=None
) -> list:
    """A stage container's command line (`components/_entry.py`): its arguments as flags, one
    summary per stage it pulls arguments from (in `PULLED_FROM` order), the summaries it
    gathers, where its summary goes, and (Kubeflow) the executor input its typed outputs
    are written for. Values or KFP placeholders alike."""
    return [
        "python",
        "-m",
        f"components.{name}",
        *[x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", v)],
        *[x for s, v in zip(PULLED_FROM, sources, strict=True) for x in (f"--{s}-json", v)],
        *[x for u in upstream for x in ("--upstream-item", u)],
        "--output-metadata",
        metadata,
        *(["--executor-input", executor_input] if executor_input else []),
    ]


def consumed(stage: str) -> dict[str, str]:
    """The artifact inputs of `stage`'s component, `in_<output>` -> kind: one per table it
    reads that some stage leaves as a typed output (`graph.outputs`)."""
    produced = {n: k for s in STAGES for n, k in outputs(s).items()}
    names = [OUTPUT_NAMES.get(t, t) for t in STAGES[stage].reads]
    return {f"in_{n}": produced[n] for n in names if n in produced}


def producers(g: Graph, task) -> dict[str, str]:
    """For each artifact input of `task`'s stage, the nearest upstream task (along `after`)
    whose stage writes it: `in_<output>` -> task id."""
    by_id = {t.id: t for t in g.tasks}
    out: dict[str, str] = {}
    for name in consumed(task.stage):
        table = name.removeprefix("in_")
        frontier, seen = list(task.after), set()
        while frontier and name not in out:
            tid = frontier.pop(0)
            if tid in seen:
                continue
            seen.add(tid)
            if table in outputs(by_id[tid].stage):
                out[name] = tid
            frontier += list(by_id[tid].after)
    return out


def container_stage(name: str, image: str = IMAGE, across: tuple[int, int] | None = None):
    """The container component of one stage; `across`: (nodes, processes a node) of a train
    stage run across machines as a Kubeflow Trainer TrainJob (orchestration/trainjob.py):
    the step submits it, on the image it runs itself, with the run's logs volume and S3
    secret (its `logs_pvc` and `s3_secret` inputs), and waits for it."""
    task_args, upstream = _task_args(name), _upstream_inputs(name)
    # in signature order (KFP passes them so): the run's inputs, the outputs, then the
    # inputs with defaults (the task's own arguments, the upstream summaries)
    params = [_param(k, SHARED[k]) for k in SHARED]
    params += [_param("summary", dsl.OutputPath(str))]
    params += [_param(n, dsl.Output[ARTIFACTS[kind]]) for n, kind in outputs(name).items()]
    params += [_param(k, str, "") for k in task_args]
    overrides = [n for n in _overrides(name) if n not in task_args]
    params += [_param(n, str, "") for n in overrides]
    params += [_param(n, str, "{}") for n in upstream]
    # what it reads, as the producing step's artifact (optional: a day's first stage has no
    # producer in the run): the run's lineage graph links the steps
    params += [_param(n, dsl.Input[ARTIFACTS[kind]], None) for n, kind in consumed(name).items()]
    if across is not None:
        params += [_param("logs_pvc", str, ""), _param("s3_secret", str, "")]
    names = [p.name for p in params]

    def stage(*values):
        given = dict(zip(names, values, strict=True))
        flags = {k: given[k] for k in (*SHARED, *task_args, *overrides)}
        sources = [given.get(s, "{}") for s in PULLED_FROM]
        gathered = [given[n] for n in upstream if n.startswith("u_")]
        cmd = stage_command(
            name,
            flags,
            sources,
            gathered,
            given["summary"],
            dsl.PIPELINE_TASK_EXECUTOR_INPUT_PLACEHOLDER,
        )
        if across is not None:
            cmd += [
                "--nodes",
                str(across[0]),
                "--nproc-per-node",
                str(across[1]),
                "--image",
                image,
                "--volume",
                f"{given['logs_pvc']}:{LOGS_MOUNT}",
                "--s3-secret",
                given["s3_secret"],
            ]
        return dsl.ContainerSpec(image=image, command=cmd[:3], args=cmd[3:])

    stage.__name__ = f"recd_{name}"
    stage.__doc__ = f"recd stage `{name}`: {STAGES[name].doc}." + (
        f" Across {across[0]} machines: a Kubeflow Trainer TrainJob it submits and waits for."
        if across
        else ""
    )
    return dsl.container_component(_with_inputs(stage, inspect.Parameter.VAR_POSITIONAL, params))


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
    from recd_core.orchestration.stages import run_stage
    from recd_core.orchestration.summaries import with_upstream

    given = json.loads(executor_input)["inputs"].get("parameterValues", {})
    pulled = {s: given[s] for s in PULLED_FROM if s in given}
    items = [json.loads(v) for k, v in given.items() if k.startswith("u_") and v != "{}"]
    return json.dumps(run_stage(name, with_upstream(name, args, pulled), items or None))


recd_stage = dsl.component(base_image=IMAGE)(
    _with_inputs(
        recd_stage,
        inspect.Parameter.VAR_KEYWORD,
        [_param(n, str, "{}") for n in _upstream_inputs(None, DAILY)],
    )
)


def graph(op, g: Graph, artifacts: bool = False) -> None:
    """Graph `g` as KFP tasks; `op(task, **upstream)` makes one. A stage's upstream summaries
    arrive as inputs named after the stage they come from (`start`, `train`) or, for the
    summaries it merges, `u_<task>`; with `artifacts` (the container components), what it
    reads as the producing step's output (`in_<output>`); the declared order becomes
    `.after()`."""
    tasks: dict = {}

    def summary(task_id: str):  # a container component's `summary`, a lightweight one's Output
        outs = tasks[task_id].outputs
        return outs["summary"] if "summary" in outs else outs["Output"]

    for task in g.order():
        inputs = {p.stage: summary(src) for p, src in g.pulls(task)}
        inputs |= {f"u_{t}": summary(t) for t in task.gathers}
        if artifacts:
            inputs |= {
                n: tasks[src].outputs[n.removeprefix("in_")]
                for n, src in producers(g, task).items()
            }
        step = op(task, **inputs)
        step.after(*(tasks[a] for a in task.after))
        tasks[task.id] = step


LOGS_MOUNT = "/mnt/recd-logs"  # where every pod sees the logs volume (`logs_pvc`)
RETRIES = 2
# what a step asks of the cluster: the accelerated stage (train) the most
# cpu request, cpu limit, memory request, memory limit; the CPU limit is what training sizes
# its threads by (runtime.cpu_budget reads the cgroup's quota)
RESOURCES = {False: ("1", "2", "2G", "8G"), True: ("2", "4", "8G", "16G")}
# a step's timeout: training's from the config's default (`train.timeout_minutes`), the
# others an hour, as the Airflow tasks'
TIMEOUT_S = {False: 3600, True: 180 * 60}
# the label the chart's MLflow NetworkPolicy admits (helm/recd/templates/networkpolicy.yaml)
MLFLOW_CLIENT_LABEL = ("recd.ai/mlflow-client", "true")
# `helm install recd ./helm/recd -n recd` (docs/operations.md): its MLflow Service, by a name
# that resolves from any namespace
TRACKING_URI = "http://recd-mlflow.recd:5000"
NAMES = {
    DAILY.name: (
        "recd-daily-retrain",
        "recd: one day of dedup-aware DLRM retraining",
        "recd_pipeline.yaml",
    ),
    COMPARISON.name: (
        "recd-dedup-vs-baseline",
        "recd: dedup and baseline arms trained on the same day, side by side",
        "recd_comparison.yaml",
    ),
}


GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
# the run's inputs' defaults in a cluster (their types and descriptions: `StageArgs`)
RUN_DEFAULTS = {
    "ds": "",
    "warehouse": "s3://recd/warehouse",
    "logs": LOGS_MOUNT,
    "tracking_uri": TRACKING_URI,
    "config": "",
    "synthesize": False,
}
# the pipeline's own inputs (where its steps run), with their types and defaults
PIPELINE_INPUTS = {
    "train_accelerator": (str, "nvidia.com/gpu"),
    "train_accelerators": (int, 0),
    "train_node_selector": (dict, {}),
    "train_tolerations": (list, GPU_TOLERATIONS),
    "logs_pvc": (str, "recd-logs"),
    "s3_secret": (str, "recd-s3"),
}
# what the UI shows beside each input (kfp compiles a pipeline's docstring `Args:` into input
# descriptions); the stages' own arguments are described where they are declared (StageArgs)
INPUT_HELP = {
    "ds": "the training day YYYY-MM-DD; empty: the last complete days before the run's "
    "scheduled time (a recurring run leaves it empty)",
    "logs": f"raw logs root, ds=<day>/ folders (default: the logs volume, mounted at {LOGS_MOUNT})",
    "tracking_uri": f"MLflow tracking URI (default: the chart's Service, `helm install recd "
    f"./helm/recd -n recd`: {TRACKING_URI})",
    "train_accelerator": "the train step's accelerator resource (nvidia.com/gpu)",
    "train_accelerators": "accelerators for the train step (0: train on CPUs)",
    "train_node_selector": "node labels the train step must run on, e.g. "
    '{"nvidia.com/gpu.present": "true"} ({}: any node)',
    "train_tolerations": "taints the train step tolerates (default: GPU nodes' nvidia.com/gpu)",
    "logs_pvc": "the PersistentVolumeClaim holding the raw logs, mounted in every step",
    "s3_secret": "Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for an s3:// "
    "warehouse (optional; the chart's: recd-s3)",
}


def pipeline_doc(description: str) -> str:
    """The pipeline's docstring: its description, and `Args:` describing every input (the
    run's arguments from `StageArgs`, the pipeline's own from `INPUT_HELP`)."""
    names = [
        *(n for n in RUN_INPUTS if n != "pipeline"),
        *(n for n in INPUT_HELP if n not in RUN_INPUTS),
        *OVERRIDES,
    ]
    lines = [description, "", "Args:"]
    for n in names:
        text = INPUT_HELP.get(n) or param_schema(n).get("description", n)
        if n in OVERRIDES:
            text += " (empty: the config's value)"
        lines.append(f"    {n}: {' '.join(text.split())}")
    return "\n".join(lines)


def build_pipeline(
    image: str = IMAGE,
    g: Graph = DAILY,
    scheduled: bool = True,
    retries: int = RETRIES,
    train_nodes: int = 1,
    nproc_per_node: int = 1,
):
    """The pipeline of graph `g`. `scheduled=False` leaves out the scheduled-time
    placeholder, which `kfp.local` (2.17) cannot resolve: the local container run's build.
    `train_nodes > 1`: the accelerated stage (train) across that many machines of
    `nproc_per_node` processes, a Kubeflow Trainer TrainJob its step submits."""
    across = (train_nodes, nproc_per_node) if train_nodes > 1 else None
    components = {
        t.stage: container_stage(t.stage, image, across if STAGES[t.stage].accelerated else None)
        for t in g.tasks
    }
    name, description, _ = NAMES[g.name]

    def op(task, shared: dict, accelerator: tuple, **upstream):
        """One task. Never served from KFP's cache: every stage reads or writes state its
        inputs do not name (the warehouse, the MLflow store), so equal inputs do not mean
        an equal result (a rerun of a day must rerun it)."""
        step = components[task.stage](**shared, **task.args(), **upstream)
        step.set_display_name(task.id)
        step.set_caching_options(False)
        # KFP retries by count, not by exit code: a lost tracking server or a killed pod
        # (exits 4, 1) clears on a retry; bad input and gates (2, 3) fail again, fast
        step.set_retry(
            num_retries=retries,
            backoff_duration="60s",
            backoff_factor=2.0,
            backoff_max_duration="600s",
        )
        here = STAGES[task.stage].accelerated and across is None  # trains in its own pod
        cpu, cpu_limit, memory, limit = RESOURCES[here]
        step.set_cpu_request(cpu).set_cpu_limit(cpu_limit)
        step.set_memory_request(memory).set_memory_limit(limit)
        if here:
            step.set_accelerator_type(accelerator[0]).set_accelerator_limit(accelerator[1])
        return step

    params = [_param(n, SHARED[n], RUN_DEFAULTS[n]) for n in RUN_INPUTS if n != "pipeline"]
    params += [_param(n, t, d) for n, (t, d) in PIPELINE_INPUTS.items()]
    params += [_param(n, str, "") for n in OVERRIDES]
    names = [p.name for p in params]

    def recd_pipeline(*values):
        inputs = dict(zip(names, values, strict=True))
        overrides = {n: inputs[n] for n in OVERRIDES}
        shared = {
            **{n: inputs[n] for n in RUN_INPUTS if n != "pipeline"},
            "pipeline": "recd kubeflow",
            # the backend fills it for a recurring run's jobs; `ds` wins when given
            "scheduled_time": dsl.PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER if scheduled else "",
        }
        accelerator = (inputs["train_accelerator"], inputs["train_accelerators"])

        def wired(task, **upstream):
            mine = {n: overrides[n] for n in _overrides(task.stage) if n not in task.args()}
            if across is not None and STAGES[task.stage].accelerated:
                mine |= {"logs_pvc": inputs["logs_pvc"], "s3_secret": inputs["s3_secret"]}
            step = op(task, {**shared, **mine}, accelerator, **upstream)
            kubernetes.mount_pvc(step, pvc_name=inputs["logs_pvc"], mount_path=LOGS_MOUNT)
            # optional: a warehouse that is not on S3 needs no keys
            kubernetes.use_secret_as_env(
                step,
                secret_name=inputs["s3_secret"],
                optional=True,
                secret_key_to_env={k: k for k in S3_KEYS},
            )
            kubernetes.add_pod_label(step, *MLFLOW_CLIENT_LABEL)
            accelerated = STAGES[task.stage].accelerated
            kubernetes.set_timeout(step, TIMEOUT_S[accelerated])
            if accelerated and across is None:
                kubernetes.add_node_selector_json(step, inputs["train_node_selector"])
                kubernetes.add_toleration_json(step, inputs["train_tolerations"])
            return step

        graph(wired, g, artifacts=True)

    recd_pipeline.__doc__ = pipeline_doc(description)
    _with_inputs(recd_pipeline, inspect.Parameter.VAR_POSITIONAL, params)
    return dsl.pipeline(name=name, description=description)(recd_pipeline)


@dsl.pipeline(name="recd-daily-retrain-lightweight")
def lightweight_pipeline(
    warehouse: str, ds: str, logs: str, tracking_uri: str = "", config: str = ""
):
    shared = {
        "warehouse": warehouse,
        "ds": ds,
        "logs": logs,
        "tracking_uri": tracking_uri,
        "config": config,
        "pipeline": "recd kubeflow (local)",
    }

    def op(task, **upstream):
        args = {**shared, **task.args()}
        return recd_stage(name=task.stage, args=args, **upstream).set_display_name(task.id)

    graph(op, DAILY)


def compile_pipelines(
    out_dir: Path, image: str = IMAGE, train_nodes: int = 1, nproc_per_node: int = 1
) -> list[Path]:
    """Both pipelines, compiled into `out_dir` (train across `train_nodes` machines)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for g in GRAPHS:
        paths.append(out_dir / NAMES[g.name][2])
        pipeline = build_pipeline(image, g, train_nodes=train_nodes, nproc_per_node=nproc_per_node)
        compiler.Compiler().compile(pipeline, str(paths[-1]))
    return paths


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="compile the recd Kubeflow pipelines")
    p.add_argument("--image", default=IMAGE)
    p.add_argument("--out-dir", type=Path, default=Path("build/kfp"))
    p.add_argument(
        "--train-nodes",
        type=int,
        default=1,
        help="train across this many machines (a Kubeflow Trainer TrainJob)",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="training processes a pod")
    a = p.parse_args()
    for path in compile_pipelines(a.out_dir, a.image, a.train_nodes, a.nproc_per_node):
        print(f"compiled {path} (image {a.image})")
