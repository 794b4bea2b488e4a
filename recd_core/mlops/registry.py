"""The model registry: every trained model is logged to MLflow and registered; `champion`
moves only when the new model is no worse on the same evaluation day.

The rooms: `pyfunc.py` (the served model: an MLflow pyfunc scoring sample rows),
`versions.py` (logging, registering and reading versions back), `starting_version.py` (which
version training starts from) and this module (the champion decision).

Aliases, per registered model name:

    challenger  the newest trained version (set on every registration)
    champion    the version serving; replaced by the challenger when
                challenger NE <= champion NE + tolerance, both scored on the same day

The decision, both NEs and the day are written as tags on the challenger's version and as
metrics on the pipeline's run. Two cases decide nothing or decide alone:

    no decision   the evaluation day has no clicks (or only clicks): AUC and NE are
                  undefined, so the champion stays, and the reason is recorded
    unreadable    a version whose artifacts are gone or damaged is tagged
                  `recd.unreadable` with the reason; the champion decision then compares
                  against what can be read (an unreadable champion cannot serve: the
                  challenger is promoted), and the warm start falls back to the newest
                  readable ancestor (`recd.init_from`), or to scratch, saying why

so a vanished artifact store never leaves the daily pipeline stuck.
"""

from __future__ import annotations

import numpy as np

from recd_core.leftovers import owned_tempdir
from recd_core.lineage import digest
from recd_core.mlops.pyfunc import example_rows
from recd_core.mlops.versions import (
    Registered,
    Unreadable,
    champion,
    fetch_version,
    last_day_trained,
    log_model,
    log_model_metrics,
    logged_model_of,
    mark_unreadable,
    register,
)
from recd_core.modeling.evaluate import score_day


def decide(challenger_ne: float, champion_ne: float | None, tolerance: float) -> bool:
    """Promote when there is no champion, or the challenger's NE is no worse (lower is better)
    than the champion's on the same day, within `tolerance`."""
    if champion_ne is None:
        return True
    if not np.isfinite(challenger_ne):
        return False
    return bool(challenger_ne <= champion_ne + tolerance)


def undecidable(scored: dict, ds: str) -> str | None:
    """Why an evaluation day cannot judge models (None when it can): without clicks, or
    without non-clicks, AUC is undefined and NE divides by a zero entropy."""
    ctr = scored.get("eval.ctr")
    if ctr == 0:
        return f"the evaluation day {ds} has no clicks: AUC and NE are undefined"
    if ctr == 1:
        return f"the evaluation day {ds} has only clicks: AUC and NE are undefined"
    auc = scored.get("eval.auc")
    if auc is None or not np.isfinite(auc):
        return f"AUC is undefined on the evaluation day {ds}"
    return None


def record_decision(
    tracker,
    reg: Registered,
    promoted: bool,
    ds: str,
    challenger_ne: float,
    champion_ne,
    lineage: dict | None = None,
    decision: str | None = None,
    reason: str = "",
) -> None:
    """The decision as tags of the challenger's version; `lineage` adds where its training
    started (`recd.init_from`: the version it was warm-started from, empty for scratch)."""
    client = tracker.client()
    tags = {
        **(lineage or {}),
        "recd.eval_ds": ds,
        "recd.eval_ne": f"{challenger_ne:.6f}",
        "recd.champion_ne": "" if champion_ne is None else f"{champion_ne:.6f}",
        "recd.decision": decision or ("promoted" if promoted else "kept champion"),
        **({"recd.decision_reason": reason[:500]} if reason else {}),
    }
    for k, v in tags.items():
        client.set_model_version_tag(reg.name, reg.version, k, v)
    if promoted:
        client.set_registered_model_alias(reg.name, "champion", reg.version)


def score_version(tracker, version, warehouse, ds: str, batch_size: int) -> dict:
    """A registered version's metrics on a day, scored from the registry's copy (its own
    transforms and statistics), so the champion is judged on the challenger's day. The
    model directory is loaded by this code, not through the pyfunc's stored entry code, so a
    champion registered by an older recd is judged the same way (as warm start loads it).
    `Unreadable` when its artifacts cannot be read."""

    with owned_tempdir("recd-model-") as tmp:  # a killed run's: swept
        _, (model, meta) = fetch_version(tracker, version, tmp)
        return score_day(warehouse, model, meta, ds, batch_size)


