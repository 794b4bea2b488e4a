"""Which registered model training starts from (the pipelines' warm start): the champion
when it was trained only on days before the run's, else the newest version of the run's own
lineage (a changed model config or feature set), falling back along the warm-start lineage
past unreadable versions, or scratch, always with the reason."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from recd_core.config import PipelineConfig
from recd_core.leftovers import owned_tempdir
from recd_core.mlops.versions import (
    Unreadable,
    champion,
    fetch_version,
    last_day_trained,
    mark_unreadable,
    registry_version,
)


def starting_model(
    tracker, wh, cfg: PipelineConfig, ds: str, mode: str, init_from: str | None = None
) -> contextlib.AbstractContextManager[tuple[str | None, str]]:
    """The pipelines' warm-start decision for a run whose first training day is `ds`:
    `init_from` where given, else the champion when the config's `train.warm_start` is on
    (`init_model`: only a champion trained before `ds`, else the last champion that was,
    so a second run of a day starts where its first did; of another model config, this
    config's own newest version), else scratch. The run's lineage key is computed from the
    day's batches as training sizes the model."""
    from recd_core.dpp.batch_store import model_shape
    from recd_core.modeling.saved import lineage_key

    start = init_from or ("champion" if cfg.train.warm_start else None)
    features, samples = model_shape(wh, ds, mode)
    key = lineage_key(features, cfg.train.model.for_samples(samples))
    return init_model(tracker, start, cfg.registry.model_name, ds, key)


@contextlib.contextmanager
def init_model(
    tracker, init_from: str | None, name: str, before: str | None = None, key: str | None = None
) -> Iterator[tuple[str | None, str]]:
    """Resolve where training starts: yields (a local model directory or None, its label).

    `init_from`: None (scratch), `champion` (the pipelines' warm start: the current champion
    of `name`, when there is one and, with `before` (a day), it was trained only on days
    before it; a champion that saw that day or later would leak the days being trained on
    and evaluated, e.g. in a backfill or a comparison of an older day: the last version
    promoted that was trained before it instead), `models:/<name>@<alias>`
    or `models:/<name>/<version>` (downloaded from the registry), or a model directory /
    `<warehouse>/models/<run>`. The label is what the record shows:
    `models:/<name>/<version>` for a registry copy, or why training starts from scratch.

    `key` (with `champion`): the run's `lineage_key`. When the champion's differs (the model
    config or features changed), training continues the newest version of the run's own
    lineage instead, when there is one: a changed model then accumulates days as the
    champion did, and can win, instead of starting from scratch every day."""
    pinned_champion = False  # the pipelines' warm start: falls back along the lineage
    if not init_from:
        yield None, "from scratch: no model to start from"
        return
    if tracker is not None:
        # every rank of a run reads the registry here (each starts from the same model), not
        # only the rank that records: the store checked first, which initializes a fresh
        # SQLite store under its lock instead of racing the recording rank's initialization
        tracker.check()
    if init_from == "champion":
        if tracker is None:
            yield None, "from scratch: no tracking URI, so no champion to start from"
            return
        current = champion(tracker, name)
        if current is None:
            yield None, f"from scratch: {name} has no champion yet (the first model)"
            return
        if before and last_day_trained(current) >= before:
            # the champion of the day before `before` (a second run of a day whose first
            # run promoted its model, a backfill): the start the day's first run had
            current = last_promoted(tracker, name, before) or current
        theirs = current.tags.get("recd.lineage_key")
        own = (
            newest_of_lineage(tracker, name, key, before)
            if key and theirs not in (None, key)
            else None
        )
        if own is not None:
            current = own
        pinned = f"models:/{name}/{current.version}"  # the version checked, not the alias again
        last = last_day_trained(current)
        if before and last >= before:
            reason = f"the champion ({pinned}) was trained on {last}, not before {before}"
            yield None, f"from scratch: {reason}"
            return
        init_from, pinned_champion = pinned, True
    if not init_from.startswith("models:/"):
        yield init_from, init_from
        return
    if tracker is None:
        raise ValueError(f"--init-from {init_from}: a registry URI needs a tracking URI")
    version = registry_version(tracker, init_from)
    with owned_tempdir("recd-model-") as tmp:  # a killed run's: swept
        if not pinned_champion:
            yield (
                str(fetch_version(tracker, version, tmp)[0]),
                f"models:/{version.name}/{version.version}",
            )
            return
        found, label = readable_ancestor(tracker, version, tmp)
        yield (str(found) if found else None), label


def last_promoted(tracker, name: str, before: str):
    """The newest version of `name` promoted champion (its `recd.decision`) and trained only
    on days before `before`, or None."""
    found = [
        v
        for v in tracker.client().search_model_versions(f"name = '{name}'")
        if v.tags.get("recd.decision") == "promoted" and last_day_trained(v) < before
    ]
    return max(found, key=lambda v: int(v.version), default=None)


def newest_of_lineage(tracker, name: str, key: str, before: str | None = None):
    """The newest version of `name` whose `recd.lineage_key` is `key` (the same model
    features and model config) and, with `before`, trained only on days before it; or None."""
    found = [
        v
        for v in tracker.client().search_model_versions(f"name = '{name}'")
        if v.tags.get("recd.lineage_key") == key and not (before and last_day_trained(v) >= before)
    ]
    return max(found, key=lambda v: int(v.version), default=None)


def readable_ancestor(tracker, version, tmp: str) -> tuple[Path | None, str]:
    """The newest readable model along `version`'s warm-start lineage (itself, then the
    version it was warm-started from, ...), downloaded into `tmp`: (its directory, its
    label), or (None, why training starts from scratch). Unreadable ones are tagged."""
    client, skipped = tracker.client(), []
    seen: set[str] = set()
    while version is not None and version.version not in seen:
        seen.add(version.version)
        try:
            found, _ = fetch_version(tracker, version, tmp)
        except Unreadable as e:
            mark_unreadable(tracker, version, str(e))
            skipped.append(str(e))
            version = _lineage_parent(client, version)
            continue
        label = f"models:/{version.name}/{version.version}"
        return found, label + (f" (instead of: {'; '.join(skipped)})" if skipped else "")
    return None, f"from scratch: no readable model in the champion's lineage ({'; '.join(skipped)})"


def _lineage_parent(client, version):
    """The version `version` was warm-started from (its `recd.init_from`), or None."""
    ref = version.tags.get("recd.init_from", "").split(" ", 1)[0].removeprefix("models:/")
    if "/" not in ref or "@" in ref:
        return None
    try:
        return client.get_model_version(*ref.rsplit("/", 1))
    except Exception:  # noqa: BLE001 - a deleted version ends the lineage
        return None
