"""Where training starts: a saved model (the pipelines pass the champion) or scratch.

A saved model's weights are the starting point when its feature set and model config equal
this run's, else training starts from scratch and says why (`Init.reason`, the summary's
`train.init_reason`). Its optimizer state (`optimizer.pt`) is continued too, as incremental
training does: a restarted Adam and Adagrad take full-size first steps on every row and undo
much of yesterday's model.
Ids never seen before still start at full speed (their Adagrad accumulator is zero)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from recd_core.config import FeatureSet, TrainConfig
from recd_core.errors import first_line
from recd_core.modeling.model import Model
from recd_core.modeling.saved import (
    CheckpointError,
    ModelError,
    read_optimizer,
    read_saved,
    saved_tables,
    saved_train_config,
    torch_load,
)
from recd_core.modeling.shard_files import LazyAccumulator, is_sharded


@dataclass(frozen=True)
class Init:
    """Where training starts: a saved model's weights (warm start) or scratch, and why;
    with a warm start, the saved optimizer state when the model has one."""

    state: dict | None
    uri: str | None
    reason: str
    optimizer: dict | None = None
    trained_days: tuple[str, ...] = ()  # the days the saved model had trained on


def initial_state(
    init_from: str | None, features: FeatureSet, cfg: TrainConfig, label: str | None = None
) -> Init:
    """The weights of the model at `init_from` (a `<warehouse>/models/<run>` URI or a local
    directory with model.pt + model.json, and its shard files if it has them) when it was
    trained on the same model features with the same model config; otherwise scratch, with
    the reason. `label` names the model in the record (e.g. `models:/recd-dlrm/3`)."""
    if not init_from:
        return Init(None, None, label or "from scratch: no model to start from")
    try:
        meta, weights, where = read_saved(init_from)
    except (OSError, ValueError, KeyError, ModelError) as e:
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
    state, optimizer = torch_load(weights, where, "model"), read_optimizer(init_from, meta)
    if is_sharded(meta):  # the tables stay in their files until a placement reads its rows
        state, optimizer = with_tables(saved_tables(init_from, meta), state, optimizer)
    return Init(state, name, f"warm start from {name}", optimizer, tuple(trained_days(meta)))


def with_tables(tables: dict, state: dict, optimizer: dict | None) -> tuple[dict, dict | None]:
    """A sharded layout's model.pt and optimizer.pt completed with its shard files' tables
    and accumulators (lazy: read when placed), in the single-process layout's keys. Saved
    with an optimizer, every table must have its accumulators: continuing Adagrad from
    zeros would take full-size steps on every row (refused, one line)."""
    state = {**state, **tables}
    if optimizer is not None:
        bare = [k for k, t in tables.items() if any(s.accumulators is None for s in t.shards)]
        if bare:
            raise ModelError(
                f"the model's optimizer.pt continues its tables, but model.json "
                f"names no accumulators for {', '.join(bare[:3])}: a damaged copy"
            )
        accs = {i: {"sum": LazyAccumulator(t)} for i, t in enumerate(tables.values())}
        optimizer = {**optimizer, "sparse": {**optimizer["sparse"], "state": accs}}
    return state, optimizer


def starting_model(build: Callable[[], Model], init: Init, click_rate: float) -> tuple[Model, Init]:
    """A model from `build()` at its starting point, uncalibrated (training fits the raw
    logit; a warm start's calibration is fitted again): `init`'s weights loaded, or, when
    they do not fit this model (saved by another version of the model code), a fresh one
    (the load may have written part of the first), its output bias at `click_rate`."""
    model = build()
    if init.state is not None:
        try:
            model.load_state_dict(init.state)
        except RuntimeError as e:
            reason = f"from scratch: the saved weights do not fit this model ({first_line(e, 120)})"
            init = Init(None, None, reason)
            model = build()
    if init.state is None:
        model.init_output_bias(click_rate)
    model.reset_calibration()
    return model, init


def trained_days(meta: dict) -> list[str]:
    """The days a saved model trained on, its warm starts' included (model.json's lineage;
    a model saved before lineage was recorded: its own run's days)."""
    days = (meta.get("lineage") or {}).get("trained_days")
    return sorted(days if days is not None else meta.get("summary", {}).get("train.days", []))


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
