"""Many small files against one: `recd ingest` of the same lines as N one-line files and as
one file, interleaved, medians (what a logger that writes a file per event, or per flush,
leaves). Small files are read several to a text (`ingest.parse_units`)."""

from __future__ import annotations

import gzip
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from recd_core.orchestration.stages import run_stage


def small_files_figures(logs_day: Path, ds: str, files: int = 4_000, repeats: int = 3) -> dict:
    """`bench.small_files.*`: seconds to ingest `files` one-line files and the same lines as
    one file (medians of `repeats`, interleaved), and the events files each published."""
    lines: list[bytes] = []
    for f in sorted(Path(logs_day).glob("*.jsonl.gz")):
        lines += gzip.decompress(f.read_bytes()).splitlines()
        if len(lines) >= files:
            break
    lines = lines[:files]
    with tempfile.TemporaryDirectory(prefix="recd-bench-files-") as tmp:
        many, one = Path(tmp) / "many", Path(tmp) / "one"
        many.mkdir()
        one.mkdir()
        for k, line in enumerate(lines):
            (many / f"event-{k:06d}.jsonl").write_bytes(line + b"\n")
        (one / "events.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        seconds: dict[str, list[float]] = {"many": [], "one": []}
        events_files = {}
        for _ in range(repeats):
            for name, src in (("many", many), ("one", one)):
                wh = Path(tmp) / f"wh-{name}"
                shutil.rmtree(wh, ignore_errors=True)
                t0 = time.perf_counter()
                s = run_stage("ingest", {"warehouse": str(wh), "ds": ds, "source": str(src)})
                seconds[name].append(time.perf_counter() - t0)
                assert s["ingest.rows_ok"] == len(lines), s
                events_files[name] = len(list((wh / "events" / f"ds={ds}").glob("*.parquet")))
    many_s, one_s = float(np.median(seconds["many"])), float(np.median(seconds["one"]))
    return {
        "bench.small_files.files": len(lines),
        "bench.small_files.seconds_many": many_s,
        "bench.small_files.seconds_one": one_s,
        "bench.small_files.ratio": many_s / one_s,
        "bench.small_files.events_files_many": events_files["many"],
        "bench.small_files.events_files_one": events_files["one"],
    }
