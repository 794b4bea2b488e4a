"""Which state a training run keeps, and when it stops; how each pass restarts the tables.

Validation: DPP holds out the day's latest rows (dpp/preprocess.py); training validates on
them `validations_per_epoch` times a pass (and once before the first step), keeps the state
with the best validation NE (`EarlyStopping`) and stops after `patience` validations without
a better one, at most `epochs` passes. The curve is in the summary (`train.history`), which
MLflow records as metric history.

Passes (`restart_tables`, default on): each pass after the first starts the embedding
tables and their Adagrad state again from where the run started (`TableStart`) and keeps
the dense layers (MEDA, Fan et al. 2024): a second pass over tables that have seen the day
memorizes it, while new tables each pass let the layers above them learn from several
passes. `pass_patience` then counts passes without a better validation NE, since a pass
begins below the best.

Averaged states (`average_states`, MovieLens: 4): a validation scores the mean of the
weights at the last k validations instead of the live ones, and that mean is what the
run keeps. On ml-100k split globally the live weights' validation NE moves by up to 0.013
between validations, more than the states it chooses between differ, and the test NE of
the state chosen moved with the seed (0.8147-0.8309); the mean of nearby states moves
less and scores better than its members (Polyak averaging, SWA: Izmailov et al. 2018).
The window is the run's own: it starts after the first step (the scratch init is no
state to average) and again when a pass restarts the tables."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from recd_core.modeling.model import Model


def on_cpu(state):
    """A copy on the CPU of a tensor, or of the tensors in a (nested) state dict or list: a
    kept state holds no device memory and shares no storage with the live one."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(on_cpu(v) for v in state)
    return state


@dataclass
class EarlyStopping:
    """Keeps the best state by validation NE; stops after `patience` validations in a row
    without a better one, or (`per_pass`: the tables restart each pass, so a pass's first
    validations are expected to be worse) after `patience` passes in a row without one. Its
    history is what MLflow shows as the training curve."""

    patience: int
    per_pass: bool = False
    average: int = 1  # the validated state: the mean of the last this many (`average_states`)
    best_ne: float = float("inf")
    best_step: int = -1
    bad: int = 0
    stop: bool = False
    best_state: dict | None = None
    # both optimizers' state at the best step: saved with the model, so tomorrow's warm
    # start continues the optimizer that goes with the weights it starts from
    best_optimizer: dict | None = None
    history: list[list[float]] = dataclasses.field(default_factory=list)  # step, NE, AUC
    losses: list[list[float]] = dataclasses.field(default_factory=list)  # step, loss
    # the live weights at the last `average` validations (on the CPU), oldest first
    window: list[dict] = dataclasses.field(default_factory=list)

    @contextlib.contextmanager
    def averaged(self, model: Model):
        """Inside, `model` holds the mean of its weights at this and the `average - 1`
        validations before (fewer at the run's or a pass's start); after, its live
        weights again. Integer tensors are the live ones. The identity when `average` is
        1. The validation before the first step scores the init without it: no member."""
        if self.average == 1:
            yield
            return
        live = on_cpu(model.state_dict())
        self.window = [*self.window, live][-self.average :]
        n = len(self.window)
        mean = {
            k: (sum(s[k] for s in self.window) / n if v.is_floating_point() else v)
            for k, v in live.items()
        }
        model.load_state_dict(mean)
        try:
            yield
        finally:
            model.load_state_dict(live)

    def update(self, step: int, figures: dict, model: Model, optimizers: dict) -> None:
        # plain floats: the checkpoint is loaded with weights_only=True (no numpy scalars)
        ne = float(figures["eval.ne"])
        self.history.append([int(step), ne, float(figures["eval.auc"])])
        if ne < self.best_ne - 1e-6:
            self.best_ne, self.best_step = ne, step
            if not self.per_pass:
                self.bad = 0
            self.best_state = on_cpu(model.state_dict())
            self.best_optimizer = on_cpu(optimizers)
        elif not self.per_pass:
            self.bad += 1
            self.stop = self.bad >= self.patience

    def pass_done(self, pass_start: int) -> None:
        """A pass (steps after `pass_start`) ended: with `per_pass`, count it if it found no
        better state."""
        if self.per_pass:
            self.bad = self.bad + 1 if self.best_step <= pass_start else 0
            self.stop = self.bad >= self.patience

    def state(self) -> dict:
        fixed = ("patience", "per_pass", "average")  # the config's, not the run's
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in fixed}

    @classmethod
    def from_state(
        cls, patience: int, state: dict | None, per_pass: bool = False, average: int = 1
    ) -> EarlyStopping:
        return cls(patience, per_pass, average, **(state or {}))

    def summary(self) -> dict:
        if not self.history:
            return {"train.validated": False}
        return {
            "train.validated": True,
            "train.val_ne": self.best_ne,
            "train.val_auc": next(a for s, n, a in self.history if s == self.best_step),
            "train.best_step": self.best_step,
            "train.stopped_early": self.stop,
            "train.history": {
                "train.val_ne": [[int(s), n] for s, n, _ in self.history],
                "train.val_auc": [[int(s), a] for s, _, a in self.history],
                "train.batch_loss": [[int(s), v] for s, v in self.losses],
            },
        }


@dataclass(frozen=True)
class TableStart:
    """The embedding tables and their optimizer state as the run started (on the CPU); each
    pass after the first restores them (`TrainConfig.restart_tables`). Rebuilt the same way
    on a resume (the seeded scratch init or the warm start), so it is not checkpointed.
    The state is copied both ways: `load_state_dict` keeps tensors that already sit on the
    parameters' device, and Adagrad then accumulates into them in place."""

    weights: list[torch.Tensor]
    optimizer: dict

    @classmethod
    def capture(cls, model: Model, opt_sparse) -> TableStart:
        return cls(on_cpu(model.sparse_parameters()), on_cpu(opt_sparse.state_dict()))

    def restore(self, model: Model, opt_sparse) -> None:
        with torch.no_grad():
            for p, w in zip(model.sparse_parameters(), self.weights, strict=True):
                p.copy_(w)
        opt_sparse.load_state_dict(on_cpu(self.optimizer))
