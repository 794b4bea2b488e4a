"""`recd train`: the DLRM on a day's session-clustered samples, dedup (IKJT) or baseline (KJT).

Both modes see the same batches in the same order (contiguous rows of the clustered layout,
batch order seeded per epoch); they differ only in how the batch is represented, so their
losses and weights agree to float tolerance. Embedding tables train with row-wise Adagrad
on sparse gradients (modeling/optim.py), everything else with Adam. The loss is the click
loss plus `cooccurrence_weight` times the user lists' co-occurrence loss
(modeling/cooccurrence.py), the same in both modes.

Validation and early stopping: DPP holds out the day's latest rows (dpp/preprocess.py); training
validates on them `validations_per_epoch` times a pass (and once before the first step),
keeps the state with the best validation NE and stops after `patience` validations without
a better one, at most `epochs` passes. The curve is in the summary (`train.history`), which
MLflow records as metric history.

Passes (`restart_tables`, default on): each pass after the first starts the embedding tables
and their Adagrad state again from where the run started and keeps the dense layers (MEDA,
Fan et al. 2024). A second pass over tables that have seen the day memorizes it: validation
NE jumped from 0.870 to 1.04 at its start on the standard day. With restarts the tables see
the day once and the layers above them learn from several passes, each over new tables
(the standard day from scratch: next-day NE 0.877 -> 0.868 with 3 passes). `pass_patience`
then counts passes without a better validation NE, since a pass begins below the best. The
saved model is the best state, and the optimizer state saved with it (what the next day's
warm start continues) is that step's, not the last step's.

Calibration (`calibrate`, default on): the best state's logit gets a slope and an offset
fitted on the validation slice (modeling/calibration.py), so its scores follow the day's
latest click rate, which training never saw; training itself runs uncalibrated (a warm
start's calibration is fitted again). `train.val_ne` is the best state's uncalibrated
validation NE (what early stopping compared); `train.val_ne_calibrated` the same slice
after the fit.

Fold-in (`fold_in_validation`, default on): then the tables take one pass over the
validation slice, the dense layers and the calibration staying as chosen (`fold_in`). The
slice is the day's latest rows; without it the tables would never see them, nor would
tomorrow's warm start. This is the refit on all training rows that the bench's references
get after their own choice on the same slice (MovieLens-100k: AUC 0.7710 -> 0.7797). The
validation figures in the summary are the chosen state's, before the fold-in.

Warm start: `init_from` names a saved model (the pipelines pass the champion); its weights
are the starting point when its feature set and model config equal this run's, else
training starts from scratch and `train.init_reason` says why. The saved model's optimizer
state (`optimizer.pt`) is continued too, as incremental training does: a restarted Adam and
Adagrad take full-size first steps on every row and undo much of yesterday's model (the
second day's next-day NE: 0.859 restarted, 0.850 continued). Ids never seen before still
start at full speed (their Adagrad accumulator is zero).

Checkpoints (`<warehouse>/checkpoints/<run>/step-NNNNNNNN.pt`, written atomically) hold the
model, both optimizers and the position in the data; a run resumes from its latest one, so
a killed run and an uninterrupted one end with the same weights. The trained model is saved
as a state dict (`<warehouse>/models/<run>/model.pt`, loadable with `weights_only=True`)
plus `model.json` (feature set, configs, dedup plan, summary): never a pickled object
(`saved.py`: the format, and loading and scoring a saved model).

Multi-process: `nproc > 1` spawns that many workers (gloo on CPU, nccl on CUDA), or run
under `torchrun`; each rank takes every `world`-th batch, DDP averages gradients, rank 0
writes checkpoints and the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import resource
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from recd_core.config import FeatureSet, TrainConfig
from recd_core.dpp.batch_store import BatchStore
from recd_core.errors import BadInput, first_line
from recd_core.leftovers import sweep_files
from recd_core.modeling.batching import epoch_order
from recd_core.modeling.calibration import calibrate
from recd_core.modeling.cooccurrence import cooccurrence_loss
from recd_core.modeling.model import Model, build_model
from recd_core.modeling.optim import RowWiseAdagrad
from recd_core.modeling.saved import (
    CheckpointError,
    _read_bytes,
    _read_saved,
    _torch_bytes,
    _torch_load,
    _write_bytes,
    read_optimizer,
    save_model,
    saved_train_config,
)
from recd_core.warehouse import Warehouse


class BatchMismatch(BadInput, ValueError):
    """The preprocessed batches are not what the training config asks for."""


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def run_name(ds: str, cfg: TrainConfig, batches_id: str = "") -> str:
    """The training run's key: day, mode, config and the batches partition's write id. A
    retry on the same batches resumes the run's checkpoints; re-preprocessed batches (a new
    write id) start a new run instead of resuming onto other data."""
    key = cfg.model_dump_json(exclude={"device", "threads"}) + batches_id
    return f"{ds}-{cfg.mode}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


# -- bytes on the warehouse filesystem -------------------------------------------------------


@dataclass
class Checkpoints:
    wh: Warehouse
    run: str
    keep: int

    @property
    def dir(self) -> str:
        return f"{self.wh.root}/checkpoints/{self.run}"

    def list(self) -> list[str]:
        import pyarrow.fs as pafs

        if self.wh.fs.get_file_info(self.dir).type != pafs.FileType.Directory:
            return []
        sweep_files(self.wh.fs, self.dir)  # a killed or failed save's temporary file
        infos = self.wh.fs.get_file_info(pafs.FileSelector(self.dir))
        return sorted(
            i.path for i in infos if i.base_name.startswith("step-") and i.base_name.endswith(".pt")
        )

    def save(self, state: dict) -> str:
        path = f"{self.dir}/step-{state['step']:08d}.pt"
        _write_bytes(self.wh, path, _torch_bytes(state))
        for old in self.list()[: -self.keep]:
            self.wh.fs.delete_file(old)
        return path

    def latest(self) -> dict | None:
        paths = self.list()
        if not paths:
            return None
        state = _torch_load(_read_bytes(self.wh, paths[-1]), paths[-1])
        if not isinstance(state, dict) or not {"model", "optimizer", "step"} <= state.keys():
            raise CheckpointError(
                f"{paths[-1]} is not a recd checkpoint (keys: {sorted(state)[:6]})"
            )
        return state


def _peak_mem(device: torch.device) -> int:
    """Peak memory: CUDA's allocator peak, or this process's peak resident set. VmHWM belongs
    to the address space, which exec replaces; ru_maxrss survives fork+exec and would report
    a big parent's peak in a freshly spawned child."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def make_optimizers(model: Model, cfg: TrainConfig, warm: bool = False):
    """Adam for the dense layers (at `lr_dense_warm` on a warm start: layers that already
    fit are fine-tuned), row-wise Adagrad for the tables."""
    sparse = RowWiseAdagrad(
        model.sparse_parameters(),
        lr=cfg.lr_sparse,
        initial_accumulator=cfg.adagrad_initial_accumulator,
    )
    rate = cfg.lr_dense_warm if warm and cfg.lr_dense_warm is not None else cfg.lr_dense
    dense = torch.optim.Adam(model.dense_parameters(), lr=rate)
    return dense, sparse


