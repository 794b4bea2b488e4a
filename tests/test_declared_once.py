"""A stage argument is declared once, in `StageArgs`: a new config override added there (here
`lr_dense`, with its config path `train.lr_dense`) reaches every runner with nothing else
written: the config overlay, `recd train` and `recd run`, the train component's flags, the
Airflow trigger form (and the train task's arguments only) and the Kubeflow pipeline's
inputs (and the train component's only)."""

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

declared = stage_args.arg("the dense layers' learning rate", stages="train",
                          config="train.lr_dense", gt=0)
stage_args.StageArgs = create_model(
    "StageArgs", __base__=stage_args.StageArgs, lr_dense=(float | None, declared))
out = {}

given = stage_args.parse_args({"ds": "2026-11-01", "lr_dense": "0.25"})
out["overlay"] = given.pipeline_config().train.lr_dense
out["unset"] = stage_args.parse_args({"ds": "2026-11-01"}).pipeline_config().train.lr_dense
try:
    stage_args.stage_args("ingest", {"ds": "2026-11-01", "lr_dense": "0.25"})
except BadInput as e:
    out["ingest_refuses"] = str(e)

from typer.testing import CliRunner
from recd_core.cli import app
runner = CliRunner()
out["recd_train"] = "--lr-dense" in runner.invoke(app, ["train", "--help"], terminal_width=200).output
out["recd_run"] = "--lr-dense" in runner.invoke(app, ["run", "--help"], terminal_width=200).output

sys.path.insert(0, sys.argv[1])
from components._entry import parser
out["component"] = parser("train").parse_args(["--lr-dense", "0.25"]).lr_dense

sys.path.insert(0, sys.argv[2])
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[2], safe_mode=False)
out["airflow_errors"] = {k: str(v)[-300:] for k, v in bag.import_errors.items()}
dag = bag.dags.get("recd_daily_retrain")
if dag is None:
    print("PROBE" + json.dumps(out, default=str))
    sys.exit(0)
param = dag.params.get_param("lr_dense")
out["airflow_param"] = {**param.schema, "description": param.description}
from recd_core.orchestration.graph import DAILY
stages = {t.id for t in DAILY.tasks}
out["airflow_takers"] = sorted(t.task_id for t in dag.tasks if t.task_id in stages
                               if "lr_dense" in json.dumps([getattr(t, "op_args", None), getattr(t, "op_kwargs", None)], default=str))

sys.path.insert(0, sys.argv[3])
import tempfile, yaml
import recd_pipeline
from kfp import compiler
with tempfile.TemporaryDirectory() as tmp:
    compiler.Compiler().compile(recd_pipeline.build_pipeline(), f"{tmp}/p.yaml")
    with open(f"{tmp}/p.yaml") as f:
        spec = next(yaml.safe_load_all(f))
out["kfp_input"] = spec["root"]["inputDefinitions"]["parameters"].get("lr_dense")
out["kfp_takers"] = sorted(
    name for name, c in spec["components"].items()
    if "lr_dense" in c.get("inputDefinitions", {}).get("parameters", {}))
print("PROBE" + json.dumps(out, default=str))
"""


def test_one_declaration_of_an_override_reaches_every_runner(tmp_path):
    env = airflow_env(tmp_path / "airflow", tmp_path)
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO), str(DAGS), str(REPO / "dags" / "kubeflow")],
        env=env, capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("PROBE", 1)[1])
    assert out["overlay"] == 0.25 and out["unset"] != 0.25
    assert "stage ingest takes no --lr-dense" in out["ingest_refuses"]
    assert out["recd_train"] and out["recd_run"]
    assert out["component"] == "0.25"
    assert out["airflow_errors"] == {}
    assert out["airflow_param"]["type"] == ["null", "number"]
    assert "learning rate" in out["airflow_param"]["description"]
    assert out["airflow_takers"] == ["train"]
    # empty by default, the config's value (kfp.local cannot run optional inputs without one)
    assert (
        out["kfp_input"]["defaultValue"] == ""
        and "learning rate" in out["kfp_input"]["description"]
    )
    assert out["kfp_takers"] == ["comp-recd-train"]
