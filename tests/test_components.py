"""The component entrypoints a container runs, and the components image's Dockerfile
(checked statically: no Docker engine here)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recd_core.errors import BadInput
from recd_core.orchestration.graph import STAGES
from recd_core.orchestration.stages import run_stage
from recd_core.orchestration.summaries import with_upstream

REPO = Path(__file__).resolve().parents[1]
DAY = "2026-11-01"


def component(stage: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"components.{stage}", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def test_every_stage_has_an_entrypoint_with_typed_arguments():
    for stage in STAGES:
        r = component(stage, "--help")
        assert r.returncode == 0 and "--warehouse" in r.stdout and "--output-metadata" in r.stdout


def test_a_component_writes_its_summary_for_the_orchestrator(tmp_path, small_logs):
    meta = tmp_path / "out" / "metadata.json"
    r = component(
        "ingest",
        "--warehouse",
        tmp_path / "wh",
        "--ds",
        DAY,
        "--logs",
        small_logs,
        "--output-metadata",
        meta,
        "--args-json",
        json.dumps({"synthesize": False}),
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(meta.read_text())
    assert summary["status"] == "ok" and summary["ingest.rows_ok"] == summary["ingest.rows_in"] > 0
    assert sorted(summary["ingest.days"]) == [DAY]  # the training day
    assert not (tmp_path / "wh/events/ds=2026-11-02").exists()
    # the evaluation day: the same stage on the run's evaluation days (the graph's ingest_eval)
    r = component(
        "ingest",
        "--warehouse",
        tmp_path / "wh",
        "--ds",
        DAY,
        "--logs",
        small_logs,
        "--days-of",
        "evaluation",
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "wh/events/ds=2026-11-02/_manifest.json").exists()


def test_a_scheduled_run_reads_days_that_are_over(tmp_path):
    """Without `--ds`, a component takes its days from the run's scheduled time (a recurring
    Kubeflow run's): the evaluation day is the last day over when the run starts, the
    training day the one before; `--ds` wins; an unfilled placeholder is no time at all."""
    meta = tmp_path / "finish.json"
    for scheduled, ds in (
        ("2026-11-25T00:00:00Z", "2026-11-23"),
        ("2026-11-25T23:59:00+00:00", "2026-11-23"),
        ("2026-11-25T01:00:00+02:00", "2026-11-22"),
    ):
        r = component("finish", "--scheduled-time", scheduled, "--output-metadata", meta)
        assert r.returncode == 0, r.stderr
        summary = json.loads(meta.read_text())
        assert (summary["run.ds"], summary["run.eval_ds"]) == (
            ds,
            ds[:-2] + f"{int(ds[-2:]) + 1:02d}",
        )
    r = component(
        "finish", "--scheduled-time", "2026-11-25T00:00:00Z", "--ds", DAY, "--output-metadata", meta
    )
    assert json.loads(meta.read_text())["run.ds"] == DAY
    r = component("finish", "--scheduled-time", "{{$.pipeline_job_schedule_time_utc}}")
    assert r.returncode == 2 and "--ds" in r.stderr  # no day to work on, said in one line
    r = component("finish", "--scheduled-time", "soon")
    assert r.returncode == 2 and "ISO 8601" in r.stderr


RECD = Path(sys.executable).parent / "recd"


@pytest.mark.parametrize("stage", ["ingest", "generate"])
def test_a_command_and_its_component_are_the_same_stage(tmp_path, small_logs, stage):
    """`recd <stage>` and `python -m components.<stage>` with the same arguments do the same
    work: the same partitions, the same figures."""
    figures = []
    for runner in ("recd", "component"):
        wh = tmp_path / runner
        args = ["--warehouse", wh, "--ds", DAY]
        if stage == "generate":  # its input, the same way for both
            r = component("ingest", *args, "--logs", small_logs)
            assert r.returncode == 0, r.stderr
        else:
            args += ["--logs", small_logs]
        out = tmp_path / f"{runner}.json"
        if runner == "recd":
            r = subprocess.run(
                [str(RECD), stage, *map(str, args), "--summary", out],
                capture_output=True,
                text=True,
            )
        else:
            r = component(stage, *args, "--output-metadata", out)
        assert r.returncode == 0, r.stderr
        summary = json.loads(out.read_text())
        figures.append(
            {
                k: v
                for k, v in summary.items()
                if k.endswith(
                    (
                        "rows_ok",
                        "rows_in",
                        "storage.ratio",
                        "storage.bytes.dedup",
                        "storage.bytes.baseline",
                    )
                )
            }
        )
        tables = sorted(str(p.relative_to(wh).parent) for p in wh.rglob("_manifest.json"))
        figures[-1]["partitions"] = tables
    assert figures[0] == figures[1] and len(figures[0]) > 1
    if stage == "generate":  # the stage's default: both layouts of the training day
        assert "samples/layout=shuffled/ds=2026-11-01" in figures[0]["partitions"]


def test_a_stage_refuses_another_stages_argument(tmp_path):
    r = component(
        "ingest",
        "--warehouse",
        tmp_path / "wh",
        "--ds",
        DAY,
        "--args-json",
        json.dumps({"epochs": 2}),
    )
    assert r.returncode == 2 and "stage ingest takes no --epochs" in r.stderr
    assert "--epochs" not in component("ingest", "--help").stdout
    assert "--epochs" in component("train", "--help").stdout


def test_a_component_fails_with_one_line_and_the_stage_exit_code(tmp_path):
    r = component("generate", "--warehouse", tmp_path / "wh", "--ds", DAY)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "recd generate: error:" in r.stderr
    assert "events/ds=2026-11-01" in r.stderr
    r = component("train", "--warehouse", tmp_path / "wh", "--ds", "yesterday")
    assert r.returncode == 2 and "ds" in r.stderr


def test_upstream_summaries_fill_the_run_and_model_arguments():
    ups = {
        "start": '{"mlflow.run_id": "p1"}',
        "train": {"train.model_uris": "w/models/x", "mlflow.run_id": "t1"},
    }
    args = with_upstream("register", {"warehouse": "w", "ds": DAY}, ups)
    assert args["parent_run_id"] == "p1" and args["model_uri"] == "w/models/x"
    assert args["register_run_id"] == "t1"
    assert "register_run_id" not in with_upstream("evaluate", {"ds": DAY}, ups)  # its pulls only
    assert with_upstream("register", {"ds": DAY}, {"start": "{}", "train": "{}"}) == {"ds": DAY}
    with pytest.raises(BadInput, match="unknown stage"):
        run_stage("deploy", {"warehouse": "w", "ds": DAY})


DOCKERFILE = REPO / "components" / "Dockerfile"


def test_hadolint_passes_the_dockerfile():
    exe = Path(sys.executable).parent / "hadolint"
    r = subprocess.run(
        [str(exe), "--failure-threshold", "warning", str(DOCKERFILE)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dockerfile_is_multi_stage_pinned_and_non_root():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, flags=re.M | re.I)
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.M))
    for image, _ in froms:
        resolved = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
        if resolved in {alias for _, alias in froms}:
            continue
        assert re.search(r":[\w.\-]+(@sha256:[0-9a-f]{64})?$", resolved), (
            f"unpinned base {resolved}"
        )
        assert ":latest" not in resolved
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1] not in ("root", "0", "0:0"), "the runtime stage runs as non-root"
    assert "torch==2.13.0" in text  # torch pinned first, as on the CI machine
    assert re.search(r"^ARG\s+VARIANT=cpu", text, flags=re.M) and "cuda" in text.lower()
    for stage in STAGES:
        assert (REPO / "components" / f"{stage}.py").exists()
    assert re.search(r"COPY[^\n]*components", text) and re.search(
        r"COPY[^\n]*recd_core|pip install[^\n]*\.", text
    )
    dockerignore = (REPO / ".dockerignore").read_text()
    for ignored in (".venv", "data", ".git"):
        assert ignored in dockerignore


def test_a_stage_names_the_days_it_works_on_or_refuses():
    from recd_core.orchestration.stage_args import StageArgs

    args = {"warehouse": "w", "ds": DAY, "days": 2}
    assert StageArgs(**args).data_days() == [DAY, "2026-11-02"]
    assert StageArgs(**args, days_of="evaluation").data_days() == ["2026-11-03"]
    assert StageArgs(**args, days_of="run").data_days() == [DAY, "2026-11-02", "2026-11-03"]
    with pytest.raises(BadInput, match="no such day"):  # the evaluation day is a training day
        StageArgs(warehouse="w", ds=DAY, eval_ds=DAY, days_of="evaluation").data_days()


def test_each_recd_command_takes_the_options_its_component_takes(monkeypatch):
    """`recd <stage>` and `python -m components.<stage>` are generated from one declaration
    (`StageArgs`): the same option names, help, defaults and types, so a flag that works in
    a terminal works in a pod."""
    import types
    import typing

    import typer.main

    monkeypatch.syspath_prepend(str(REPO))  # the components run from the repository root
    from components._entry import parser
    from recd_core.cli import STAGE_COMMANDS, app
    from recd_core.orchestration.stage_args import WIRING, StageArgs

    cli = typer.main.get_command(app)
    for stage in STAGE_COMMANDS:
        component_opts = {
            a.option_strings[0]: a
            for a in parser(stage)._actions
            if a.dest in StageArgs.model_fields
        }
        command_opts = {
            p.opts[0]: p for p in cli.commands[stage].params if p.name in StageArgs.model_fields
        }
        wiring = {"--" + w.replace("_", "-") for w in WIRING}
        assert set(command_opts) == set(component_opts) - wiring, stage
        for flag, option in command_opts.items():
            field = StageArgs.model_fields[option.name]
            assert option.help == component_opts[flag].help, (stage, flag)
            assert option.required == field.is_required(), (stage, flag)
            if not field.is_required():
                assert option.default == field.default, (stage, flag)
            kind = field.annotation
            if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
                (kind,) = [k for k in typing.get_args(kind) if k is not type(None)]
            assert option.type_descriptor.annotation == kind, (stage, flag)
