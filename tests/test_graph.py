"""The pipeline declared once (`recd_core.orchestration.graph`): the graphs' shape, every stage implemented
once with one entrypoint, and no runner keeping its own list of stages or edges."""

import ast
from pathlib import Path

import pytest

from recd_core.orchestration.graph import ARMS, COMPARISON, DAILY, STAGES, pipeline_graph
from recd_core.orchestration.stages import IMPLS, UPSTREAM_IMPLS

REPO = Path(__file__).resolve().parents[1]


def test_the_daily_graph_is_the_chain_of_its_stages():
    chain = [
        "start",
        "synth",
        "ingest",
        "generate",
        "preprocess",
        "train",
        "evaluate",
        "register",
        "finish",
    ]
    for a, b in zip(chain, chain[1:], strict=False):
        assert a in DAILY.task(b).after
    # the evaluation day: the same two stages, beside the training day's work, before
    # evaluate; its ingest after the training day's (a redelivered event is caught there)
    for task_id, after in (("ingest_eval", ("ingest",)), ("generate_eval", ("ingest_eval",))):
        task = DAILY.task(task_id)
        assert task.after == after and task.args() == {"days_of": "evaluation"}
    assert DAILY.task("evaluate").after == ("train", "generate_eval")
    assert [t.id for t in DAILY.order()] == [t.id for t in DAILY.tasks]
    # evaluate and register take the model (and register the train run) from train's summary
    pulls = {(p.arg, src) for p, src in DAILY.pulls(DAILY.task("register"))}
    assert pulls == {
        ("parent_run_id", "start"),
        ("model_uri", "train"),
        ("register_run_id", "train"),
    }


def test_the_comparison_graph_runs_both_arms_after_generate_and_compares_them():
    for arm in ARMS:
        assert COMPARISON.task(f"preprocess_{arm}").after == ("generate",)
        evaluate = COMPARISON.task(f"evaluate_{arm}")
        assert evaluate.mode == arm and evaluate.id in COMPARISON.task("compare").after
        # an arm's evaluate takes its own arm's model
        assert (
            dict((p.arg, s) for p, s in COMPARISON.pulls(evaluate))["model_uri"] == f"train_{arm}"
        )
    assert COMPARISON.task("finish").after == ("compare",)
    assert "register" not in {t.stage for t in COMPARISON.tasks}
    with pytest.raises(ValueError, match="both arms"):
        pipeline_graph(("dedup",), register=False, compare=True, name="x")


def test_every_stage_is_implemented_once_and_has_one_entrypoint():
    assert set(IMPLS) | set(UPSTREAM_IMPLS) == set(STAGES)
    assert set(UPSTREAM_IMPLS) == {name for name, s in STAGES.items() if s.gathers}
    for name in STAGES:
        assert (REPO / "components" / f"{name}.py").exists(), name


def _code_strings(path: Path) -> set[str]:
    """String literals of a module's code (docstrings, which document, left out)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    }


def test_no_runner_keeps_its_own_list_of_stages_or_edges():
    names = set(STAGES) | {t.id for g in (DAILY, COMPARISON) for t in g.tasks}
    files = [
        *(REPO / "dags").rglob("*.py"),
        *(REPO / "components").glob("_*.py"),
        REPO / "recd_core" / "orchestration" / "runner.py",
    ]
    inputs = names | {f"u_{n}" for n in names}  # a component input per stage, spelled out
    for path in files:
        assert not (_code_strings(path) & names), path
        assert "chain(" not in path.read_text(), path
        params = {n.arg for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.arg)}
        assert not (params & inputs), (path, params & inputs)


def test_the_dags_document_every_task_of_their_graph():
    for graph in (DAILY, COMPARISON):
        rows = graph.table().splitlines()[2:]
        assert [r.split("|")[1].strip() for r in rows] == [t.id for t in graph.tasks]


LAYERS = [
    "foundation",
    "dedup",
    "data",
    "dpp",
    "modeling",
    "scoring",
    "mlops",
    "serving",
    "orchestration",
    "bench",
    "cli",
]


def _layer(module: str) -> str:
    """recd_core.<layer>.<module> -> layer; root modules are the foundation, but the CLI
    (the edge, above every layer)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in LAYERS:
        return parts[1]
    return "cli" if parts[1:] == ["cli"] else "foundation"


def test_each_layer_imports_only_from_the_layers_above_it():
    root = REPO / "recd_core"
    for path in root.rglob("*.py"):
        own = _layer("recd_core." + ".".join(path.relative_to(root).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recd_core."):
                target = _layer(node.module)
                assert LAYERS.index(target) <= LAYERS.index(own), (path, node.module)


def test_every_stage_argument_is_common_or_one_stages_own():
    """Every stage named by an argument's `stages` is a stage, and a field no stage claims
    is common (every stage may take it): a component's `--help` shows exactly what its stage
    reads; a task's fixed arguments are its stage's own."""
    from recd_core.orchestration.stage_args import StageArgs, arg_spec, own_options, stages_options

    claimed = {s for n in StageArgs.model_fields for s in arg_spec(n).stages}
    assert claimed <= set(STAGES)
    common = set(StageArgs.model_fields) - stages_options()
    assert {"warehouse", "ds", "days", "eval_ds", "logs", "config", "tracking_uri"} <= common
    for task in (*DAILY.tasks, *COMPARISON.tasks):
        assert set(dict(task.fixed)) <= set(own_options(task.stage)), task.id
