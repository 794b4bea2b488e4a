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
from recd_core.errors import BadInput
from recd_core.lineage import require_fresh, staleness
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


class EvaluationLeak(BadInput):
    """The evaluation day is one the model trained on, or not after its last training day:
    its figures would be in-sample, not what tomorrow's traffic meets."""


def evaluate(
    warehouse: Warehouse,
    model_uri: str,
    ds: str,
    batch_size: int = 4096,
    trained_on: str | None = None,
) -> dict:
    """Score `samples/layout=clustered/ds=D` with the model saved at `model_uri`. Refused
    (exit 2, one line): a day not after the model's last training day (its warm starts'
    included); a `trained_on` day the model did not train on; stale samples (lineage.py).
    A model whose batches were rebuilt since it trained is scored, and `eval.model_lineage`
    says so."""
    from recd_core.modeling.saved import load_model
    from recd_core.modeling.warm_start import trained_days

    t0 = time.perf_counter()
    model, meta = load_model(model_uri)
    days = trained_days(meta)
    if trained_on is not None and days and trained_on not in days:
        raise EvaluationLeak(
            f"evaluate: {model_uri} was not trained on --ds {trained_on} "
            f"(it trained on {_span(days)}): name the model of that day"
        )
    if days and ds <= days[-1]:
        raise EvaluationLeak(
            f"evaluate: {model_uri} trained on {_span(days)}; scoring it on {ds}, not after "
            f"its last training day, would score rows it learned from: give an --eval-ds "
            f"after {days[-1]}"
        )
    # a saved model is an artifact of its own: scored whatever became of its training
    # batches since, and the summary says whether they were rebuilt (`recd status` too)
    state = "fresh"
    lineage = meta.get("lineage")
    if lineage and model_uri.startswith(warehouse.uri.rstrip("/") + "/models/"):
        found = staleness(warehouse, f"models/{model_uri.rsplit('/models/', 1)[1]}", lineage)
        state = found.line() if found else state
    elif not lineage:
        state = "unknown (no lineage recorded)"
    out = score_day(warehouse, model, meta, ds, batch_size)
    return {
        **out,
        "eval.model_uri": model_uri,
        "eval.seconds": time.perf_counter() - t0,
        "eval.trained_days": _span(days),
        "eval.model_lineage": state,
    }


def _span(days: list[str]) -> str:
    return days[0] if len(days) == 1 else f"{days[0]}..{days[-1]} ({len(days)} days)"


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
    name = warehouse.partition_name("samples", ds, layout="clustered")
    with warehouse.pinned("samples", ds, layout="clustered"):
        inputs = require_fresh(warehouse, "evaluate", [name])
        table = warehouse.read("samples", ds, layout="clustered")
    return {
        "eval.inputs": inputs,
        **score_batches(model, batches_of(meta, table, batch_size)),
        "eval.ds": ds,
        "eval.trained_on": meta["summary"].get("train.run"),
        "eval.seconds": time.perf_counter() - t0,
    }
