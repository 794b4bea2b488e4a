"""Figures a long bench keeps as each model finishes, so a rerun resumes where it stopped.

`make bench-1m` fits seven models on each of two splits of ml-1m: hours on 2 cores. Each
model's figures are written as soon as it finishes; a rerun after an interruption (a
reboot, a killed session, a crash in a later model) reuses what was measured on the same
rows by the same code and fits only the rest:

    <out>/kept/<split>/<model>.json          (`recd bench --kept DIR`: DIR/<split>/...)
      {"key":      "5e1f…",                 a digest of what determines the figures:
                                            the rows (train and test, their content), the
                                            model's parameters and the source of the code
                                            that fits it (its module and every recd_core
                                            module it imports, transitively)
       "figures":  {"ne": …, "auc": …, …},  what the model scored
       "measured": "2026-11-27T20:15:03Z",  when, and where (minutes are that machine's)
       "machine":  "x86_64, 2 CPUs, …"}

A key that differs (other rows, changed code, other parameters) fits again and replaces
the file; so does a file that cannot be read (a crash mid-write leaves the previous
version: files are replaced atomically). Delete `<out>/kept` to measure everything again.
The records behind the ml-1m tables in docs/benchmarks.md are kept in docs/results/ml-1m:
`--kept docs/results/ml-1m` renders the tables from those whose key still matches (the same
rows and code) and fits only what is missing or stale; a fresh folder measures it all.
"""

from __future__ import annotations

import ast
import datetime as dt
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from recd_core.lineage import digest

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]  # the recd_core package


class _Hashing:
    """A write-only file that hashes what is written (Arrow's IPC writer streams into it)."""

    def __init__(self) -> None:
        self.h, self.closed = hashlib.sha256(), False

    def write(self, data) -> int:
        self.h.update(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def rows_digest(*tables: pa.Table) -> str:
    """A digest of the tables' content (schema and values, in order), streamed through
    Arrow's IPC format: no second copy of ml-1m's rows in memory."""
    sink = _Hashing()
    for table in tables:
        with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), table.schema) as writer:
            writer.write_table(table)
    return sink.h.hexdigest()[:16]


def _module_file(name: str, root: Path) -> Path | None:
    parts = name.split(".")[1:]
    if not parts:  # recd_core itself
        return root / "__init__.py"
    for p in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if p.is_file():
            return p
    return None


def _imports(path: Path, root: Path) -> set[str]:
    """The recd_core modules a file imports, anywhere in it (functions import lazily)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("recd_core.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recd_core"):
            found.add(node.module)
            # `from recd_core import metrics`: the names may be modules themselves
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if _module_file(m, root) is not None}


def source_digest(*modules: str, root: Path = ROOT) -> str:
    """A digest of the source of `modules` and of every recd_core module they import,
    transitively (`root`: the package's folder): the code a figure depends on, and none
    it does not."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen or _module_file(name, root) is None:
            continue
        seen.add(name)
        todo += sorted(_imports(_module_file(name, root), root) - seen)
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + _module_file(name, root).read_bytes())
    return h.hexdigest()[:16]


def _plain(value):
    """numpy's scalars as Python's (a tuned step count stays an int)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


def machine() -> str:
    """Where a figure was measured (minutes are this machine's)."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


class Kept:
    """One split's kept figures: `figures(name, key, fit)` returns the kept figures of
    `name` when they were measured under `key`, else calls `fit()` and keeps its figures.
    `reused` lists, in order, the models whose figures came from an earlier run."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.reused: list[dict] = []

    def _read(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("kept figures %s unreadable (%s): measuring again", path, e)
            return None

    def figures(self, name: str, key: dict, fit: Callable[[], dict]) -> dict:
        path, want = self.root / f"{name}.json", digest(key)
        kept = self._read(path)
        if kept is not None and kept.get("key") == want and isinstance(kept.get("figures"), dict):
            self.reused.append(
                {"model": name, "measured": kept.get("measured"), "machine": kept.get("machine")}
            )
            return kept["figures"]
        figures = fit()
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        record = {"key": want, "figures": figures, "measured": now, "machine": machine()}
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1, default=_plain))
        tmp.replace(path)
        return figures
