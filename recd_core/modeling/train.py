"""`recd train`: the DLRM on a day's session-clustered samples, dedup (IKJT) or baseline (KJT).

Both modes see the same batches in the same order (contiguous rows of the clustered layout,
batch order seeded per epoch); they differ only in how the batch is represented, so their
losses and weights agree to float tolerance. A run reads in three parts:

    setup   the batches, the model (warm-started from a saved one: warm_start.py), the
            optimizers (step.py), the run's checkpoints (checkpoints.py; resumed from the
            latest), early stopping and the tables' restart point (early_stopping.py)
    fit     the loop: a batch, a step, now and then a validation and a checkpoint
    finish  the best state back, its calibration, the fold-in, the summary, the saved model

Validation and passes (early_stopping.py, which says why): training validates on the day's
latest rows, which DPP held out, keeps the state with the best validation NE and stops when
it stops improving; each pass after the first restarts the embedding tables from where the
run started and keeps the dense layers (`restart_tables`). The saved model is the best state, with that step's optimizer state (what the next day's
warm start continues).

Calibration (`calibrate`, default on): the best state's logit gets a slope and an offset
fitted on the validation slice (modeling/calibration.py), so its scores follow the day's
latest click rate, which training never saw; training itself runs uncalibrated.
`train.val_ne` is the best state's uncalibrated validation NE (what early stopping
compared); `train.val_ne_calibrated` the same slice after the fit.

Fold-in (`fold_in_validation`, default on): then the tables take one pass over the
validation slice, the dense layers and the calibration staying as chosen (step.py's
`fold_in`): without it the tables would never see the day's latest rows, nor would
tomorrow's warm start, while the references are refit on all their training rows. The
validation figures in
the summary are the chosen state's, before the fold-in.

The trained model is saved as a state dict plus model.json (saved.py: the format, and
loading and scoring a saved model); several processes train data parallel (launch.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow.fs as pafs
import torch

from recd_core.config import FeatureSet, TrainConfig
from recd_core.dpp.batch_store import BatchStore
from recd_core.errors import BadInput
from recd_core.lineage import check_reads, record, staleness, write_ids
from recd_core.metrics import throughput_parts
from recd_core.modeling.calibration import calibrate
from recd_core.modeling.checkpoints import checkpoint_state, one_writer, run_name
from recd_core.modeling.early_stopping import EarlyStopping, TableStart, on_cpu
from recd_core.modeling.evaluate import score_batches
from recd_core.modeling.launch import (
    every_rank,
    join_process_group,
    launch,
    leave_process_group,
    peak_mem,
    resolve_device,
)
from recd_core.modeling.model import Model
from recd_core.modeling.optim import quiet_sparse_warnings
from recd_core.modeling.parallel import CheckpointStore, Parallelism, check, parallelism
from recd_core.modeling.ray_engine import ray_train
from recd_core.modeling.saved import load_model, model_base, model_uri, save_model
from recd_core.modeling.step import cooccurrence_term, fold_in, train_step
from recd_core.modeling.warm_start import Init, continue_optimizers, initial_state
from recd_core.runtime import cpu_budget, launched_rank, rss
from recd_core.warehouse import Warehouse


class BatchMismatch(BadInput, ValueError):
    """The preprocessed batches are not what the training config asks for."""


def train(
    warehouse: Warehouse,
    ds: str,
    cfg: TrainConfig,
    nproc: int | None = None,
    init_from: str | None = None,
    init_label: str | None = None,
    features: FeatureSet | None = None,
) -> dict:
    """Train (resuming from the run's latest checkpoint); returns rank 0's summary.
    `nproc`: processes (default: `cfg.nproc`). `init_from`: a saved model to start from
    (warm start) instead of a fresh init; without one, `init_label` may say why (it goes
    into `train.init_reason`). Stale batches, or batches built with another feature set
    than the config's `features`, are refused (lineage.py)."""
    warehouse.info("batches", ds, mode=cfg.mode)  # fail early, naming the partition
    check_reads(
        warehouse, "train", [warehouse.partition_name("batches", ds, mode=cfg.mode)], features
    )
    nproc = cfg.nproc if nproc is None else nproc
    if launched_rank() is not None:  # torchrun's processes, on this machine or on several
        nproc = int(os.environ["WORLD_SIZE"])
    check(cfg, nproc)  # before any process starts
    if cfg.engine == "ray" and launched_rank() is None:  # each worker runs this function
        return ray_train(train, warehouse.uri, ds, cfg, nproc, init_from, init_label, features)
    # one live writer per day and arm (a rank that torchrun started: its rank 0 holds it)
    lock = one_writer(warehouse, ds, cfg.mode) if launched_rank() in (None, 0) else None
    with lock or contextlib.nullcontext():
        return launch(train_worker, nproc, warehouse.uri, ds, cfg, init_from, init_label)


def train_worker(
    rank: int,
    world: int,
    wh_uri: str,
    ds: str,
    cfg: TrainConfig,
    init_from: str | None = None,
    init_label: str | None = None,
) -> dict:
    """One process of a run (the only one, or a rank of a data-parallel run)."""
    run = setup(rank, world, wh_uri, ds, cfg, init_from, init_label)
    summary = trained_before(run)
    if summary is None:
        fit(run)
        summary = finish(run)
    leave_process_group(world)
    return summary


@dataclass
class Run:
    """What the loop works on, built by `setup`; `step`, `samples`, `seconds` and `losses`
    move as it goes."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    wh: Warehouse
    store: BatchStore  # the training batches (the window's days, oldest first)
    valid: BatchStore  # the day's latest rows, held out by DPP
    days: list[str]
    model: Model
    parallel: Parallelism  # how the processes share the model (parallel.py)
    net: torch.nn.Module  # what a step runs: the model, or its DDP / DMP wrapper
    opt_dense: torch.optim.Optimizer
    opt_sparse: torch.optim.Optimizer
    init: Init
    restart: TableStart | None  # where each pass's tables start, when they restart
    early: EarlyStopping
    checkpoints: CheckpointStore
    per_epoch: int  # steps a pass (every rank takes as many)
    total: int  # steps at most
    lineage: dict = field(default_factory=dict)  # what the model is built from (lineage.py)
    validation: str = "ok"  # whether the validation slice chooses states (validation_use)
    rss_before_model: int | None = None  # this process's memory before the model was built

    @property
    def validating(self) -> bool:
        return self.validation == "ok"

    step: int = 0
    resumed_at: int = 0
    samples: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)  # each step's, for the parts
    step_seconds: list[float] = field(default_factory=list)

    def optimizer_states(self) -> dict:
        return {"dense": self.opt_dense.state_dict(), "sparse": self.opt_sparse.state_dict()}


def fit(run: Run) -> None:
    """The training loop: a step a batch, in the pass's seeded order; validation
    `validations_per_epoch` times a pass (and before the first step) feeds early stopping;
    rank 0 checkpoints every `checkpoint_every` steps and at the end."""
    cfg, model, valid, early = run.cfg, run.model, run.valid, run.early
    amp = cfg.amp and run.device.type == "cuda"
    every = max(1, run.per_epoch // cfg.validations_per_epoch)
    if run.validating and run.step == 0:
        early.update(0, validate(model, valid, run.device), model, run.optimizer_states())
    while run.step < run.total and not early.stop:
        t0 = time.perf_counter()
        epoch, k = divmod(run.step, run.per_epoch)
        if run.restart is not None and epoch > 0 and k == 0:  # a new pass: new tables
            run.restart.restore(model, run.opt_sparse)
            early.window = []  # states of other tables: no mean with the new ones
            for group in run.opt_dense.param_groups:  # saved with the optimizer: kept on resume
                group["lr"] *= cfg.lr_dense_pass_decay
        order = epoch_order(len(run.store), cfg.seed, epoch)
        batch, scale = run.parallel.step_batch(run.store, order, k)
        aux = cooccurrence_term(model, cfg, run.step)
        loss = train_step(run.net, batch, run.opt_dense, run.opt_sparse, amp, aux, scale)
        run.losses.append(loss)
        run.samples += batch.size
        run.step += 1
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        took = time.perf_counter() - t0
        run.seconds += took
        run.step_samples.append(batch.size)
        run.step_seconds.append(took)
        early.losses.append([run.step, loss])
        step, pass_end = run.step, run.step % run.per_epoch == 0
        scores = None
        if run.validating and (
            step % every == 0 or step == run.total or (early.per_pass and pass_end)
        ):
            with early.averaged(model):  # the state validated and kept
                scores = validate(model, valid, run.device)
                early.update(step, scores, model, run.optimizer_states())
        if run.rank == 0 and (scores is not None or step % max(run.total // 10, 1) == 0):
            report_progress(run, scores)
        if run.validating and pass_end:
            early.pass_done(step - run.per_epoch)
        save = step % cfg.checkpoint_every == 0 or step == run.total or early.stop
        if save and run.parallel.writes_checkpoints:
            state = checkpoint_state(model, run.optimizer_states(), step, cfg, early)
            run.checkpoints.save(state)


def trained_before(run: Run) -> dict | None:
    """The summary of this run's model when an earlier run of the same key (day, arm,
    config, the batches' write id, the starting model) saved it whole: a second run of the
    day (a manual one beside the scheduled one, a retry after the model was saved) uses it
    instead of training again and saving another copy. None when there is none, or it does
    not verify (then this run trains and replaces it)."""
    base = model_base(run.wh, run.checkpoints.run)
    if run.wh.fs.get_file_info(f"{base}/model.json").type != pafs.FileType.File:
        return None
    uri = model_uri(run.wh, run.checkpoints.run)
    try:
        _, meta = load_model(uri)  # model.json and every file it names, verified
    except (BadInput, OSError, ValueError, KeyError):  # damaged, partial: trained again
        return None
    if run.rank == 0:
        print(
            f"train {run.days[-1]} {run.cfg.mode}: {uri} was trained by an earlier run "
            "on the same batches, config and starting model: used as it is",
            flush=True,
        )
    summary = {
        **meta.get("summary", {}),
        "train.reused": True,
        # this run's own start (the same weights: a scratch start whatever its reason)
        "train.init_from": run.init.uri or "",
        "train.init_reason": run.init.reason,
    }
    return {**summary, "train.model_uri": uri} if run.rank == 0 else summary


def report_progress(run: Run, scores: dict | None) -> None:
    """One line on stdout at each validation (or each tenth of the run): what a task log or
    a pod's log shows while training runs (a bar needs a terminal)."""
    recent = run.losses[-50:]
    val = f", validation NE {scores['eval.ne']:.4f}" if scores else ""
    rate = run.samples / run.seconds if run.seconds else 0.0
    print(
        f"train {run.days[-1]} {run.cfg.mode}: step {run.step:,}/{run.total:,} "
        f"({run.step / run.total:.0%}), pass {(run.step - 1) // run.per_epoch + 1}, "
        f"loss {sum(recent) / len(recent):.4f}{val}, {rate:,.0f} samples/s",
        flush=True,
    )


def setup(
    rank: int,
    world: int,
    wh_uri: str,
    ds: str,
    cfg: TrainConfig,
    init_from: str | None,
    init_label: str | None,
) -> Run:
    """The run as `fit` takes it: batches checked against the config, the model (warm
    start or scratch), its optimizers, and the position of the run's latest checkpoint."""
    device = join_process_group(rank, world, resolve_device(cfg.device))
    if device.type == "cpu":  # the CPUs this process may use, shared by the run's processes
        torch.set_num_threads(cfg.threads or max(cpu_budget() // world, 1))
    quiet_sparse_warnings()
    wh = Warehouse(wh_uri)
    with wh.pinned("batches", ds, mode=cfg.mode) as manifest:  # one version: both splits
        store = BatchStore(wh, ds, cfg.mode)
        valid = BatchStore(wh, ds, cfg.mode, split="validation")
    asked = store.manifest.get("batch_size_asked", store.manifest["batch_size"])
    if asked != cfg.batch_size:
        raise BatchMismatch(
            f"batches/mode={cfg.mode}/ds={ds} were preprocessed with batch size "
            f"{asked}, the training config asks for {cfg.batch_size}: "
            f"re-run `recd preprocess --batch-size {cfg.batch_size}` or train with that size"
        )
    days = add_window(wh, store, ds, cfg)
    inputs = {
        **write_ids(wh, "batches", days[:-1], mode=cfg.mode),
        wh.partition_name("batches", ds, mode=cfg.mode): str(manifest.get("write_id")),
    }
    # the shape a day of this size trains (one model past `members_up_to_samples`)
    cfg = cfg.model_copy(update={"model": cfg.model.for_samples(store.samples())})
    validation = validation_use(valid)
    parallel = parallelism(cfg, rank, world, device, validation == "ok", store)
    rss_before_model = rss()  # the runtime and the batches: what the model adds is on top
    init = initial_state(init_from, store.model_features, cfg, init_label)
    model, net, init = parallel.build(store.model_features, cfg, init, store.click_rate())
    opt_dense, opt_sparse = parallel.optimizers(model, cfg, warm=init.state is not None)
    if init.optimizer is not None:  # a warm start from a model saved with it
        continue_optimizers(opt_dense, opt_sparse, init.optimizer)
    # where every pass's tables start (before a checkpoint moves them): scratch or warm start
    restart = None
    if cfg.restart_tables and cfg.epochs > 1:
        restart = TableStart.capture(model, opt_sparse)
    name = run_name(ds, cfg, str(manifest.get("write_id", "")) + (init.uri or ""))
    patience = cfg.pass_patience if restart is not None else cfg.patience
    early = EarlyStopping(patience, per_pass=restart is not None, average=cfg.average_states)
    checkpoints = parallel.checkpoints(wh, name, cfg.keep_checkpoints, model)
    step = 0
    state = checkpoints.latest()
    if state is not None:
        model.load_state_dict(state["model"])
        opt_dense.load_state_dict(state["optimizer"]["dense"])
        opt_sparse.load_state_dict(state["optimizer"]["sparse"])
        step = int(state["step"])
        early = EarlyStopping.from_state(
            patience, state.get("early"), restart is not None, cfg.average_states
        )
    per_epoch = parallel.steps_per_epoch(len(store))
    if per_epoch == 0:
        raise BatchMismatch(
            f"batches/mode={cfg.mode}/ds={ds} holds {len(store)} batches for {world} processes"
        )
    total = per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    lineage = record("train", inputs, cfg, (manifest.get("lineage") or {}).get("features"))
    lineage["trained_days"] = sorted({*init.trained_days, *days})
    return Run(
        cfg,
        rank,
        world,
        device,
        wh,
        store,
        valid,
        days,
        model,
        parallel,
        net,
        opt_dense,
        opt_sparse,
        init,
        restart,
        early,
        checkpoints,
        per_epoch,
        total,
        step=step,
        resumed_at=step,
        lineage=lineage,
        validation=validation,
        rss_before_model=rss_before_model,
    )


def validation_use(valid: BatchStore) -> str:
    """Whether the validation slice can choose states and calibrate: "ok"; "none" (no
    slice); or why not: a slice of one class (a day without clicks, one session) has an
    NE of 0 or of thousands and no AUC, so it chooses nothing. Then training runs its
    `epochs` passes, as without a slice, and is not calibrated; the fold-in still runs."""
    if not len(valid):
        return "none"
    rate = valid.click_rate()
    if 0 < rate < 1:
        return "ok"
    rows = sum(valid.record(i).num_rows for i in range(len(valid)))
    what = "no clicks" if rate == 0 else "only clicks"
    return (
        f"one class ({what} in its {rows} rows): no state chosen, not calibrated; "
        "the configured passes trained"
    )


def finish(run: Run) -> dict:
    """The best validated state (and its optimizers) back in place of the last, calibrated
    and folded in; the summary; rank 0 saves the model."""
    cfg, model, valid, early = run.cfg, run.model, run.valid, run.early
    optimizer = run.optimizer_states()
    # the live weights are the best state's only when it was the last, and not a mean
    if early.best_state is not None and (early.best_step != run.step or early.average > 1):
        model.load_state_dict(early.best_state)
        optimizer = early.best_optimizer
    checked = run.parallel.cross_check(model, valid) if run.validating else {}
    calibration = calibrate(model, valid, run.device) if cfg.calibrate and run.validating else {}
    folded = 0
    if cfg.fold_in_validation and len(valid):
        run.opt_sparse.load_state_dict(on_cpu(optimizer["sparse"]))
        folded = fold_in(model, valid, run.opt_sparse, cfg, run.device)
        optimizer = {"dense": optimizer["dense"], "sparse": run.opt_sparse.state_dict()}
    samples, world, seconds = run.samples, run.world, run.seconds
    summary = {
        "train.mode": cfg.mode,
        "train.run": run.checkpoints.run,
        "train.steps": run.step,
        "train.steps_per_epoch": run.per_epoch,
        "train.resumed_from_step": run.resumed_at,
        "train.samples": samples * world,
        "train.samples_per_s": samples * world / seconds if seconds > 0 and samples else 0.0,
        # the same over five stretches of the run: how far the figure moves (compare.py)
        "train.parts_samples_per_s": [
            x * world for x in throughput_parts(run.step_samples, run.step_seconds)
        ],
        "train.loss": float(np.mean(run.losses[-10:])) if run.losses else float("nan"),
        "train.seconds": seconds,
        "train.peak_mem_bytes": peak_mem(run.device),
        # every rank's (a collective): the peak, and what the runtime and batches held first
        "train.peak_mem_bytes_per_rank": every_rank(peak_mem(run.device), world),
        "train.rss_before_model_bytes_per_rank": every_rank(run.rss_before_model, world),
        "train.device": str(run.device),
        "train.world_size": world,
        "train.engine": cfg.engine,
        "train.dedup_groups": {g: len(fs) for g, fs in run.store.groups.items()},
        "train.batch_size": run.store.manifest["batch_size"],
        "train.members": cfg.model.members,
        "train.days": run.days,
        **({"train.window_left_out": run.store.left_out} if run.store.left_out else {}),
        "train.init_from": run.init.uri or "",
        "train.init_reason": run.init.reason,
        "train.lr_dense": run.opt_dense.param_groups[0]["lr"],
        "train.folded_in_samples": folded,
        "train.validation": run.validation,
        **early.summary(),
        **checked,
        **calibration,
    }
    saved = run.parallel.saved_state(
        model,
        run.net,
        optimizer,
        run.opt_sparse,
        cfg,
        run.wh.fs,
        model_base(run.wh, run.checkpoints.run),
    )
    summary.update(saved.figures)
    summary["train.saved_layout"] = "single" if saved.tables is None else "shards"
    if run.rank == 0:
        summary["train.model_uri"] = save_model(
            run.wh,
            run.checkpoints.run,
            model,
            cfg,
            run.store.manifest["prepared"],
            summary,
            saved.optimizer,
            saved.state,
            run.lineage,
            saved.tables,
        )
    return summary


def add_window(wh: Warehouse, store: BatchStore, ds: str, cfg: TrainConfig) -> list[str]:
    """Prepend the batches of the `window_days - 1` days before `ds` that were preprocessed
    alike (same model features and dedup groups) and are not stale (a stale day is left
    out, with why, in `store.left_out`), oldest first; the days trained on."""
    days = [ds]
    first = dt.date.fromisoformat(ds)
    for back in range(1, cfg.window_days):
        day = (first - dt.timedelta(days=back)).isoformat()
        if not wh.exists("batches", day, mode=cfg.mode):
            continue
        stale = staleness(wh, wh.partition_name("batches", day, mode=cfg.mode))
        if stale:  # left out, and said: `train.window_left_out`
            store.left_out[day] = stale.line()
            continue
        older = BatchStore(wh, day, cfg.mode)
        same = older.model_features == store.model_features and older.groups == store.groups
        if same and older.manifest["batch_size"] == store.manifest["batch_size"]:
            store.prepend(older)
            days.insert(0, day)
    return days


def validate(model: Model, valid: BatchStore, device: torch.device) -> dict[str, float]:
    """NE, AUC and calibration of the current weights on the day's validation batches."""

    return score_batches(model, valid, device)


def epoch_order(num_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The batches of an epoch in a seeded order (contiguous rows stay together)."""
    return np.random.default_rng([seed, epoch]).permutation(num_batches)
