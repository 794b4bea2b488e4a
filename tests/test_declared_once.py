"""A stage argument is declared once, in `StageArgs`: a new config override added there (here
`lr_dense`, with its config path `train.lr_dense`) reaches every runner with nothing else
written: the config overlay, `recd train`, `recd run` and `recd compare`, the train
component's flags and the train stage they run, the Airflow trigger forms of both DAGs
(and the train tasks' arguments only) and both Kubeflow pipelines' inputs (and the train
components' only)."""

from __future__ import annotations

import json
import subprocess
import sys

from airflow_env import DAGS, REPO, airflow_env

PROBE = r"""
import json, sys
from pydantic import create_model
from recd_core.errors import BadInput
from recd_core.orchestration import stage_args
from recd_core.orchestration.overlay import pipeline_config

declared = stage_args.arg("the dense layers' learning rate", stages=("train",),
                          config=("train.lr_dense",), gt=0)
stage_args.StageArgs = create_model(
    "StageArgs", __base__=stage_args.StageArgs, lr_dense=(float | None, declared))
out = {}

given = stage_args.parse_args({"ds": "2026-11-01", "lr_dense": "0.25"})
out["overlay"] = pipeline_config(given).train.lr_dense
out["unset"] = pipeline_config(stage_args.parse_args({"ds": "2026-11-01"})).train.lr_dense
try:
    stage_args.stage_args("ingest", {"ds": "2026-11-01", "lr_dense": "0.25"})
except BadInput as e:
    out["ingest_refuses"] = str(e)

from typer.testing import CliRunner
from recd_core.cli import app
runner = CliRunner()
out["recd_train"] = "--lr-dense" in runner.invoke(app, ["train", "--help"], terminal_width=200).output
for command in ("run", "compare"):
    shown = runner.invoke(app, [command, "--help"], terminal_width=200).output
    out[f"recd_{command}"] = "--lr-dense" in shown

sys.path.insert(0, sys.argv[1])
from components._entry import parser
flags = ["--ds", "2026-11-01", "--warehouse", sys.argv[4], "--lr-dense", "0.25"]
out["component"] = parser("train").parse_args(flags).lr_dense

# the value reaches the stage: the train component run as an orchestrator runs it, with the
# training itself (minutes) replaced by a function that keeps the config it is handed
import contextlib
import recd_core.mlops.starting_version as starting_version
import recd_core.modeling.train as training
from components._entry import main
handed = {}
starting_version.starting_model = lambda *a, **k: contextlib.nullcontext((None, "scratch"))
training.train = lambda wh, day, tc, **kw: handed.setdefault("lr_dense", tc.lr_dense) and {}
out["component_exit"] = main("train", flags)
out["stage_lr_dense"] = handed.get("lr_dense")

sys.path.insert(0, sys.argv[2])
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[2], safe_mode=False)
out["airflow_errors"] = {k: str(v)[-300:] for k, v in bag.import_errors.items()}
from recd_core.orchestration.graph import COMPARISON, DAILY
for graph in (DAILY, COMPARISON):
    dag = bag.dags.get(graph.name)
    if dag is None:
        continue
    param = dag.params.get_param("lr_dense")
    out[f"airflow_param.{graph.name}"] = {**param.schema, "description": param.description}
    stages = {t.id for t in graph.tasks}
    out[f"airflow_takers.{graph.name}"] = sorted(
        t.task_id for t in dag.tasks if t.task_id in stages
        if "lr_dense" in json.dumps([getattr(t, "op_args", None), getattr(t, "op_kwargs", None)],
                                    default=str))

sys.path.insert(0, sys.argv[3])
import tempfile, yaml
import recd_pipeline
from kfp import compiler
for graph in (DAILY, COMPARISON):
    with tempfile.TemporaryDirectory() as tmp:
        compiler.Compiler().compile(recd_pipeline.build_pipeline(g=graph), f"{tmp}/p.yaml")
        with open(f"{tmp}/p.yaml") as f:
            spec = next(yaml.safe_load_all(f))
    out[f"kfp_input.{graph.name}"] = spec["root"]["inputDefinitions"]["parameters"].get("lr_dense")
    out[f"kfp_takers.{graph.name}"] = sorted(
        name for name, c in spec["components"].items()
        if "lr_dense" in c.get("inputDefinitions", {}).get("parameters", {}))
print("PROBE" + json.dumps(out, default=str))
"""


def test_one_declaration_of_an_override_reaches_every_runner(tmp_path):
    env = airflow_env(tmp_path / "airflow", tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            str(REPO),
            str(DAGS),
            str(REPO / "dags" / "kubeflow"),
            str(tmp_path / "warehouse"),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("PROBE", 1)[1])
    assert out["overlay"] == 0.25 and out["unset"] != 0.25
    assert "stage ingest takes no --lr-dense" in out["ingest_refuses"]
    assert out["recd_train"] and out["recd_run"] and out["recd_compare"]
    assert out["component"] == "0.25" and out["component_exit"] == 0
    assert out["stage_lr_dense"] == 0.25
    assert out["airflow_errors"] == {}
    for graph, takers in (
        ("recd_daily_retrain", ["train"]),
        ("recd_dedup_vs_baseline", ["train_baseline", "train_dedup"]),
    ):
        param = out[f"airflow_param.{graph}"]
        assert param["type"] == ["null", "number"]
        assert (
            param["description"].startswith("train: ") and "learning rate" in param["description"]
        )
        assert out[f"airflow_takers.{graph}"] == takers
        # empty by default, the config's value (kfp.local cannot run optional inputs without one)
        kfp_input = out[f"kfp_input.{graph}"]
        assert kfp_input["defaultValue"] == "" and "learning rate" in kfp_input["description"]
        assert out[f"kfp_takers.{graph}"] and all("train" in c for c in out[f"kfp_takers.{graph}"])
