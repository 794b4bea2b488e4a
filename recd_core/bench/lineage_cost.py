"""What lineage costs: the checks and pins each stage runs before it reads, timed on the
bench's day against the stage's own time (docs/benchmarks.md, "Lineage checks").

The checks are measured themselves (medians of repeats) rather than as the difference of
two stage runs, which the run-to-run noise (a few percent) would swallow."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from recd_core.lineage import logs_digest, require_fresh
from recd_core.warehouse import Warehouse

# (stage, the table it reads, its keys)
READS = (
    ("generate", "events", {}),
    ("preprocess", "samples", {"layout": "clustered"}),
    ("train", "batches", {"mode": "dedup"}),
)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def lineage_costs(
    wh: Warehouse, ds: str, logs: Path, stage_seconds: dict[str, float], repeats: int = 20
) -> dict:
    """Per stage: the freshness check of its input (walking the lineage up to the raw logs)
    and the pin (manifest once, hard links, the reader's lock) in ms, and their share of the
    stage's seconds (`stage_seconds`); ingest: the digest of the day's logs."""
    out: dict = {}
    for stage, table, keys in READS:
        name = wh.partition_name(table, ds, **keys)

        def pin(table=table, keys=keys):
            with wh.pinned(table, ds, **keys):
                pass

        check = _median_ms(lambda name=name, stage=stage: require_fresh(wh, stage, [name]), repeats)
        pinned = _median_ms(pin, repeats)
        out[f"lineage.check_ms.{stage}"] = check
        out[f"lineage.pin_ms.{stage}"] = pinned
        if stage_seconds.get(stage):
            out[f"lineage.share.{stage}"] = (check + pinned) / 1000 / stage_seconds[stage]
    out["lineage.check_ms.ingest"] = _median_ms(lambda: logs_digest(logs), repeats)
    if stage_seconds.get("ingest"):
        out["lineage.share.ingest"] = (
            out["lineage.check_ms.ingest"] / 1000 / stage_seconds["ingest"]
        )
    out["lineage.stage_seconds"] = stage_seconds
    return out


def lineage_markdown(r: dict) -> list[str]:
    if "lineage.check_ms.ingest" not in r:
        return []
    rows = [
        "",
        "| lineage, before a stage reads (medians of 20) | check | pin | the stage | share |",
        "|---|---|---|---|---|",
    ]
    secs = r.get("lineage.stage_seconds", {})
    for stage in ("ingest", "generate", "preprocess", "train"):
        check = r.get(f"lineage.check_ms.{stage}")
        if check is None:
            continue
        pin = r.get(f"lineage.pin_ms.{stage}")
        share = r.get(f"lineage.share.{stage}")
        rows.append(
            f"| {stage} | {check:.2f} ms | {'-' if pin is None else f'{pin:.2f} ms'} | "
            f"{'-' if stage not in secs else f'{secs[stage]:.2f} s'} | "
            f"{'-' if share is None else f'{share:.2%}'} |"
        )
    return rows
