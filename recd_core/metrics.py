"""Model-quality metrics over predicted click probabilities (numpy, no Python loops)."""

from __future__ import annotations

import numpy as np

EPS = 1e-7


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U; ties get average ranks)."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, np.float64)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    first = np.concatenate([[True], s[1:] != s[:-1]])
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], s.size)
    avg_rank = (starts + ends + 1) / 2.0  # 1-based average rank of each tie group
    ranks = np.empty(s.size)
    ranks[order] = avg_rank[group]
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_losses(labels: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Each sample's log loss (probabilities clipped to [EPS, 1 - EPS])."""
    y = np.asarray(labels, np.float64)
    p = np.clip(np.asarray(probs, np.float64), EPS, 1 - EPS)
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    return float(np.mean(log_losses(labels, probs)))


def base_entropy(click_rate: float) -> float:
    """The log loss of always predicting the click rate: NE's denominator."""
    ctr = float(np.clip(click_rate, EPS, 1 - EPS))
    return float(-(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr)))


def normalized_entropy(labels: np.ndarray, probs: np.ndarray) -> float:
    """Log loss divided by the entropy of the base click rate (lower is better; 1 = no skill)."""
    return logloss(labels, probs) / base_entropy(float(np.mean(labels)))


def calibration(labels: np.ndarray, probs: np.ndarray) -> float:
    """Predicted clicks / observed clicks (1 = calibrated)."""
    observed = float(np.sum(labels))
    return float(np.sum(probs)) / observed if observed else float("nan")


def throughput_parts(samples, seconds, parts: int = 5) -> list[float]:
    """A run's throughput (samples/s) over `parts` consecutive pieces of its work (steps,
    splits): repeats of one measurement within the run, whose spread says how far the
    figure moves from one stretch of the run to the next (a neighbour's load, the cache)."""
    n = len(samples)
    bounds = np.linspace(0, n, min(parts, n) + 1).astype(int)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        took = float(np.sum(seconds[lo:hi]))
        if hi > lo and took > 0:
            out.append(float(np.sum(samples[lo:hi])) / took)
    return out


def ratio_band(ours: list[float], theirs: list[float]) -> tuple[float, float] | None:
    """The lowest and highest ratio of one run's parts to another's, part by part (`ours[i]
    / theirs[i]`): the band a ratio of the two runs' throughputs moves in. None with fewer
    than three parts a side (no spread to speak of)."""
    if not ours or not theirs or min(len(ours), len(theirs)) < 3:
        return None
    rs = [a / b for a, b in zip(ours, theirs, strict=False) if b > 0]
    return (min(rs), max(rs)) if len(rs) >= 3 else None
