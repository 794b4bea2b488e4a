"""The model registry: every trained model is logged to MLflow and registered; `champion`
moves only when the new model is no worse on the same evaluation day.

A registered version is an MLflow pyfunc that scores *sample rows* (a DataFrame with the
feature columns of `samples/`), not a `torch.nn.Module` fed tensors: the DLRM takes a
deduplicated sparse `Batch`, which DPP builds from rows with the training run's own
transforms and statistics. So the logged model carries the state dict, `model.json` (those
transforms, statistics and the dedup plan) and the `recd_core` code, with a signature and an
input example; `mlflow.pyfunc.load_model("models:/recd-dlrm@champion").predict(rows)`
returns click probabilities. Nothing is pickled: the model is logged "from code"
(`mlops/mlflow_model.py`), and the state dict inside is plain `torch.save` of tensors, loaded
with `weights_only=True`.

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

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlflow.artifacts
import mlflow.pyfunc
import numpy as np
import pandas as pd
import pyarrow as pa

import recd_core
from recd_core.errors import BadInput, first_line
from recd_core.leftovers import owned_tempdir
from recd_core.schema import events_schema

MODEL_ARTIFACT = "model"
MODEL_URI_TAG = "recd.model_uri"  # on a LoggedModel: the trained model it holds
EXAMPLE_ROWS = 5
NON_FEATURE_COLUMNS = ("event_id", "ts", "label")


class SampleScorer(mlflow.pyfunc.PythonModel):
    """Click probabilities for sample rows (one DataFrame row per impression).

    Served input is checked as ingest checks events (finite dense values of the right
    width, ids in range, list lengths): a bad request is refused whole, a 400 naming the row
    and the field, and no response ever carries a stack trace (an unexpected failure is a
    500 that says to look in the server's log, where the traceback goes)."""

    def load_context(self, context) -> None:
        from recd_core.modeling.saved import load_model

        self.model, self.meta = load_model(context.artifacts["dlrm"])
        self.features = samples_features(self.meta)
        self.schema = events_schema(self.features)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> np.ndarray:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE

        from recd_core.data.ingest import first_failure, semantic_checks
        from recd_core.modeling.saved import predict

        try:
            table = rows_table(model_input, self.schema)
        except ValueError as e:
            raise MlflowException(str(e), INVALID_PARAMETER_VALUE) from None
        bad, fields, reasons = first_failure(table.num_rows, semantic_checks(table, self.features))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise MlflowException(f"scoring input row {row}: {reasons[row].as_py()} "
                                  f"({int(bad.sum())} row(s) refused)", INVALID_PARAMETER_VALUE)  # fmt: skip
        try:
            return predict(self.model, self.meta, table, trust_sessions=False).astype(np.float64)
        except Exception as e:  # noqa: BLE001 - the traceback to the log, not to the client
            logging.getLogger("recd.serving").exception("scoring failed")
            raise MlflowException(f"scoring failed ({type(e).__name__}); the server log has "
                                  "the details", INTERNAL_ERROR) from None  # fmt: skip


def rows_table(frame: pd.DataFrame, schema: pa.Schema) -> pa.Table:
    """A scoring DataFrame as a samples table: the model's feature columns, typed as in the
    warehouse; columns it does not use are ignored; a missing one is an error naming it."""
    missing = [
        f.name for f in schema if f.name not in frame.columns and f.name not in NON_FEATURE_COLUMNS
    ]
    if missing:
        raise ValueError(f"scoring input lacks feature column(s): {', '.join(missing)}")
    n = len(frame)
    cols = {}
    for f in schema:
        if f.name in frame.columns:
            cols[f.name] = _column(frame[f.name], f)
        elif f.name == "label":
            cols[f.name] = pa.array(np.zeros(n, np.int8), type=f.type)
        else:  # event_id, ts, and a session id that scoring never trusts
            cols[f.name] = pa.array(np.arange(n), type=f.type)
    return pa.table(cols, schema=schema)


def _column(values: pd.Series, field: pa.Field) -> pa.Array:
    """One scoring column typed as in the warehouse; float64 input (JSON numbers) is narrowed
    to the warehouse's float32, any other mismatch is an error naming the column."""
    try:
        if field.type == pa.float32() or (
            pa.types.is_list(field.type) and field.type.value_type == pa.float32()
        ):
            wide = pa.float64() if field.type == pa.float32() else pa.list_(pa.float64())
            return pa.array(list(values), type=wide).cast(field.type)
        return pa.array(list(values), type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
        raise ValueError(f"scoring input column {field.name!r}: {e}") from None


def scoring_example(samples: pa.Table) -> pd.DataFrame:
    """The input example: the first rows of a samples table, features only. Float columns
    are widened to float64 so the signature says `double`: a served request's JSON numbers
    arrive as float64, which MLflow will not narrow to a `float` column (rows_table casts
    them back to the warehouse's float32)."""
    keep = [c for c in samples.column_names if c not in NON_FEATURE_COLUMNS]
    rows = samples.slice(0, EXAMPLE_ROWS).select(keep)
    for i, f in enumerate(rows.schema):
        if f.type == pa.float32():
            rows = rows.set_column(i, f.name, rows[f.name].cast(pa.float64()))
        elif pa.types.is_list(f.type) and f.type.value_type == pa.float32():
            rows = rows.set_column(i, f.name, rows[f.name].cast(pa.list_(pa.float64())))
    return rows.to_pandas()


@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    artifact_uri: str
    model_id: str  # the LoggedModel


def save_pyfunc(model_dir: Path, samples: pa.Table, target: Path) -> None:
    """The trained model at `model_dir` as an MLflow pyfunc directory at `target` (model from
    code, signature and input example from `samples`): what `log_model` logs, and what
    `mlflow models serve -m <target>` serves without a tracking server."""
    import torch
    from mlflow.models import infer_signature

    example = scoring_example(samples)
    scorer = SampleScorer()  # loaded as MLflow will load it, to sign what it returns
    scorer.load_context(SimpleNamespace(artifacts={"dlrm": str(model_dir)}))
    signature = infer_signature(example, scorer.predict(None, example))
    mlflow.pyfunc.save_model(
        path=str(target),
        python_model=str(Path(__file__).with_name("mlflow_model.py")),
        artifacts={"dlrm": str(model_dir)},
        code_paths=[str(Path(recd_core.__file__).parent)],
        signature=signature,
        input_example=example,
        pip_requirements=[
            f"torch=={torch.__version__.split('+')[0]}",
            f"pyarrow=={pa.__version__}",
            f"pandas=={pd.__version__}",
            f"numpy=={np.__version__}",
            "pydantic>=2",
            "pyyaml",
        ],
    )


def log_model(tracker, run_id: str, model_dir: Path, samples: pa.Table, model_uri: str) -> str:
    """The trained model as an MLflow 3 LoggedModel of its train run (a pyfunc with signature
    and input example, tagged `recd.model_uri`): the experiment's Models tab lists it, with
    the figures `log_model_metrics` links to it. Returns its model id."""
    client = tracker.client()
    run = client.get_run(run_id)
    with owned_tempdir("recd-model-") as tmp:  # a killed run's: swept
        target = Path(tmp) / MODEL_ARTIFACT
        save_pyfunc(model_dir, samples, target)
        # named for the arm and the day: the Models tab lists a comparison's two models apart
        name = "-".join(["dlrm", *(v for k in ("mode", "ds") if (v := run.data.tags.get(k)))])
        logged = client.create_logged_model(
            run.info.experiment_id, name=name, source_run_id=run_id,
            model_type="recd-dlrm", tags={MODEL_URI_TAG: model_uri},
        )  # fmt: skip
        try:
            client.log_model_artifacts(logged.model_id, str(target))
        except Exception:
            client.finalize_logged_model(logged.model_id, "FAILED")
            raise
        client.finalize_logged_model(logged.model_id, "READY")
    from mlflow.entities import LoggedModelOutput

    # the train run's output: its page lists the model ("Logged models")
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, 0)])
    return logged.model_id


