"""The house's floors: no module of recd_core imports, at the top or inside a function, a
module that imports it back, however far round (an import circle makes a module's meaning
depend on which of the two was imported first)."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "recd_core"


def _imports() -> dict[str, set[str]]:
    """Every recd_core module and the recd_core modules it imports (anywhere in it)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
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
        for root in ("recd_core", "components", "dags")
        for p in (PACKAGE.parent / root).rglob("*.py")
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
