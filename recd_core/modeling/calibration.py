"""Calibration on the latest data: a slope and an offset of the trained model's logit.

Why: a model's scores are read as probabilities (bids, thresholds, NE), and the click rate
moves. Training holds out the day's latest rows for validation and never trains on them;
a model stopped on them still predicts the click rate of the older rows it trained on (on
MovieLens split by time the rate falls from the earlier ratings to the latest ones, and an
uncalibrated model over-predicts clicks: docs/journal.md). Platt scaling (Platt 1999), fitted after training, as production CTR
systems calibrate their scores on recent data:

    calibrated logit = slope * logit + offset       (two numbers, kept in the model)

The fit is a two-parameter logistic regression of the validation labels on the model's
logits, by Newton's method in float64, with Platt's smoothed targets (a click counts as
(n+ + 1) / (n+ + 2), a non-click as 1 / (n- + 2)) so a small slice the model happens to
separate gets a finite slope. A slope at or below zero (a model that ranks the
slice no better than chance) is not kept: the offset alone is fitted then, so a
calibration never reverses a model's ranking. A slice with one class teaches nothing:
the identity is kept, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recd_core import metrics
from recd_core.modeling.evaluate import batch_logits


@dataclass(frozen=True)
class Calibration:
    slope: float = 1.0
    offset: float = 0.0
    reason: str = "fitted on the validation slice"

    def apply(self, logits: np.ndarray) -> np.ndarray:
        return self.slope * logits + self.offset


def _newton(x: np.ndarray, y: np.ndarray, offset=0.0, iters: int = 100) -> np.ndarray | None:
    """Maximum-likelihood weights w of a logistic regression of `y` on `offset + x @ w` (no
    penalty but a 1e-9 ridge that keeps the Hessian invertible); None if it diverges."""
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(offset + x @ w, -40, 40)))
        hessian = (x * (p * (1 - p))[:, None]).T @ x + 1e-9 * np.eye(x.shape[1])
        step = np.linalg.solve(hessian, x.T @ (p - y))
        w -= step
        if not np.all(np.isfinite(w)):
            return None
        if np.abs(step).max() < 1e-10:
            break
    return w


def fit_calibration(logits: np.ndarray, labels: np.ndarray) -> Calibration:
    """The slope and offset that make `sigmoid(slope * logits + offset)` fit `labels` best
    (log likelihood); the identity where the labels cannot say."""
    z = np.asarray(logits, np.float64)
    y = np.asarray(labels, np.float64)
    if y.size == 0 or y.min() == y.max():
        return Calibration(reason="not calibrated: the validation slice has one class")
    # Platt's targets: (clicks + 1) / (clicks + 2) and 1 / (non-clicks + 2) instead of 1
    # and 0, so a slice the model separates perfectly gets a finite slope
    positives = y.sum()
    target = np.where(y > 0, (positives + 1) / (positives + 2), 1 / (y.size - positives + 2))
    ones = np.ones((z.size, 1))
    w = _newton(np.hstack([z[:, None], ones]), target)
    if w is not None and w[0] > 0:
        return Calibration(float(w[0]), float(w[1]))
    if w is not None:  # the offset alone, the logit entering as it is
        b = _newton(ones, target, offset=z)
        if b is not None:
            return Calibration(
                1.0, float(b[0]), "offset only: the slice ranks no better than chance"
            )
    return Calibration(reason="not calibrated: the fit did not converge")


def calibrate(model, batches, device) -> dict:
    """Fit the model's calibration on `batches` (the validation slice) and set it; the
    summary's record of it, with the slice's NE before and after."""
    labels, logits = [np.zeros(0)], [np.zeros(0)]
    for y, z in batch_logits(model, batches, device, raw=True):
        labels.append(y)
        logits.append(z.cpu().numpy())
    y, z = (np.concatenate(parts).astype(np.float64) for parts in (labels, logits))
    fit = fit_calibration(z, y)
    model.set_calibration(fit.slope, fit.offset)
    out = {
        "train.calibration_slope": fit.slope,
        "train.calibration_offset": fit.offset,
        "train.calibration_reason": fit.reason,
    }
    if y.size and y.min() != y.max():
        before, after = (1.0 / (1.0 + np.exp(-v)) for v in (z, fit.apply(z)))
        out["train.val_ne_uncalibrated"] = metrics.normalized_entropy(y, before)
        out["train.val_ne_calibrated"] = metrics.normalized_entropy(y, after)
    return out