def register_and_promote(
    tracker, warehouse, model_uri: str, run_id: str, eval_ds: str, scored: dict, cfg
) -> dict:
    """Log and register the model saved at `model_uri` (to MLflow run `run_id`) as
    `challenger`; score the current champion on `eval_ds`; move `champion` by NE (`cfg`: the
    pipeline's `RegistryConfig`; `scored`: the challenger's figures on `eval_ds`). A day
    that cannot judge decides nothing; an unreadable champion is passed over (module doc).
    Returns the `registry.*` figures."""
    from recd_core.modeling.saved import model_dir, saved_lineage_key, saved_meta, saved_summary

    trained = saved_summary(model_uri)
    lineage = {
        "recd.init_from": trained.get("train.init_from", ""),
        "recd.init_reason": trained.get("train.init_reason", ""),
        "recd.trained_on": ",".join(trained.get("train.days", [])),
        "recd.lineage_key": saved_lineage_key(model_uri),
    }
    challenger_ne = scored["eval.ne"]
    saved = digest(saved_meta(model_uri))  # this very save of the model (its checksums, all)
    earlier = registered_as(tracker, cfg.model_name, model_uri, saved, eval_ds)
    if earlier is not None:  # a second run of the day: its version stands, nothing added
        return already_registered(tracker, earlier, eval_ds, challenger_ne)
    lineage["recd.model_uri"], lineage["recd.model_digest"] = model_uri, saved
    model_id = logged_model_of(tracker, model_uri)  # the train stage logged it, normally
    if model_id is None:
        with model_dir(model_uri) as local:
            model_id = log_model(
                tracker, run_id, local, example_rows(warehouse, eval_ds), model_uri
            )
    new = register(tracker, run_id, model_id, cfg.model_name)
    current = champion(tracker, cfg.model_name)
    champion_ne, reason = None, undecidable(scored, eval_ds)
    seen = last_day_trained(current) if current is not None else ""
    if reason is None and seen >= eval_ds:  # a backfilled day: the champion learned from it
        reason = (
            f"the champion (version {current.version}) was trained on days up to {seen}: "
            f"it cannot be judged on {eval_ds}"
        )
    if reason is not None:  # the champion stays
        decision, promoted = "no decision", False
    else:
        if current is not None:
            try:
                champion_ne = score_version(
                    tracker, current, warehouse, eval_ds, cfg.eval_batch_size
                )["eval.ne"]
            except Unreadable as e:
                mark_unreadable(tracker, current, str(e))
                reason = f"the champion cannot be read, so it cannot serve: {e}"
        promoted = decide(challenger_ne, champion_ne, cfg.ne_tolerance)
        decision = "promoted" if promoted else "kept champion"
    record_decision(
        tracker, new, promoted, eval_ds, challenger_ne, champion_ne, lineage, decision, reason or ""
    )
    log_model_metrics(tracker, run_id, new.model_id, scored)
    return {
        "registry.model": cfg.model_name,
        "registry.version": int(new.version),
        "registry.promoted": promoted,
        "registry.decision": decision,
        "registry.reason": reason or "",
        "registry.challenger_ne": challenger_ne,
        "registry.champion_ne": champion_ne,
        "registry.previous_champion": None if current is None else int(current.version),
        "registry.eval_ds": eval_ds,
        "registry.init_from": lineage["recd.init_from"],
    }


def registered_as(tracker, name: str, model_uri: str, saved: str, eval_ds: str):
    """The version of `name` that registered this very save of the model at `model_uri`
    (its `recd.model_uri` and `recd.model_digest` tags), judged on `eval_ds`, or None."""
    client = tracker.client()
    found = [
        v
        for v in client.search_model_versions(f"name = '{name}'")
        if v.tags.get("recd.model_uri") == model_uri
        and v.tags.get("recd.model_digest") == saved
        and v.tags.get("recd.eval_ds") == eval_ds
    ]
    return min(found, key=lambda v: int(v.version), default=None)


def already_registered(tracker, version, eval_ds: str, challenger_ne: float) -> dict:
    """The `registry.*` figures of a model registered before (by an earlier run of the same
    day): its version and the decision taken then; the champion is not judged again."""
    current = champion(tracker, version.name)
    tags = version.tags
    was = tags.get("recd.champion_ne", "")
    return {
        "registry.model": version.name,
        "registry.version": int(version.version),
        "registry.promoted": current is not None and str(current.version) == str(version.version),
        "registry.decision": tags.get("recd.decision", ""),
        "registry.reason": (
            f"already registered as version {version.version} by an earlier run of the day "
            f"(the same saved model): {tags.get('recd.decision', '')} then"
        ),
        "registry.challenger_ne": challenger_ne,
        "registry.champion_ne": float(was) if was else None,
        "registry.previous_champion": None,
        "registry.eval_ds": eval_ds,
        "registry.init_from": tags.get("recd.init_from", ""),
        "registry.already_registered": True,
    }
