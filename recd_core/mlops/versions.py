"""What the registry holds: a trained model logged as an MLflow 3 LoggedModel of its train run,
registered as a version of the model (aliased `challenger`), its figures linked to it; and
reading versions back (the champion, a version a `models:/` URI names, a version's model
downloaded and loaded, or `Unreadable` with why, tagged on the version)."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlflow.artifacts
import mlflow.exceptions
import pyarrow as pa

from recd_core.errors import BadInput, first_line
from recd_core.leftovers import owned_tempdir
from recd_core.mlops.metric_names import metric_name
from recd_core.mlops.pyfunc import save_pyfunc
from recd_core.mlops.tracking import numeric

MODEL_ARTIFACT = "model"
MODEL_URI_TAG = "recd.model_uri"  # on a LoggedModel: the trained model it holds


@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    artifact_uri: str
    model_id: str  # the LoggedModel


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
            run.info.experiment_id,
            name=name,
            source_run_id=run_id,
            model_type="recd-dlrm",
            tags={MODEL_URI_TAG: model_uri},
        )
        try:
            client.log_model_artifacts(logged.model_id, str(target))
        except Exception:
            client.finalize_logged_model(logged.model_id, "FAILED")
            raise
        client.finalize_logged_model(logged.model_id, "READY")
    link_output(tracker, run_id, logged.model_id)
    return logged.model_id


def link_output(tracker, run_id: str, model_id: str) -> None:
    """The LoggedModel as an output of run `run_id`: its page lists it ("Logged models")."""
    from mlflow.entities import LoggedModelOutput

    tracker.client().log_outputs(run_id, [LoggedModelOutput(model_id, 0)])


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

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    figures = numeric({k: v for k, v in scored.items() if k.startswith("eval.")})
    metrics = [Metric(metric_name(k), v, now, 0, model_id=model_id) for k, v in figures.items()]
    tracker.client().log_batch(run_id, metrics=metrics)


def champion(tracker, name: str):
    """The version aliased `champion`, or None."""
    client = tracker.client()
    try:
        return client.get_model_version_by_alias(name, "champion")
    except mlflow.exceptions.MlflowException:
        return None


def last_day_trained(version) -> str:
    """The last day a version trained on (its `recd.trained_on` tag; "" when untagged)."""
    return max((d for d in version.tags.get("recd.trained_on", "").split(",") if d), default="")


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
        tracker.client().set_model_version_tag(
            version.name, version.version, "recd.unreadable", reason[:500]
        )


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