def logged_model_of(tracker, model_uri: str) -> str | None:
    """The LoggedModel of the trained model at `model_uri` (its train run logged it), if any."""
    client = tracker.client()
    exp = client.get_experiment_by_name(tracker.experiment)
    if exp is None:
        return None
    found = client.search_logged_models(
        [exp.experiment_id], filter_string=f"tags.`{MODEL_URI_TAG}` = '{model_uri}'", max_results=1
    )
    return found[0].model_id if found else None


def example_rows(warehouse, ds: str) -> pa.Table:
    """The first sample rows of day `ds`, the logged model's input example (only the row
    groups that hold them are read)."""
    return warehouse.read_range("samples", ds, 0, EXAMPLE_ROWS, layout="clustered")


def register(tracker, run_id: str, model_id: str, name: str) -> Registered:
    """Register the LoggedModel `model_id` (of train run `run_id`) as a new version of
    `name`, aliased `challenger`."""
    client = tracker.client()
    # the store's own location of the model's files (a `models:/<id>` source would make
    # the registry look the model up through the process's default tracking URI)
    source = client.get_logged_model(model_id).artifact_location
    try:
        client.get_registered_model(name)
    except mlflow.exceptions.MlflowException:
        client.create_registered_model(name, description="recd DLRM: scores sample rows")
    version = client.create_model_version(
        name, source, run_id=run_id, tags={"recd.model_id": model_id}, model_id=model_id
    ).version
    # the link MLflow's UI follows from the model to its versions (as `register_model` sets it)
    client.set_logged_model_tags(
        model_id, {"mlflow.modelVersions": json.dumps([{"name": name, "version": version}])}
    )
    client.set_registered_model_alias(name, "challenger", version)
    return Registered(name, str(version), source, model_id)


