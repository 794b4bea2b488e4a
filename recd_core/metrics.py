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
