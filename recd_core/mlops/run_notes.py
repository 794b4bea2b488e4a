"""What a run's page says first (its description, `mlflow.note.content`): a daily run's
outcome, a comparison's verdict with its table, each ratio worded by the way it goes."""

from __future__ import annotations

import os

from recd_core.mlops import compare


def load_1m() -> str:
    """The 1-minute load average (above the CPUs: a busy neighbour shares them)."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "nan"


def daily_outcome(summary: dict) -> str | None:
    """A daily run's answer as its parent run's description: the next-day NE and AUC
    against the oracle's, and the registry's decision and why. None without an evaluation."""
    if not isinstance(summary.get("eval.ne"), int | float):
        return None
    day = summary.get("run.eval_ds") or summary.get("eval.ds") or "the next day"
    line = f"Next-day NE **{summary['eval.ne']:.4f}**"
    if isinstance(summary.get("eval.auc"), int | float):
        line += f", AUC {summary['eval.auc']:.4f}"
    if isinstance(summary.get("eval.oracle_ne"), int | float):
        line += f" (the oracle: NE {summary['eval.oracle_ne']:.4f})"
    line += f" on {day}."
    if summary.get("registry.version"):
        line += (
            f" {summary.get('registry.model', 'the model')} v{summary['registry.version']}: "
            f"{summary.get('registry.decision', '')}"
        )
        if summary.get("registry.reason"):
            line += f" ({summary['registry.reason']})"
        line += "."
    return line


def by_direction(
    ratio: float, gain: str, loss: str, band: tuple[float, float] | None = None
) -> str:
    """A baseline/dedup ratio in words that say which way it goes: 3.08 -> "3.08x smaller
    with dedup", 0.82 -> "1.22x slower with dedup" (never "0.82x faster"); with `band` (the
    ratio over the runs' parts), how far it moves, and when that straddles 1x, that the
    ratio is inside its run-to-run noise: no claim either way."""
    if ratio <= 0:
        return f"not measured ({ratio})"
    said = (
        f"**{ratio:.2f}x {gain}** with dedup"
        if ratio >= 1
        else f"**{1 / ratio:.2f}x {loss}** with dedup"
    )
    if band is None:
        return said
    low, high = band
    spread = f"{low:.2f}x-{high:.2f}x over the runs' parts"
    if low <= 1 <= high:
        return f"{said} (inside its run-to-run noise, {spread}: no difference shown)"
    return f"{said} ({spread})"


def comparison_note(summary: dict) -> str:
    """The comparison run's description (the run page's Description): the verdict in one
    line, the side-by-side table, where the chart is, and what the figures were measured
    under."""

    try:
        r = compare.ratios(summary)
        table = compare.markdown(summary)
    except (KeyError, ZeroDivisionError, TypeError):
        return "dedup vs baseline: the arms' figures are incomplete (see summary.json)"
    ok = summary.get("compare.quality_ok", True)
    verdict = (
        f"**{'Dedup matches' if ok else 'Dedup does NOT match'} the baseline's quality** "
        f"(next-day NE dedup − baseline {r['eval.ne_gap']:+.4f}, AUC {r['eval.auc_gap']:+.4f}) "
        f"; storage {by_direction(r['storage.ratio'], 'smaller', 'larger')}, DPP "
        f"{by_direction(r['dpp.speedup'], 'faster', 'slower', _band(r, 'dpp'))}, training "
        f"{by_direction(r['train.speedup'], 'faster', 'slower', _band(r, 'train'))}."
    )
    where = (
        f"Measured on {os.cpu_count()} CPUs, load {load_1m()} at the end (a load above the CPUs "
        "means a busy neighbour: the throughput ratios move with it). The chart: "
        "Artifacts → the comparison PNG; every stage's figures: its child run."
    )
    return f"{verdict}\n\n{table}\n{where}\n"


def _band(ratios: dict, stage: str) -> tuple[float, float] | None:
    low, high = (
        ratios.get(f"compare.{stage}_speedup_low"),
        ratios.get(f"compare.{stage}_speedup_high"),
    )
    return None if low is None or high is None else (low, high)
