"""How the stages scale with the day's size: wall time, samples/s and peak RSS of each stage
run as its own `recd` process (as the orchestrators run them), at several day sizes of the
standard workload. `python -m recd_core.bench.scaling` (`make bench-scaling`) writes
`build/bench/scaling.md`.

Peak RSS is the process's own (`wait4`'s `ru_maxrss`), so each figure is one stage's memory.

`dpp` (a stage name of its own, after `generate`): DPP's dedup vs baseline at each size,
`recd preprocess --mode dedup|baseline` as processes, interleaved, `--repeats` each; the
medians of the stage's own time (`dpp.seconds`) and of the process's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from recd_core.runtime import owned_child

DAY = "2026-11-01"
STAGES = ("synth", "ingest", "generate", "preprocess", "train")
EXTRA = ("dpp",)  # not in the default run: the dedup-vs-baseline DPP ratio per size


def _commands(n: int, root: Path) -> dict[str, list[str]]:
    logs, wh = root / "logs", root / "wh"
    return {
        "synth": [
            "synth",
            "--logs",
            logs,
            "--ds",
            DAY,
            "--preset",
            "standard",
            "--samples-per-day",
            n,
        ],
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
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **owned_child())
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return {
        "seconds": seconds,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "summary": json.loads(summary.read_text()),
    }


def dpp_ratio(root: Path, n: int, repeats: int) -> dict:
    """DPP dedup vs baseline on this size's samples: processes, interleaved, medians."""

    wh = root / "wh"
    runs: dict[str, list[dict]] = {"dedup": [], "baseline": []}
    for i in range(repeats):
        for mode in runs:
            args = ["preprocess", "--warehouse", wh, "--ds", DAY, "--mode", mode]
            runs[mode].append(run_stage(args, root / f"dpp-{mode}-{i}.json"))
    med = {m: statistics.median(r["summary"]["dpp.seconds"] for r in v) for m, v in runs.items()}
    wall = {m: statistics.median(r["seconds"] for r in v) for m, v in runs.items()}
    out = {
        "samples_per_day": n,
        "repeats": repeats,
        "seconds": med,
        "wall_seconds": wall,
        "speedup": med["baseline"] / med["dedup"],
        "wall_speedup": wall["baseline"] / wall["dedup"],
    }
    print(
        f"{n:>9,} dpp        dedup {med['dedup']:.2f} s, baseline {med['baseline']:.2f} s: "
        f"{out['speedup']:.2f}x ({out['wall_speedup']:.2f}x wall)",
        flush=True,
    )
    return out


def scaling(
    sizes: list[int], stages: tuple[str, ...], work: Path, repeats: int = 3
) -> tuple[list[dict], list[dict]]:
    rows, dpp = [], []
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
            print(
                f"{n:>9,} {stage:<10} {r['seconds']:7.1f} s  "
                f"{r['peak_rss_bytes'] / 2**30:5.2f} GiB",
                flush=True,
            )
            if stage == "generate" and "dpp" in stages:
                dpp.append(dpp_ratio(root, n, repeats))
        shutil.rmtree(root / "logs", ignore_errors=True)
        shutil.rmtree(root / "wh", ignore_errors=True)
    return rows, dpp


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


def dpp_markdown(dpp: list[dict]) -> str:
    out = [
        "| samples/day | DPP dedup s | baseline s | dedup / baseline | wall (processes) |",
        "|---|---|---|---|---|",
    ]
    for d in dpp:
        out.append(
            f"| {d['samples_per_day']:,} | {d['seconds']['dedup']:.2f} | "
            f"{d['seconds']['baseline']:.2f} | **{d['speedup']:.2f}x** | {d['wall_speedup']:.2f}x |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default="200000,1000000,2000000", help="samples per day, comma-separated"
    )
    p.add_argument("--stages", default=",".join(STAGES), help=f"of {', '.join(STAGES + EXTRA)}")
    p.add_argument("--repeats", type=int, default=3, help="DPP ratio repeats per mode")
    p.add_argument("--out", type=Path, default=Path("build/bench"))
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    stages = tuple(args.stages.split(","))
    rows, dpp = scaling(sizes, stages, args.out / "scaling-work", args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows) + (f"\n{dpp_markdown(dpp)}" if dpp else "")
    (args.out / "scaling.md").write_text(text)
    (args.out / "scaling.json").write_text(
        json.dumps({"stages": rows, "dpp": dpp}, indent=1, default=str)
    )
    print(text)


if __name__ == "__main__":
    main()
