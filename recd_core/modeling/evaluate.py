"""`recd evaluate`: score a day's samples with a trained model; NE, AUC, log loss, calibration.

The day is preprocessed exactly as the model's training day was (its transforms and
statistics, from model.json), in batches, deduplicated like training batches; the metrics
accumulate over batches (`StreamingMetrics`). Normally the day after training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from recd_core import metrics
from recd_core.warehouse import Warehouse


@dataclass
class StreamingMetrics:
    """Batch-by-batch accumulation. Log loss, NE and calibration need only running sums;
    AUC is exact, over the kept (label, score) pairs of the day."""

    labels: list[np.ndarray] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)
    n: int = 0
    clicks: float = 0.0
    predicted: float = 0.0
    loss_sum: float = 0.0

    def update(self, labels: np.ndarray, probs: np.ndarray) -> None:
        y = np.asarray(labels, np.float64)
        p = np.clip(np.asarray(probs, np.float64), metrics.EPS, 1 - metrics.EPS)
        self.n += y.size
        self.clicks += float(y.sum())
        self.predicted += float(p.sum())
        self.loss_sum += float(metrics.log_losses(y, p).sum())
        self.labels.append(y)
        self.probs.append(p)

    def result(self) -> dict[str, float]:
        if self.n == 0:
            raise ValueError("no samples were scored")
        entropy = metrics.base_entropy(self.clicks / self.n)
        logloss = self.loss_sum / self.n
        return {
            "eval.logloss": logloss,
            "eval.ne": logloss / entropy,
            "eval.auc": metrics.auc(np.concatenate(self.labels), np.concatenate(self.probs)),
            "eval.calibration": self.predicted / self.clicks if self.clicks else float("nan"),
            "eval.samples": self.n,
            "eval.ctr": self.clicks / self.n,
        }


def evaluate(warehouse: Warehouse, model_uri: str, ds: str, batch_size: int = 4096) -> dict:
    """Score `samples/layout=clustered/ds=D` with the model saved at `model_uri`."""
    from recd_core.modeling.saved import load_model

    t0 = time.perf_counter()
    model, meta = load_model(model_uri)
    out = score_day(warehouse, model, meta, ds, batch_size)
    return {**out, "eval.model_uri": model_uri, "eval.seconds": time.perf_counter() - t0}


def batch_logits(model, batches, device="cpu", raw: bool = False):
    """(labels, float logits on `device`) of each decoded batch, the model in eval mode
    while they are walked; `raw`: before the model's calibration."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                b = batch.to(device)
                yield batch.labels.numpy(), (model.raw_logit(b) if raw else model(b)).float()
    finally:
        model.train(was_training)


def score_batches(model, batches, device="cpu") -> dict[str, float]:
    """The metrics of a model (in eval mode for the call) over decoded batches: a day being
    evaluated, or training's validation batches."""
    import torch

    acc = StreamingMetrics()
    for labels, logits in batch_logits(model, batches, device):
        acc.update(labels, torch.sigmoid(logits).cpu().numpy())
    return acc.result()


def score_day(warehouse: Warehouse, model, meta: dict, ds: str, batch_size: int = 4096) -> dict:
    """NE, AUC, log loss and calibration of a loaded model on a day's samples."""
    from recd_core.modeling.saved import batches_of

    t0 = time.perf_counter()
    table = warehouse.read("samples", ds, layout="clustered")
    return {
        **score_batches(model, batches_of(meta, table, batch_size)),
        "eval.ds": ds,
        "eval.trained_on": meta["summary"].get("train.run"),
        "eval.seconds": time.perf_counter() - t0,
    }
