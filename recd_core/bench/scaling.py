"""How the stages scale with the day's size: wall time, samples/s and peak RSS of each stage
run as its own `recd` process (as the orchestrators run them), at several day sizes of the
standard workload. `python -m recd_core.bench.scaling` (`make bench-scaling`) writes
`build/bench/scaling.md`.

Peak RSS is the process's own (`wait4`'s `ru_maxrss`), so each figure is one stage's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DAY = "2026-11-01"
STAGES = ("synth", "ingest", "generate", "preprocess", "train")


def _commands(n: int, root: Path) -> dict[str, list[str]]:
    logs, wh = root / "logs", root / "wh"
    return {
        "synth": ["synth", "--out", logs, "--preset", "standard", "--samples-per-day", n],
        "ingest": ["ingest", "--source", logs / f"ds={DAY}", "--warehouse", wh, "--ds", DAY],
        "generate": ["generate", "--warehouse", wh, "--ds", DAY, "--layout", "both"],
        "preprocess": ["preprocess", "--warehouse", wh, "--ds", DAY],
        "train": ["train", "--warehouse", wh, "--ds", DAY, "--epochs", "1"],
    }


def run_stage(args: list, summary: Path) -> dict:
    """Run `recd ARGS --summary S` as a child process; its wall time, peak RSS and summary."""
    recd = str(Path(sys.executable).with_name("recd"))
    cmd = [recd, *map(str, args), "--summary", str(summary)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return {"seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "summary": json.loads(summary.read_text())}  # fmt: skip


def scaling(sizes: list[int], stages: tuple[str, ...], work: Path) -> list[dict]:
    rows = []
    for n in sizes:
        root = work / f"n{n}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        commands = _commands(n, root)
        samples = None
        for stage in STAGES:
            if stage not in stages:
                continue
            r = run_stage(commands[stage], root / f"{stage}.json")
            s = r["summary"]
            samples = s.get("synth.rows") or s.get("ingest.rows_in") or samples
            rows.append({"samples_per_day": n, "stage": stage, "samples": samples, **r})
            print(f"{n:>9,} {stage:<10} {r['seconds']:7.1f} s  "
                  f"{r['peak_rss_bytes'] / 2**30:5.2f} GiB", flush=True)  # fmt: skip
        shutil.rmtree(root / "logs", ignore_errors=True)
        shutil.rmtree(root / "wh", ignore_errors=True)
    return rows


def markdown(rows: list[dict]) -> str:
    out = [
        "| samples/day | stage | wall s | samples/s | µs per sample | peak RSS GiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = r["seconds"] / r["samples"] if r["samples"] else 0.0
        out.append(
            f"| {r['samples_per_day']:,} | {r['stage']} | {r['seconds']:.1f} | "
            f"{r['samples'] / r['seconds']:,.0f} | {per * 1e6:.1f} | "
            f"{r['peak_rss_bytes'] / 2**30:.2f} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="200000,1000000,2000000",
                   help="samples per day, comma-separated")  # fmt: skip
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--out", type=Path, default=Path("build/bench"))
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    stages = tuple(args.stages.split(","))
    rows = scaling(sizes, stages, args.out / "scaling-work")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.md").write_text(markdown(rows))
    (args.out / "scaling.json").write_text(json.dumps(rows, indent=1, default=str))
    print(markdown(rows))


if __name__ == "__main__":
    main()
