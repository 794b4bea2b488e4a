"""One optimizer step, and the losses it takes: the click loss (binary cross-entropy on the
raw logit) plus `cooccurrence_weight` times the user lists' co-occurrence loss
(modeling/cooccurrence.py), the same in both modes. Embedding tables train with row-wise
Adagrad on sparse gradients (modeling/optim.py), everything else with Adam.

`fold_in` is the one pass of the tables over the validation slice after training chose its
state (modeling/train.py's docstring says why)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn import functional as F

from recd_core.config import TrainConfig
from recd_core.dpp.batch_store import BatchStore
from recd_core.modeling.cooccurrence import cooccurrence_loss
from recd_core.modeling.model import Model
from recd_core.modeling.optim import RowWiseAdagrad


def make_optimizers(model: Model, cfg: TrainConfig, warm: bool = False):
    """(`dense_optimizer`, `table_optimizer`): a single-process model's optimizers."""
    return dense_optimizer(model, cfg, warm), table_optimizer(model, cfg)


def dense_optimizer(model: Model, cfg: TrainConfig, warm: bool = False) -> torch.optim.Adam:
    """Adam for the dense layers (at `lr_dense_warm` on a warm start: layers that already
    fit are fine-tuned)."""
    rate = cfg.lr_dense_warm if warm and cfg.lr_dense_warm is not None else cfg.lr_dense
    return torch.optim.Adam(model.dense_parameters(), lr=rate)


def table_optimizer(model: Model, cfg: TrainConfig) -> RowWiseAdagrad:
    """Row-wise Adagrad for the tables (a sharded model's is fused into TorchRec's
    backward: sharded/state.py's `FusedAdagrad`)."""
    return RowWiseAdagrad(
        model.sparse_parameters(),
        lr=cfg.lr_sparse,
        initial_accumulator=cfg.adagrad_initial_accumulator,
    )


def train_step(model, batch, opt_dense, opt_sparse, amp: bool, aux=None, scale=1.0) -> float:
    """One step on the click loss plus `aux(batch)` (an auxiliary loss, or None); returns
    the click loss. `scale` multiplies what is back-propagated (a sharded run's rank: its
    slice's share of the batch, so DDP's mean over ranks is the batch's mean)."""
    opt_dense.zero_grad(set_to_none=True)
    opt_sparse.zero_grad(set_to_none=True)
    loss = backward_loss(model, batch, amp, aux, scale)
    opt_dense.step()
    opt_sparse.step()
    return loss


def backward_loss(model, batch, amp: bool, aux=None, scale=1.0) -> float:
    """Training's loss on `batch` (the click loss on the raw logit plus `aux(batch)`),
    back-propagated into the gradients; returns the click loss. An `Ensemble`'s members
    each fit their own: the sum of their losses is back-propagated, their mean returned."""
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with ctx:
        logits = model(batch, per_member=True)  # [members, B]: each member on its own loss
    losses = torch.stack(
        [F.binary_cross_entropy_with_logits(z.float(), batch.labels) for z in logits]
    )
    extra = aux(batch) if aux is not None else None
    loss = losses.sum()
    ((loss if extra is None else loss + extra.float()) * scale).backward()
    return float(losses.detach().mean())


def cooccurrence_term(model: Model, cfg: TrainConfig, step: int):
    """The step's auxiliary loss as `train_step` takes it (None when off): the negatives are
    drawn from a generator seeded by the run's seed and the step, so a resumed run and an
    uninterrupted one, and both arms, draw the same."""
    if not cfg.cooccurrence_weight:
        return None
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)

    def term(batch):
        loss = cooccurrence_loss(model, batch, cfg.cooccurrence_negatives, generator)
        return None if loss is None else cfg.cooccurrence_weight * loss

    return term


# the co-occurrence negatives of the fold-in's k-th batch are seeded as this step + k: apart
# from every training step's
FOLD_IN_SEED_STEP = 1 << 40


def fold_in(model: Model, valid: BatchStore, opt_sparse, cfg: TrainConfig, device) -> int:
    """One pass of the embedding tables over the validation slice, after it has chosen the
    state and fitted the calibration; the dense layers and the calibration stay. Returns
    the samples folded in.

    The slice is the day's latest rows: without this the tables would never see them, and
    tomorrow's warm start would lack them. The references the bench compares with are refit
    on all of their training rows the same way. Every rank folds in every batch in the same
    order, so ranks stay equal without DDP. The loss is training's (click + co-occurrence),
    on the raw logit as in training."""
    calibration = model.calibration.clone()
    model.reset_calibration()
    samples = 0
    for k in range(len(valid)):
        batch = valid[k].to(device)
        model.zero_grad(set_to_none=True)  # the tables' gradients too
        backward_loss(model, batch, False, cooccurrence_term(model, cfg, FOLD_IN_SEED_STEP + k))
        opt_sparse.step()
        samples += batch.size
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.calibration.copy_(calibration)
    return samples
