"""Row-wise Adagrad for embedding tables with sparse gradients (FBGEMM's
EXACT_ROWWISE_ADAGRAD, the usual choice for DLRM tables).

One accumulator per table row, not per element:

    acc[r]  += mean_j g[r, j]^2
    w[r, :] -= lr * g[r, :] / (sqrt(acc[r]) + eps)

Why row-wise: element-wise Adagrad with a zero start divides each element's first
gradient by its own magnitude, so an element whose gradient is roundoff (1e-12 in one
arm, 0 in the other) takes a full-size step in one arm only: dedup and baseline drift
apart although their gradients agree to float precision. A row's accumulator is
dominated by its real gradient, so roundoff stays roundoff. It also keeps the optimizer
state at one float per row (a table of N x d weights carries N, not N x d, floats).
"""

from __future__ import annotations

import warnings

import torch


def quiet_sparse_warnings() -> None:
    """Adagrad on sparse gradients rebuilds them internally, and torch warns once per
    process that their invariant checks are off: not the user's concern. Every process
    that trains calls this (a training run's ranks, the bench's probes)."""
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")


class RowWiseAdagrad(torch.optim.Optimizer):
    def __init__(
        self, params, lr: float = 0.02, eps: float = 1e-10, initial_accumulator: float = 0
    ):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator": initial_accumulator})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["sum"] = torch.full(
                        (p.shape[0],),
                        float(group["initial_accumulator"]),
                        dtype=torch.float32,
                        device=p.device,
                    )
                acc = state["sum"]
                grad = p.grad
                if grad.is_sparse:
                    grad = grad.coalesce()
                    rows, values = grad.indices()[0], grad.values()
                else:  # dense gradient: every row with a non-zero gradient
                    rows = grad.abs().sum(1).nonzero().squeeze(1)
                    values = grad.index_select(0, rows)
                if rows.numel() == 0:
                    continue
                acc.index_add_(0, rows, values.float().pow(2).mean(1))
                scale = group["lr"] / (acc.index_select(0, rows).sqrt() + group["eps"])
                p.index_add_(0, rows, (-scale.unsqueeze(1) * values).to(p.dtype))
        return loss
