"""The house's floors: no module of recd_core imports, at the top or inside a function, a
module that imports it back, however far round (an import circle makes a module's meaning
depend on which of the two was imported first)."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "recd_core"


def _modules(roots: tuple[str, ...] = ("recd_core", "components")) -> dict[str, Path]:
    """Every module below `roots` (folders of the repository), by its dotted name."""
    root = PACKAGE.parent
    return {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for sub in roots
        for p in (root / sub).rglob("*.py")
    }


def _imports() -> dict[str, set[str]]:
    """Every recd_core module and the recd_core modules it imports (anywhere in it)."""
    graph = {}
    for name, path in _modules(("recd_core",)).items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recd_core"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("recd_core")}
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_counter_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_a_module_that_imports_it_back():
    graph = _imports()
    assert len(graph) > 80  # the whole package was read
    assert circles(graph) == []


def test_the_module_map_names_every_module():
    """docs/architecture.md's module map names every module of recd_core: by its path, or
    in its folder's row by its name (`modeling/sharded/`: `plan`, `state`, ...)."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = _map_rows(doc)  # each module (or folder) the map's second column names: its row
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        folder = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
        if rel.endswith("__init__.py") or rel in rows:
            continue
        if folder in rows and f"`{path.stem}`" in rows[folder]:
            continue
        unnamed.append(rel)
    assert unnamed == []


def _map_rows(doc: str) -> dict[str, str]:
    """Each module (or folder) docs/architecture.md's module map names: its row."""
    rows = {}
    for line in doc.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 4:
            for name in cells[2].split("`")[1::2]:
                rows[name] = line
    return rows


def test_every_module_the_map_names_exists():
    """No stale row: each `*.py` the module map names is a module of recd_core."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    named = [n for n in _map_rows(doc) if n.endswith(".py")]
    assert len(named) > 60
    assert [n for n in named if not (PACKAGE / n).is_file()] == []


def test_every_module_is_a_room_of_one_concern_and_a_readable_size():
    """No module past 600 lines (a newcomer reads one at a sitting); past that, a second
    concern has moved in and gets a module of its own."""
    sizes = {
        p.relative_to(PACKAGE.parent).as_posix(): len(p.read_text().splitlines())
        for p in _modules(("recd_core", "components", "dags")).values()
    }
    assert {p: n for p, n in sizes.items() if n > 600} == {}


def test_the_benchmarks_page_holds_current_figures_in_under_400_lines():
    """docs/benchmarks.md's own rule: current figures only (history to the journal, model
    quality's tables to quality.md), under 400 lines, and every page it links exists."""
    docs = PACKAGE.parent / "docs"
    page = (docs / "benchmarks.md").read_text()
    assert len(page.splitlines()) < 400
    linked = {m for m in re.findall(r"\]\(([\w./-]+\.md)", page)}
    assert {"journal.md", "quality.md"} <= linked
    assert [m for m in linked if not (docs / m).is_file()] == []


# What a module may import inside a function, and nothing else: a package whose import takes
# a second or more (measured with `python -c "import time; t = time.perf_counter(); import
# torch; print(time.perf_counter() - t)"` on 2 cores: torch 1.1 s, mlflow 1.5 s, torchrec
# 2.1 s, ray 0.4 s with its workers to come; pyarrow 0.13 s is not one), a package of an
# optional extra (absent where that extra is not installed), and a recd_core module that
# imports one of the first at its top. The rest goes at the top of the module, where a
# reader sees what it depends on.
HEAVY = {"torch", "torchrec", "fbgemm_gpu", "mlflow", "ray"}
OPTIONAL = {"airflow", "kfp", "kubeflow", "kubeflow_trainer_api", "kubernetes", "podman"}
OPTIONAL |= {"matplotlib", "sklearn", "lightgbm", "scipy", "uvicorn", "starlette", "psutil"}
LIGHT_ENTRY_POINTS = ("recd_core.cli", "recd_core.orchestration.stages", "components._entry")


def _module_imports(path: Path) -> tuple[set[str], list[tuple[int, str]]]:
    """A module's imports at its top (each module, and each `module.name`), and inside its
    functions (line, each module imported or `module.name`)."""
    tree = ast.parse(path.read_text())

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            return [f"{node.module}.{a.name}" for a in node.names]
        return []

    top = set()
    for node in tree.body:
        top |= set(targets(node))
        if isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module)
    inside = [
        (node.lineno, target)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        for target in targets(node)
    ]
    return top, inside


def heavy_modules() -> set[str]:
    """The modules of recd_core (and components) that import a heavy package at their top,
    directly or through another module's top."""
    tops = {m: _module_imports(p)[0] for m, p in _modules().items()}
    heavy, grew = set(), True
    while grew:
        grew = False
        for m, deps in tops.items():
            if m not in heavy and any(d.split(".")[0] in HEAVY or d in heavy for d in deps):
                heavy.add(m)
                grew = True
    return heavy


def test_an_import_inside_a_function_is_of_a_heavy_or_optional_package_only():
    heavy = heavy_modules()
    assert {"recd_core.modeling.train", "recd_core.mlops.registry"} <= heavy  # the rule sees them

    def may_wait(target: str) -> bool:
        parts = target.split(".")
        prefixes = {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
        return parts[0] in HEAVY | OPTIONAL or bool(prefixes & heavy)

    misplaced = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {target}"
        for path in _modules().values()
        for line, target in _module_imports(path)[1]
        if not may_wait(target)
    ]
    assert misplaced == [], "import these at the top of the module"


def test_the_command_line_and_the_stages_start_without_the_heavy_packages():
    """`recd --help`, a stage's component and the Airflow workers' import of the stages load
    none of torch, mlflow, torchrec or ray until a stage needs them."""
    heavy = heavy_modules()
    assert [m for m in LIGHT_ENTRY_POINTS if m in heavy] == []
