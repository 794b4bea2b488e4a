"""Dedup vs baseline, side by side: the table `recd run --mode both` and `recd compare`
print, the chart they log to MLflow, and the quality gate `recd compare` enforces.

Both arms train on the same day's samples and are evaluated on the same next day, so the
only differences are the layout (clustered vs shuffled), DPP (IKJT vs KJT) and the
training path: the throughput columns should differ, the model-quality rows should not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from recd_core.metrics import ratio_band


@dataclass(frozen=True)
class Row:
    label: str
    key: str
    higher_is_better: bool | None  # None: a quality figure, expected equal


ROWS = (
    Row("storage (MiB)", "storage.bytes", False),
    Row("DPP samples/s", "dpp.samples_per_s", True),
    Row("train samples/s", "train.samples_per_s", True),
    Row("next-day NE", "eval.ne", None),
    Row("next-day AUC", "eval.auc", None),
    Row("next-day calibration", "eval.calibration", None),
)
# Peak memory is not compared here: both arms run in one process, whose high-water mark
# covers both; `recd bench` measures each arm in its own process.
MIB = ("storage.bytes",)


def ratios(summary: dict) -> dict[str, float]:
    """Dedup over baseline from a two-arm summary (`<key>.dedup`, `<key>.baseline`): storage
    (baseline bytes / dedup bytes), DPP and training throughput, and the quality gaps; with
    each arm's throughput over its run's parts (`*.parts_samples_per_s`), the band a
    throughput ratio moves in (`compare.<stage>_speedup_low` / `_high`)."""

    def arm(key: str, mode: str) -> float:
        return summary[f"{key}.{mode}"]

    bands = {}
    for stage in ("dpp", "train"):  # the throughput ratio over the runs' parts (its noise)
        band = ratio_band(
            summary.get(f"{stage}.parts_samples_per_s.dedup") or [],
            summary.get(f"{stage}.parts_samples_per_s.baseline") or [],
        )
        if band is not None:
            bands[f"compare.{stage}_speedup_low"], bands[f"compare.{stage}_speedup_high"] = band
    return {
        **bands,
        "storage.ratio": arm("storage.bytes", "baseline") / arm("storage.bytes", "dedup"),
        "dpp.speedup": arm("dpp.samples_per_s", "dedup") / arm("dpp.samples_per_s", "baseline"),
        "train.speedup": arm("train.samples_per_s", "dedup")
        / arm("train.samples_per_s", "baseline"),
        "eval.ne_gap": arm("eval.ne", "dedup") - arm("eval.ne", "baseline"),
        "eval.auc_gap": arm("eval.auc", "dedup") - arm("eval.auc", "baseline"),
    }


def table_rows(summary: dict) -> list[tuple[str, float, float, str]]:
    """(label, dedup, baseline, dedup's advantage) per row, from a two-arm run summary."""
    out, r = [], ratios(summary)
    for row in ROWS:
        d, b = summary[f"{row.key}.dedup"], summary[f"{row.key}.baseline"]
        if row.key in MIB:
            d, b = d / 2**20, b / 2**20
        if row.higher_is_better is None:
            gain = f"{d - b:+.4f}"
        else:
            ratio = d / b if row.higher_is_better else b / d
            gain = f"{ratio:.2f}x"
            stage = row.key.split(".")[0]
            low, high = (
                r.get(f"compare.{stage}_speedup_low"),
                r.get(f"compare.{stage}_speedup_high"),
            )
            if low is not None:  # how far it moves over the runs' parts; ~ when that spans 1x
                gain += f" ({low:.2f}-{high:.2f}{', noise' if low <= 1 <= high else ''})"
        out.append((row.label, d, b, gain))
    return out


def _cells(summary: dict) -> list[tuple[str, str, str, str]]:
    """`table_rows` as the table shows them: small figures to four decimals, the rest to one."""
    out = []
    for label, d, b, gain in table_rows(summary):
        fmt = "{:,.4f}" if abs(d) < 10 else "{:,.1f}"
        out.append((label, fmt.format(d), fmt.format(b), gain))
    return out


def print_table(summary: dict, console) -> None:

    t = Table(
        title=f"dedup vs baseline, trained {summary['run.ds']}, scored {summary['run.eval_ds']}"
    )
    for col in ("", "dedup", "baseline", "dedup gain"):
        t.add_column(col, justify="left" if not col else "right")
    for cells in _cells(summary):
        t.add_row(*cells)
    console.print(t)


def markdown(summary: dict) -> str:
    """The table of `print_table` as Markdown (a Kubeflow visualization, an MLflow note):
    NE and AUC to four decimals, so a gap the quality gate cares about shows."""
    lines = [
        f"### dedup vs baseline, trained {summary['run.ds']}, scored {summary['run.eval_ds']}",
        "",
        "| | dedup | baseline | dedup gain |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {' | '.join(cells)} |" for cells in _cells(summary)]
    return "\n".join(lines) + "\n"


def chart(summary: dict, path: Path) -> Path:
    """One PNG: the throughput and storage ratios as bars, NE and AUC of both arms side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    r = ratios(summary)
    bars_of = {
        "storage\n(shuffled / clustered)": r["storage.ratio"],
        "DPP\nsamples/s": r["dpp.speedup"],
        "training\nsamples/s": r["train.speedup"],
    }
    bars = left.bar(list(bars_of), list(bars_of.values()), color="#3b7dd8")
    left.bar_label(bars, fmt="%.2fx")
    left.set_ylim(0, max(bars_of.values()) * 1.18)  # room for the labels above the bars
    left.tick_params(axis="x", labelsize=9)
    left.axhline(1.0, color="grey", lw=1, ls="--")
    left.set_title("dedup / baseline (higher is better)")
    width = 0.35
    names = ["NE", "AUC"]
    for i, (arm, colour) in enumerate((("dedup", "#3b7dd8"), ("baseline", "#aaaaaa"))):
        vals = [summary[f"eval.ne.{arm}"], summary[f"eval.auc.{arm}"]]
        b = right.bar(
            [x + (i - 0.5) * width for x in range(2)], vals, width, label=arm, color=colour
        )
        right.bar_label(b, fmt="%.4f", fontsize=9)  # 4 decimals: the gap the gate judges shows
    right.set_xticks(range(2), names)
    right.set_title(f"next-day quality ({summary['run.eval_ds']})")
    top = max(summary[f"eval.{m}.{a}"] for m in ("ne", "auc") for a in ("dedup", "baseline"))
    right.set_ylim(0, top * 1.3)  # the legend sits above the bars, never on them
    right.legend(loc="upper center", ncol=2, frameon=False)
    fig.suptitle(f"recd: dedup vs baseline, {summary['run.ds']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def quality_gap(summary: dict, ne_tol: float, auc_tol: float) -> str | None:
    """None when the arms' NE and AUC agree within tolerance; else the one-line reason."""
    ne = abs(summary["eval.ne.dedup"] - summary["eval.ne.baseline"])
    auc = abs(summary["eval.auc.dedup"] - summary["eval.auc.baseline"])
    problems = []
    if not ne <= ne_tol:
        problems.append(f"NE differs by {ne:.4f} (tolerance {ne_tol})")
    if not auc <= auc_tol:
        problems.append(f"AUC differs by {auc:.4f} (tolerance {auc_tol})")
    if not problems:
        return None
    return "dedup and baseline models differ in quality: " + "; ".join(problems)
