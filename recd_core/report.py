"""Human output at the edges: progress bars, summary tables and the `--summary` JSON."""

from __future__ import annotations

import contextlib
import io
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.fs as pafs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from recd_core.leftovers import write_atomically

console = Console(stderr=True)  # progress and notes
answer = Console()  # what a command answers: its summary, a verdict (standard output)


@contextlib.contextmanager
def progress(description: str, total: int | None) -> Iterator[Callable[[str, int], None]]:
    """A progress bar on a terminal; elsewhere (a task log, a pod's log, a pipe) a line on
    stdout at least every `LINE_EVERY_S` seconds while the work runs, whether or not it
    advances (a quiet stretch reads as a hang). Yields `advance(label, n)`."""
    if not console.is_terminal:
        lines = _ProgressLines(description, total)
        with lines.beating():
            yield lines.advance
        return
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[label]}"),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=total, label="")

        def advance(label: str, n: int = 1) -> None:
            bar.update(task, advance=n, label=label)

        yield advance


LINE_EVERY_S = 30.0


class _ProgressLines:
    """Progress as lines: one when work advances and `LINE_EVERY_S` has passed since the
    last, and one from a heartbeat thread when nothing advanced for that long."""

    def __init__(self, description: str, total: int | None):
        self.description, self.total = description, total
        self.start = self.last = time.monotonic()
        self.done, self.label = 0, ""
        self.lock = threading.Lock()

    def advance(self, label: str, n: int = 1) -> None:
        with self.lock:
            self.done += n
            self.label = label
            if time.monotonic() - self.last >= LINE_EVERY_S:
                self._say()

    def _say(self) -> None:
        now = time.monotonic()
        self.last = now
        of = f"/{self.total:,}" if self.total else ""
        what = f"{self.done:,}{of} done" if self.done else "working"
        label = f" ({self.label})" if self.label else ""
        print(f"{self.description}: {what}, {now - self.start:,.0f} s{label}", flush=True)

    @contextlib.contextmanager
    def beating(self) -> Iterator[None]:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(min(1.0, LINE_EVERY_S)):
                with self.lock:
                    if time.monotonic() - self.last >= LINE_EVERY_S:
                        self._say()

        thread = threading.Thread(target=beat, name="recd-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _fmt(key: str, value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        if key.endswith(("bytes", "bytes_gz", "bytes_in", "lower_bound_bytes", "events_bytes")):
            return f"{human_bytes(value)} ({value:,})"
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if key.endswith("fraction"):
            return f"{value:.2%}"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return ", ".join(_fmt(key, v) for v in value)
    return str(value)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def summary_table(title: str, summary: dict, skip_prefixes: tuple[str, ...] = ()) -> Table:
    """A summary as a two-column table: its keys, in order, and their values formatted."""
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="cyan", no_wrap=True)
    table.add_column(overflow="fold")  # a path whole, folded onto the next line, never cut
    for key, value in summary.items():
        # nested sections (per-layout or per-workload figures) stay in the JSON summary
        if key.startswith(skip_prefixes) or (isinstance(value, dict) and "." not in key):
            continue
        if ".history" in key:  # curves: MLflow plots them (metric history)
            continue
        table.add_row(key, _fmt(key, value))
    return table


def print_summary(title: str, summary: dict, skip_prefixes: tuple[str, ...] = ()) -> None:
    answer.print(summary_table(title, summary, skip_prefixes))
    answer.file.flush()


def summary_text(title: str, summary: dict, width: int = 110) -> str:
    """The summary table as plain text, for one log record: a task log shows it as one block
    where it was logged (printed lines reach a task log through a pipe, timestamped on
    arrival: after the task's own last lines, inside the group Airflow folds away)."""
    out = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    out.print(summary_table(title, summary))
    return out.export_text().rstrip()


def write_summary(path: str | Path | None, summary: dict) -> None:
    """The summary as JSON at `path`: a local path, or a URI of a filesystem Arrow opens
    (`s3://…`: a TrainJob's rank 0 writes its summary into the warehouse)."""
    if path is None:
        return
    text = json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
    if "://" in str(path):
        fs, where = pafs.FileSystem.from_uri(str(path))
        fs.create_dir(where.rsplit("/", 1)[0], recursive=True)
        write_atomically(fs, where, text.encode())
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def read_summary(path: str) -> dict | None:
    """A summary `write_summary` wrote at `path` (a local path or a URI), or None."""

    fs, where = (
        pafs.FileSystem.from_uri(str(path))
        if "://" in str(path)
        else (pafs.LocalFileSystem(), str(Path(path).absolute()))
    )
    try:
        with fs.open_input_stream(where) as f:
            return json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def print_decision(result: dict) -> None:
    """The registry's decision of a run (`recd run`, `recd compare`), in one line."""
    if "registry.version" not in result:
        console.print("model registry: off (no tracking URI)")
        return
    champ = result["registry.champion_ne"]
    console.print(
        f"{result['registry.model']} v{result['registry.version']}: {result['registry.decision']}"
        f" (challenger NE {result['registry.challenger_ne']:.4f}"
        + (f" vs champion NE {champ:.4f}" if champ is not None else ", no champion compared")
        + f" on {result['run.eval_ds']})"
        + (f": {result['registry.reason']}" if result.get("registry.reason") else "")
    )