def log_model_metrics(tracker, run_id: str, model_id: str, scored: dict) -> None:
    """The model's next-day figures, linked to its LoggedModel (the Models tab's columns)."""
    import time

    from mlflow.entities import Metric

    from recd_core.mlops.tracking import numeric

    now = int(time.time() * 1000)
    figures = numeric({k: v for k, v in scored.items() if k.startswith("eval.")})
    metrics = [Metric(k, v, now, 0, model_id=model_id) for k, v in figures.items()]
    tracker.client().log_batch(run_id, metrics=metrics)


def samples_features(meta: dict):
    from recd_core.config import FeatureSet

    return FeatureSet.model_validate(meta["prepared"]["raw"])


def champion(tracker, name: str):
    """The version aliased `champion`, or None."""
    client = tracker.client()
    try:
        return client.get_model_version_by_alias(name, "champion")
    except mlflow.exceptions.MlflowException:
        return None


def _last_day_trained(version) -> str:
    return max((d for d in version.tags.get("recd.trained_on", "").split(",") if d), default="")


def newest_of_lineage(tracker, name: str, key: str, before: str | None = None):
    """The newest version of `name` whose `recd.lineage_key` is `key` (the same model
    features and model config) and, with `before`, trained only on days before it; or None."""
    found = [
        v
        for v in tracker.client().search_model_versions(f"name = '{name}'")
        if v.tags.get("recd.lineage_key") == key and not (before and _last_day_trained(v) >= before)
    ]
    return max(found, key=lambda v: int(v.version), default=None)