def train_step(model, batch, opt_dense, opt_sparse, amp: bool, aux=None) -> float:
    """One step on the click loss plus `aux(batch)` (an auxiliary loss, or None); returns
    the click loss."""
    opt_dense.zero_grad(set_to_none=True)
    opt_sparse.zero_grad(set_to_none=True)
    loss = backward_loss(model, batch, amp, aux)
    opt_dense.step()
    opt_sparse.step()
    return loss


def backward_loss(model, batch, amp: bool, aux=None) -> float:
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
    (loss if extra is None else loss + extra.float()).backward()
    return float(losses.detach().mean())


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


# the co-occurrence negatives of the fold-in's k-th batch are seeded as this step + k: apart
# from every training step's
FOLD_IN_SEED_STEP = 1 << 40


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


def _train_worker(
    rank: int,
    world: int,
    wh_uri: str,
    ds: str,
    cfg: TrainConfig,
    result_path: str | None,
    init_from: str | None = None,
    init_label: str | None = None,
) -> dict:
    distributed = world > 1
    device = resolve_device(cfg.device)
    if distributed:
        if device.type == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # Adagrad rebuilds sparse gradients internally; torch warns about invariant checks.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    wh = Warehouse(wh_uri)
    store = BatchStore(wh, ds, cfg.mode)
    if store.manifest["batch_size"] != cfg.batch_size:
        raise BatchMismatch(
            f"batches/mode={cfg.mode}/ds={ds} were preprocessed with batch size "
            f"{store.manifest['batch_size']}, the training config asks for {cfg.batch_size}: "
            f"re-run `recd preprocess --batch-size {cfg.batch_size}` or train with that size"
        )
    days = add_window(wh, store, ds, cfg)
    valid = BatchStore(wh, ds, cfg.mode, split="validation")
    features = store.model_features
    model = build_model(features, cfg.model)
    init = initial_state(init_from, features, cfg, init_label)
    if init.state is not None:
        try:
            model.load_state_dict(init.state)
        except RuntimeError as e:  # saved by an older version of the model code
            first = first_line(e, 120)
            init = Init(
                None, None, f"from scratch: the saved weights do not fit this model ({first})"
            )
            model = build_model(features, cfg.model)
    if init.state is None:
        model.init_output_bias(store.click_rate())
    model.reset_calibration()  # training fits the raw logit; a warm start's is refitted
    model = model.to(device)
    opt_dense, opt_sparse = make_optimizers(model, cfg, warm=init.state is not None)
    if init.optimizer is not None:  # a warm start from a model saved with it
        continue_optimizers(opt_dense, opt_sparse, init.optimizer)
    # where every pass's tables start (before a checkpoint moves them): scratch or warm start
    restart = None
    if cfg.restart_tables and cfg.epochs > 1:
        restart = TableStart.capture(model, opt_sparse)
    name = run_name(ds, cfg, batches_id(wh, ds, cfg.mode) + (init.uri or ""))
    ckpts = Checkpoints(wh, name, cfg.keep_checkpoints)
    step = 0
    patience = cfg.pass_patience if restart is not None else cfg.patience
    early = EarlyStopping(patience, per_pass=restart is not None)
    state = ckpts.latest()
    if state is not None:
        model.load_state_dict(state["model"])
        opt_dense.load_state_dict(state["optimizer"]["dense"])
        opt_sparse.load_state_dict(state["optimizer"]["sparse"])
        step = int(state["step"])
        early = EarlyStopping.from_state(patience, state.get("early"), restart is not None)
    net = DistributedDataParallel(model) if distributed else model
    n_batches = len(store)
    # every rank takes the same number of steps (DDP all-reduces each one): the batches
    # past the last full round of `world` are left out of that epoch (a different set each
    # epoch, the order being seeded per epoch)
    per_epoch = n_batches // world if world > 1 else n_batches
    if per_epoch == 0:
        raise BatchMismatch(
            f"batches/mode={cfg.mode}/ds={ds} holds {n_batches} batches for {world} processes"
        )
    total = per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    every = max(1, per_epoch // cfg.validations_per_epoch)
    resumed_at = step
    losses: list[float] = []
    samples = 0
    seconds = 0.0

    def optimizers() -> dict:
        return {"dense": opt_dense.state_dict(), "sparse": opt_sparse.state_dict()}

    if len(valid) and step == 0:
        early.update(0, validate(model, valid, device), model, optimizers())
    while step < total and not early.stop:
        t0 = time.perf_counter()
        epoch, k = divmod(step, per_epoch)
        if restart is not None and epoch > 0 and k == 0:
            restart.restore(model, opt_sparse)
            for group in opt_dense.param_groups:  # saved with the optimizer: a resume keeps it
                group["lr"] *= cfg.lr_dense_pass_decay
        b = int(epoch_order(n_batches, cfg.seed, epoch)[rank::world][k])
        batch = store[b].to(device)
        aux = cooccurrence_term(model, cfg, step)
        losses.append(
            train_step(net, batch, opt_dense, opt_sparse, cfg.amp and device.type == "cuda", aux)
        )
        samples += batch.size
        step += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - t0
        early.losses.append([step, float(losses[-1])])
        pass_end = step % per_epoch == 0
        if len(valid) and (step % every == 0 or step == total or (early.per_pass and pass_end)):
            early.update(step, validate(model, valid, device), model, optimizers())
        if len(valid) and pass_end:
            early.pass_done(step - per_epoch)
        if rank == 0 and (step % cfg.checkpoint_every == 0 or step == total or early.stop):
            ckpts.save(_checkpoint_state(model, optimizers(), step, cfg, early))
    optimizer = optimizers()
    if early.best_state is not None and early.best_step != step:
        model.load_state_dict(early.best_state)  # the best validated state, not the last
        optimizer = early.best_optimizer  # and the optimizers as they were then
    calibration = calibrate(model, valid, device) if cfg.calibrate and len(valid) else {}
    folded = 0
    if cfg.fold_in_validation and len(valid):
        opt_sparse.load_state_dict(_on_cpu(optimizer["sparse"]))
        folded = fold_in(model, valid, opt_sparse, cfg, device)
        optimizer = {"dense": optimizer["dense"], "sparse": opt_sparse.state_dict()}
    summary = {
        "train.mode": cfg.mode,
        "train.run": name,
        "train.steps": step,
        "train.steps_per_epoch": per_epoch,
        "train.resumed_from_step": resumed_at,
        "train.samples": samples * world,
        "train.samples_per_s": samples * world / seconds if seconds > 0 and samples else 0.0,
        "train.loss": float(np.mean(losses[-10:])) if losses else float("nan"),
        "train.seconds": seconds,
        "train.peak_mem_bytes": _peak_mem(device),
        "train.device": str(device),
        "train.world_size": world,
        "train.dedup_groups": {g: len(fs) for g, fs in store.groups.items()},
        "train.batch_size": store.manifest["batch_size"],
        "train.days": days,
        "train.init_from": init.uri or "",
        "train.init_reason": init.reason,
        "train.lr_dense": opt_dense.param_groups[0]["lr"],
        "train.folded_in_samples": folded,
        **early.summary(),
        **calibration,
    }
    if rank == 0:
        summary["train.model_uri"] = save_model(
            wh, name, model, cfg, store.manifest["prepared"], summary, optimizer
        )
        if result_path:
            with open(result_path, "w") as f:
                json.dump(summary, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def add_window(wh: Warehouse, store: BatchStore, ds: str, cfg: TrainConfig) -> list[str]:
    """Prepend the batches of the `window_days - 1` days before `ds` that were preprocessed
    alike (same model features and dedup groups), oldest first; the days trained on."""
    days = [ds]
    first = dt.date.fromisoformat(ds)
    for back in range(1, cfg.window_days):
        day = (first - dt.timedelta(days=back)).isoformat()
        if not wh.exists("batches", day, mode=cfg.mode):
            continue
        older = BatchStore(wh, day, cfg.mode)
        same = older.model_features == store.model_features and older.groups == store.groups
        if same and older.manifest["batch_size"] == store.manifest["batch_size"]:
            store.prepend(older)
            days.insert(0, day)
    return days


def validate(model: Model, valid: BatchStore, device: torch.device) -> dict[str, float]:
    """NE, AUC and calibration of the current weights on the day's validation batches."""
    from recd_core.modeling.evaluate import score_batches

    return score_batches(model, valid, device)


def _on_cpu(state):
    """A copy on the CPU of a tensor, or of the tensors in a (nested) state dict or list: a
    kept state holds no device memory and shares no storage with the live one."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_on_cpu(v) for v in state)
    return state


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
        return cls(_on_cpu(model.sparse_parameters()), _on_cpu(opt_sparse.state_dict()))

    def restore(self, model: Model, opt_sparse) -> None:
        with torch.no_grad():
            for p, w in zip(model.sparse_parameters(), self.weights, strict=True):
                p.copy_(w)
        opt_sparse.load_state_dict(_on_cpu(self.optimizer))


@dataclass
class EarlyStopping:
    """Keeps the best state by validation NE; stops after `patience` validations in a row
    without a better one, or (`per_pass`: the tables restart each pass, so a pass's first
    validations are expected to be worse) after `patience` passes in a row without one. Its
    history is what MLflow shows as the training curve."""

    patience: int
    per_pass: bool = False
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

    def update(self, step: int, figures: dict, model: Model, optimizers: dict) -> None:
        # plain floats: the checkpoint is loaded with weights_only=True (no numpy scalars)
        ne = float(figures["eval.ne"])
        self.history.append([int(step), ne, float(figures["eval.auc"])])
        if ne < self.best_ne - 1e-6:
            self.best_ne, self.best_step = ne, step
            if not self.per_pass:
                self.bad = 0
            self.best_state = _on_cpu(model.state_dict())
            self.best_optimizer = _on_cpu(optimizers)
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
        return {
            k: v for k, v in dataclasses.asdict(self).items() if k not in ("patience", "per_pass")
        }

    @classmethod
    def from_state(cls, patience: int, state: dict | None, per_pass: bool = False) -> EarlyStopping:
        return cls(patience, per_pass, **(state or {}))

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
class Init:
    """Where training starts: a saved model's weights (warm start) or scratch, and why;
    with a warm start, the saved optimizer state when the model has one."""

    state: dict | None
    uri: str | None
    reason: str
    optimizer: dict | None = None


def continue_optimizers(opt_dense, opt_sparse, saved: dict) -> None:
    """Continue the saved model's optimizers (Adam's moments and step count, the tables'
    Adagrad accumulators) at the learning rates this run built them with. A state that does
    not fit (another optimizer layout) is left out: the optimizers then start afresh."""
    optimizers = (opt_dense, opt_sparse)
    rates = [[group["lr"] for group in opt.param_groups] for opt in optimizers]
    try:
        opt_dense.load_state_dict(saved["dense"])
        opt_sparse.load_state_dict(saved["sparse"])
    except (KeyError, ValueError, RuntimeError, TypeError):
        return
    for opt, lrs in zip(optimizers, rates, strict=True):
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr


def initial_state(
    init_from: str | None, features: FeatureSet, cfg: TrainConfig, label: str | None = None
) -> Init:
    """The weights of the model at `init_from` (a `<warehouse>/models/<run>` URI or a local
    directory with model.pt + model.json) when it was trained on the same model features
    with the same model config; otherwise scratch, with the reason. `label` names the
    model in the record (e.g. `models:/recd-dlrm/3` for a registry copy)."""
    if not init_from:
        return Init(None, None, label or "from scratch: no model to start from")
    try:
        meta, weights, where = _read_saved(init_from)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"--init-from {init_from}: not a recd model ({e})") from None
    theirs = FeatureSet.model_validate(meta["features"])
    their_model = saved_train_config(meta).model
    if theirs != features:
        changed = sorted(
            {f.name for f in theirs.features} ^ {f.name for f in features.features}
        ) or [a.name for a, b in zip(theirs.features, features.features, strict=False) if a != b]
        changed = changed or ["its name or user/item keys"]
        named = ", ".join(changed[:4]) + (
            f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        )
        return Init(None, None, f"from scratch: the feature set changed ({named})")
    if their_model != cfg.model:
        a, b = their_model.model_dump(), cfg.model.model_dump()
        changed = [k for k in a if a[k] != b[k]]
        return Init(None, None, f"from scratch: the model config changed ({', '.join(changed)})")
    name = label or init_from
    state = _torch_load(weights, where, "model")
    return Init(state, name, f"warm start from {name}", read_optimizer(init_from))


def batches_id(wh: Warehouse, ds: str, mode: str) -> str:
    return str(wh.manifest("batches", ds, mode=mode).get("write_id", ""))


def _checkpoint_state(
    model, optimizer: dict, step: int, cfg: TrainConfig, early: EarlyStopping
) -> dict:
    """Everything a resume needs; `optimizer` is laid out as the saved model's optimizer.pt."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer,
        "step": step,
        "config": cfg.model_dump_json(),
        "early": early.state(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(
    rank: int, world: int, wh_uri: str, ds: str, cfg_json: str, result_path: str, init: tuple
) -> None:
    cfg = TrainConfig.model_validate_json(cfg_json)
    _train_worker(rank, world, wh_uri, ds, cfg, result_path, *init)


def train(
    warehouse: Warehouse,
    ds: str,
    cfg: TrainConfig,
    nproc: int = 1,
    init_from: str | None = None,
    init_label: str | None = None,
) -> dict:
    """Train (resuming from the run's latest checkpoint); returns rank 0's summary.
    `init_from`: a saved model to start from (warm start) instead of a fresh init; without
    one, `init_label` may say why (it goes into `train.init_reason`)."""
    warehouse.info("batches", ds, mode=cfg.mode)  # fail early, naming the partition
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return _train_worker(rank, world, warehouse.uri, ds, cfg, None, init_from, init_label)
    if nproc <= 1:
        return _train_worker(0, 1, warehouse.uri, ds, cfg, None, init_from, init_label)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = f"{tmp}/rank0.json"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        mp.start_processes(
            _spawn_entry,
            args=(nproc, warehouse.uri, ds, cfg.model_dump_json(), result, (init_from, init_label)),
            nprocs=nproc,
            start_method="spawn",
        )
        with open(result) as f:
            return json.load(f)
