"""The recd daily pipeline for Kubeflow Pipelines (kfp 2.x): the same stages as the Airflow
DAG, each a container component of the components image (`python -m components.<stage>`).

    python dags/kubeflow/recd_pipeline.py [--image IMG] [--out build/kfp/recd_pipeline.yaml]

compiles it (`make pipeline`); upload the YAML in the Kubeflow UI (docs/operations.md).
`lightweight_pipeline` is the same graph with lightweight Python components calling
`recd_core.stages.run_stage` in the current environment: the tests run it end to end with
`kfp.local.SubprocessRunner(use_venv=False)`.

Every stage component has one shape: `args` (a StageArgs JSON object), `start` and `train`
(upstream summaries the stage takes its MLflow parent run and model from), `u_*` (the
summaries `finish` merges), and its own summary as the output string.
"""

import argparse
from pathlib import Path

from kfp import compiler, dsl

IMAGE = "ghcr.io/recd-project/recd-components:0.1.0"
UPSTREAM = ("ingest", "generate", "preprocess", "train", "evaluate", "register")


def container_stage(name: str, image: str = IMAGE):
    """The container component of one stage."""

    def stage(
        args: dict,
        metadata: dsl.OutputPath(str),
        start: str = "{}",
        train: str = "{}",
        u_ingest: str = "{}",
        u_generate: str = "{}",
        u_preprocess: str = "{}",
        u_train: str = "{}",
        u_evaluate: str = "{}",
        u_register: str = "{}",
    ):
        ups = [u_ingest, u_generate, u_preprocess, u_train, u_evaluate, u_register]
        return dsl.ContainerSpec(
            image=image,
            command=["python", "-m", f"components.{name}"],
            args=["--args-json", args, "--start-json", start, "--train-json", train,
                  *[x for u in ups for x in ("--upstream-item", u)],
                  "--output-metadata", metadata],
        )  # fmt: skip

    stage.__name__ = f"recd_{name}"
    stage.__doc__ = f"recd stage `{name}` (recd_core.stages)."
    return dsl.container_component(stage)


@dsl.component(base_image=IMAGE)
def recd_stage(
    name: str,
    args: dict,
    start: str = "{}",
    train: str = "{}",
    u_ingest: str = "{}",
    u_generate: str = "{}",
    u_preprocess: str = "{}",
    u_train: str = "{}",
    u_evaluate: str = "{}",
    u_register: str = "{}",
) -> str:
    """Lightweight twin of the container components: the same call, in this environment."""
    import json

    from recd_core.stages import run_stage, with_upstream

    ups = [u_ingest, u_generate, u_preprocess, u_train, u_evaluate, u_register]
    items = [json.loads(u) for u in ups if u and u != "{}"]
    return json.dumps(run_stage(name, with_upstream(args, start, train), items or None))


def graph(op, args: dict) -> None:
    """start -> synth -> ingest -> generate -> preprocess -> train -> evaluate -> register ->
    finish; `op(name, **inputs)` makes one stage's task."""
    start = op("start", args=args)
    s = {"args": args, "start": start.output}
    synth = op("synth", **s)
    ingest = op("ingest", **s).after(synth)
    generate = op("generate", **s).after(ingest)
    preprocess = op("preprocess", **s).after(generate)
    train = op("train", **s).after(preprocess)
    evaluate = op("evaluate", **s, train=train.output)
    register = op("register", **s, train=train.output).after(evaluate)
    tasks = dict(
        zip(UPSTREAM, (ingest, generate, preprocess, train, evaluate, register), strict=True)
    )
    op("finish", **s, **{f"u_{k}": t.output for k, t in tasks.items()})


def _args(warehouse, ds, logs, tracking_uri, config, synthesize) -> dict:
    return {"warehouse": warehouse, "ds": ds, "logs": logs, "tracking_uri": tracking_uri,
            "config": config, "synthesize": synthesize, "pipeline": "recd kubeflow " + ds}  # fmt: skip


def build_pipeline(image: str = IMAGE):
    components = {n: container_stage(n, image) for n in ("start", "synth", *UPSTREAM, "finish")}

    def op(name, **inputs):
        task = components[name](**inputs)
        task.set_display_name(name)
        if name == "train":
            task.set_cpu_request("2").set_memory_request("8G").set_memory_limit("16G")
        return task

    @dsl.pipeline(
        name="recd-daily-retrain", description="recd: one day of dedup-aware DLRM retraining"
    )
    def recd_pipeline(
        ds: str,
        warehouse: str = "s3://recd/warehouse",
        logs: str = "s3://recd/logs",
        tracking_uri: str = "http://recd-mlflow:5000",
        config: str = "",
        synthesize: bool = False,
    ):
        graph(op, {"warehouse": warehouse, "ds": ds, "logs": logs, "tracking_uri": tracking_uri,
                   "config": config, "synthesize": synthesize, "pipeline": "recd kubeflow"})  # fmt: skip

    return recd_pipeline


@dsl.pipeline(name="recd-daily-retrain-lightweight")
def lightweight_pipeline(
    warehouse: str, ds: str, logs: str, tracking_uri: str = "", config: str = ""
):
    def op(name, **inputs):
        return recd_stage(name=name, **inputs).set_display_name(name)

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