@contextlib.contextmanager
def init_model(
    tracker, init_from: str | None, name: str, before: str | None = None, key: str | None = None
) -> Iterator[tuple[str | None, str]]:
    """Resolve where training starts: yields (a local model directory or None, its label).

    `init_from`: None (scratch), `champion` (the pipelines' warm start: the current champion
    of `name`, when there is one and, with `before` (a day), it was trained only on days
    before it; a champion that saw that day or later would leak the days being trained on
    and evaluated, e.g. in a backfill or a comparison of an older day), `models:/<name>@<alias>`
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
    if init_from == "champion":
        if tracker is None:
            yield None, "from scratch: no tracking URI, so no champion to start from"
            return
        current = champion(tracker, name)
        if current is None:
            yield None, f"from scratch: {name} has no champion yet (the first model)"
            return
        theirs = current.tags.get("recd.lineage_key")
        own = (
            newest_of_lineage(tracker, name, key, before)
            if key and theirs not in (None, key)
            else None
        )
        if own is not None:
            current = own
        pinned = f"models:/{name}/{current.version}"  # the version checked, not the alias again
        last = _last_day_trained(current)
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


class Unreadable(BadInput):
    """A registered version whose artifacts cannot be read (gone, damaged, not a recd
    model): named with why; a retry cannot bring them back."""


def fetch_version(tracker, version, tmp: str) -> tuple[Path, tuple]:
    """A registered version's recd model, downloaded into a folder of its own under `tmp`
    and loaded, which proves it readable: its directory and `load_model`'s (model, meta).
    `Unreadable`, with a one-line reason, otherwise."""
    from recd_core.modeling.saved import load_model

    where = f"models:/{version.name}/{version.version}"
    try:
        dst = Path(tmp) / f"v{version.version}"
        dst.mkdir(parents=True, exist_ok=True)
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=version.source, dst_path=str(dst), tracking_uri=tracker.uri
        )
        found = next(Path(local).rglob("model.json"), None)
        if found is None:
            raise Unreadable(f"{where} holds no recd model (model.json)")
        return found.parent, load_model(str(found.parent))
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001 - MLflow, the OS and torch raise many kinds
        first = first_line(e, 200, type(e).__name__)
        raise Unreadable(f"{where} cannot be read ({type(e).__name__}: {first})") from None


def mark_unreadable(tracker, version, reason: str) -> None:
    """Tag a version as unreadable (the registry UI shows why), best effort."""
    with contextlib.suppress(Exception):
        tracker.client().set_model_version_tag(version.name, version.version,
                                               "recd.unreadable", reason[:500])  # fmt: skip


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


def registry_version(tracker, uri: str):
    """The model version a `models:/<name>@<alias>` or `models:/<name>/<version>` names."""
    client = tracker.client()
    ref = uri.removeprefix("models:/")
    try:
        if "@" in ref:
            model_name, alias = ref.split("@", 1)
            return client.get_model_version_by_alias(model_name, alias)
        model_name, number = ref.rsplit("/", 1)
        return client.get_model_version(model_name, number)
    except (mlflow.exceptions.MlflowException, ValueError) as e:
        first = first_line(e, 160)
        raise ValueError(f"--init-from {uri}: no such registered model version ({first})") from None


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
    from recd_core.modeling.evaluate import score_day

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
    from recd_core.modeling.saved import model_dir, saved_lineage_key, saved_summary

    trained = saved_summary(model_uri)
    lineage = {
        "recd.init_from": trained.get("train.init_from", ""),
        "recd.init_reason": trained.get("train.init_reason", ""),
        "recd.trained_on": ",".join(trained.get("train.days", [])),
        "recd.lineage_key": saved_lineage_key(model_uri),
    }
    challenger_ne = scored["eval.ne"]
    model_id = logged_model_of(tracker, model_uri)  # the train stage logged it, normally
    if model_id is None:
        with model_dir(model_uri) as local:
            model_id = log_model(tracker, run_id, local, example_rows(warehouse, eval_ds),
                                 model_uri)  # fmt: skip
    new = register(tracker, run_id, model_id, cfg.model_name)
    current = champion(tracker, cfg.model_name)
    champion_ne, reason = None, undecidable(scored, eval_ds)
    seen = _last_day_trained(current) if current is not None else ""
    if reason is None and seen >= eval_ds:  # a backfilled day: the champion learned from it
        reason = (f"the champion (version {current.version}) was trained on days up to {seen}: "
                  f"it cannot be judged on {eval_ds}")  # fmt: skip
    if reason is not None:  # the champion stays
        decision, promoted = "no decision", False
    else:
        if current is not None:
            try:
                champion_ne = score_version(tracker, current, warehouse, eval_ds,
                                            cfg.eval_batch_size)["eval.ne"]  # fmt: skip
            except Unreadable as e:
                mark_unreadable(tracker, current, str(e))
                reason = f"the champion cannot be read, so it cannot serve: {e}"
        promoted = decide(challenger_ne, champion_ne, cfg.ne_tolerance)
        decision = "promoted" if promoted else "kept champion"
    record_decision(tracker, new, promoted, eval_ds, challenger_ne, champion_ne, lineage,
                    decision, reason or "")  # fmt: skip
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
