"""MLflow run records: one run per command, in the experiment `recd` (or the one given).

A run holds the command's arguments as params, the numeric figures of its summary as
metrics, once each and named by section (metric_names.py: `storage/bytes`,
`dpp/samples_per_s`, `train/samples_per_s`, `eval/ne`, ...), tags that make the UI comparison easy (`recd.stage`, `mode`, `ds`), system
facts, and the whole summary as `summary.json`. Uses an explicit `MlflowClient` (no global
MLflow state). The store is checked before the stage runs, so a store that cannot take the
record fails the command at once instead of after the work: an HTTP server is probed with a
short timeout; a SQLite database must open for writing (MLflow itself would retry for almost
two minutes, warning at every try).

A run opened and closed by one process (a command's, a stage's) is tagged `recd.owner`
(host, pid and the process's start time). If that process dies, or the server goes away
before the run is closed, the run would stay RUNNING for ever; the next command that opens
a run on the same host closes such runs FAILED (`recd.status` = abandoned). The pipeline run
of an orchestrator (`start` ... `finish`, tasks in separate processes) has no owner tag.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import platform
import re
import socket
import sqlite3
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from recd_core.errors import TrackingError, TrackingStoreUnwritable
from recd_core.mlops.metric_names import metric_name, once_each
from recd_core.mlops.run_notes import comparison_note, daily_outcome, load_1m
from recd_core.runtime import cpu_budget

MAX_PARAM = 500
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"


@dataclass(frozen=True)
class Tracker:
    uri: str
    experiment: str = "recd"
    timeout_s: float = 5.0
    # a SQLite store locked by another writer: waited for with backoff (1, 2, 4 ... 16 s)
    # this long, then TrackingError (exit 4, retryable): a lock passes, a retry may succeed
    lock_wait_s: float = 60.0

    def check(self) -> None:
        """Fail fast, with the URI named, if the store cannot take a run record. A SQLite
        store is initialized here, once: MLflow creates and migrates its schema on first
        use, and two commands doing that at once on a fresh file collide (a duplicate
        column, an alembic version mismatch), so the first holds a lock beside the file
        while the others wait for it."""
        if self.uri.startswith("sqlite:///"):
            path = self.uri.removeprefix("sqlite:///")
            self._check_sqlite(path)
            self._init_sqlite(path)
        if not self.uri.startswith(("http://", "https://")):
            return
        try:
            with urllib.request.urlopen(
                f"{self.uri.rstrip('/')}/health", timeout=self.timeout_s
            ) as r:
                if r.status >= 400:
                    raise TrackingError(f"tracking server {self.uri} answered HTTP {r.status}")
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise TrackingError(f"tracking server {self.uri} is unreachable ({reason})") from None

    def _check_sqlite(self, path: str) -> None:
        """Open the database and make a write that is rolled back (creating the file, as
        MLflow would, when it is missing): a read-only file, or a directory where the
        rollback journal cannot be created, fails here."""
        if path in ("", ":memory:"):
            return
        t0, delay = time.monotonic(), 1.0
        while True:
            try:
                con = sqlite3.connect(path, timeout=self.timeout_s)
                try:
                    con.isolation_level = None  # explicit transaction: DDL is rolled back too
                    con.execute("BEGIN IMMEDIATE")
                    con.execute("CREATE TABLE recd_write_probe (x)")
                    con.execute("ROLLBACK")
                finally:
                    con.close()
                return
            except sqlite3.OperationalError as e:  # locked by another writer: wait, retry
                if "locked" not in str(e) and "busy" not in str(e):
                    raise self._unwritable(path, e) from None
                waited = time.monotonic() - t0
                if waited >= self.lock_wait_s:
                    raise TrackingError(
                        f"tracking store {self.uri} stayed locked for {waited:.0f} s ({e}): "
                        "another process holds it; retry"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 16.0)
            except sqlite3.Error as e:
                raise self._unwritable(path, e) from None

    def _unwritable(self, path: str, e: Exception) -> TrackingStoreUnwritable:
        where = Path(path).resolve()
        return TrackingStoreUnwritable(
            f"tracking store {self.uri} cannot be written ({e}: {where})"
        )

    def _init_sqlite(self, path: str) -> None:
        """MLflow's schema in a SQLite store, created or migrated by one process at a time."""

        if path in ("", ":memory:"):
            return
        lock = Path(f"{path}.recd-init.lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:  # a directory we cannot write: _check_sqlite said so already
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with self._errors():
                self.client().search_experiments(max_results=1)  # the store, initialized
        finally:
            os.close(fd)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def experiment_id(self, client) -> str:
        """The experiment's id, created on first use. With a SQLite store the artifacts live
        beside the database (`mlartifacts/`), not in the working directory."""
        exp = client.get_experiment_by_name(self.experiment)
        if exp:
            if exp.tags.get(KIND_TAG) != KIND:  # an experiment from before the tag
                client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
            return exp.experiment_id
        location = None
        if self.uri.startswith("sqlite:///"):
            db = Path(self.uri.removeprefix("sqlite:///"))
            location = (db.parent.resolve() / "mlartifacts").as_uri()
        # a model-training experiment: the UI opens its runs, not the GenAI (traces) view
        return client.create_experiment(
            self.experiment, artifact_location=location, tags={KIND_TAG: KIND}
        )

    def start(
        self,
        stage: str,
        params: dict,
        parent_id: str | None = None,
        owned: bool = False,
        run_name: str | None = None,
        **tags,
    ) -> str:
        """Open a run (status RUNNING) for a stage; returns its id. Children of a pipeline
        run carry `mlflow.parentRunId`, so the UI nests them under it. `owned`: this process
        closes it (tagged `recd.owner`, see the module doc). `run_name`: what the runs
        table shows (default: the stage, its day and arm)."""
        from mlflow.entities import Param, RunTag

        with self._errors():
            client = self.client()
            run_tags = {
                "recd.stage": stage,
                "mode": str(params.get("mode", "")),
                "ds": str(params.get("ds") or ""),
                "recd.version": "0.1.0",
                **{k: str(v) for k, v in tags.items()},
            }
            if parent_id:
                run_tags["mlflow.parentRunId"] = parent_id
            if owned:
                run_tags[OWNER_TAG] = process_owner()
            name = run_name or " ".join(x for x in (stage, run_tags["ds"], run_tags["mode"]) if x)
            run = client.create_run(self.experiment_id(client), run_name=name, tags=run_tags)
            facts = {
                "sys.python": platform.python_version(),
                "sys.machine": platform.machine(),
                **conditions(),
                **_torch_facts(),
            }
            plist = [
                Param(k, str(v)[:MAX_PARAM])
                for k, v in {**params, **facts}.items()
                if v is not None and k not in PLUMBING
            ]
            client.log_batch(run.info.run_id, params=plist, tags=[RunTag("recd.status", "running")])
            return run.info.run_id

    def finish(self, run_id: str, summary: dict) -> None:
        """Record the stage's figures (metrics), its summary, tags known only at the end
        (mode, ds, status) and the files the summary lists under `artifacts` (plots,
        tables), then close the run."""
        from mlflow.entities import Metric, Param, RunTag

        with self._errors():
            client = self.client()
            status = str(summary.get("status", "ok"))
            tags = [RunTag("recd.status", status)]
            run = client.get_run(run_id)
            known = run.data.tags
            # the arms in the order the pipeline ran them (dedup first)
            arms = list(
                dict.fromkeys(str(v) for k, v in summary.items() if k.startswith("train.mode."))
            )
            late = {
                "mode": summary.get("train.mode", summary.get("dpp.mode")),
                "ds": summary.get("run.ds"),
            }
            tags += [RunTag(k, str(v)) for k, v in late.items() if v and not known.get(k)]
            if len(arms) > 1:  # a comparison: named for what it holds, no single arm
                span = " → ".join(
                    str(summary[k]) for k in ("run.ds", "run.eval_ds") if summary.get(k)
                )
                tags += [
                    RunTag("mode", "+".join(arms)),
                    RunTag("mlflow.runName", f"{' vs '.join(arms)} {span}".strip()),
                ]
            days = sorted({d for k, v in summary.items() for d in _days_of(k, v)})
            if days:
                tags.append(RunTag("recd.days", ",".join(days)))
            now = int(time.time() * 1000)
            given = settings(summary)  # hyperparameters and yes/no facts: params, not metrics
            figures = once_each({k: v for k, v in numeric(summary).items() if k not in given}, arms)
            # the answer first: the UI lists a run's metrics in the order they were logged
            first = [k for k in figures if headline_rank(k) is not None]
            order = sorted(first, key=headline_rank) + [k for k in figures if k not in first]
            if len(arms) > 1:  # the comparison: the answer alone; the rest in its stage runs
                order = [
                    k
                    for k in order
                    if (k in first or k.startswith(COMPARISON_KEYS))
                    and not _duplicate_of_arm(k, figures, arms)
                ]
            # the run's description (its page's first lines): the answer, a failure first
            notes = [comparison_note(summary)] if len(arms) > 1 else []
            if len(arms) <= 1 and known.get("recd.stage") in ("pipeline", "run"):
                notes = [daily_outcome(summary)]
            if status == "failed":  # where users look: the tags and the description
                stage, error = summary.get("failed_stage"), str(summary.get("error", ""))
                tags += [RunTag("recd.error", error[:5000])]
                tags += [RunTag("recd.failed_stage", str(stage))] if stage else []
                # the reason names its stage already ("generate: no partition ...")
                notes.insert(0, f"**Failed** at {error}" if stage else f"**Failed**: {error}")
            if any(notes):
                tags.append(RunTag("mlflow.note.content", "\n\n".join(filter(None, notes))))
            tags.append(RunTag("sys.load_1m_end", load_1m()))
            known_params = run.data.params
            params = [Param(k, v[:MAX_PARAM]) for k, v in given.items() if k not in known_params]
            for lo in range(0, len(params), 90):  # MLflow caps a batch at 100 params
                client.log_batch(run_id, params=params[lo : lo + 90])
            metrics = [Metric(metric_name(k), figures[k], now, 0) for k in order]
            metrics += [
                Metric(metric_name(k), v, now, step)
                for k, step, v in (*histories(summary), *by_day(summary))
                if math.isfinite(v)
            ]
            for lo in range(0, max(len(metrics), 1), 900):  # MLflow caps a batch at 1000
                client.log_batch(
                    run_id, metrics=metrics[lo : lo + 900], tags=tags if lo == 0 else []
                )
            client.log_dict(run_id, summary, "summary.json")
            for path in summary.get("artifacts", ()):
                if Path(path).exists():
                    client.log_artifact(run_id, str(path))
            client.set_terminated(run_id, "FINISHED" if status == "ok" else "FAILED")

    def log_inputs(self, run_id: str, inputs: list[dict]) -> None:
        """The partitions a run read, as MLflow datasets (the run page's Datasets): each a
        dict with `name`, `uri`, `digest`, `rows`, `schema` (JSON) and `context`
        (training, evaluation)."""

        from mlflow.entities import Dataset, DatasetInput, InputTag

        datasets = [
            DatasetInput(
                Dataset(
                    name=i["name"],
                    digest=i["digest"],
                    source_type="recd-warehouse",
                    source=json.dumps({"uri": i["uri"]}),
                    schema=i.get("schema"),
                    profile=json.dumps({"num_rows": i["rows"]}),
                ),
                tags=[InputTag("mlflow.data.context", i["context"])],
            )
            for i in inputs
        ]
        with self._errors():
            self.client().log_inputs(run_id, datasets=datasets)

    def close_abandoned(self) -> int:
        """Close FAILED the RUNNING runs whose owner process on this host is gone (module
        doc); how many. Best effort: a store that cannot answer closes nothing."""
        try:
            client = self.client()
            exp = client.get_experiment_by_name(self.experiment)
            if exp is None:
                return 0
            host = socket.gethostname()
            runs = client.search_runs(
                [exp.experiment_id],
                f"attributes.status = 'RUNNING' and tags.`{OWNER_TAG}` LIKE '{host}:%'",
                max_results=1000,
            )
            closed = 0
            for run in runs:
                owner = run.data.tags.get(OWNER_TAG, "")
                if owner_alive(owner):
                    continue
                client.set_tag(run.info.run_id, "recd.status", "abandoned")
                client.set_tag(
                    run.info.run_id,
                    "recd.error",
                    f"abandoned: its process ({owner}) ended without closing it",
                )
                client.set_terminated(run.info.run_id, "FAILED")
                closed += 1
            return closed
        except Exception:  # noqa: BLE001 - housekeeping must not fail the command
            return 0

    def log_config(self, run_id: str, config) -> None:
        """The resolved configuration a run used (a pydantic model), as `config.yaml`."""
        with self._errors():
            self.client().log_dict(run_id, config.model_dump(mode="json"), "config.yaml")

    @contextlib.contextmanager
    def _errors(self):
        try:
            yield
        except TrackingError:
            raise
        except Exception as e:  # noqa: BLE001 - MLflow raises many kinds; name the server
            raise TrackingError(
                f"tracking to {self.uri} failed: {type(e).__name__}: {str(e)[:200]}"
            ) from None


@dataclass(frozen=True)
class RunRecord:
    """One MLflow run's lifecycle, the same for a stage (`run_stage`) and for a command that
    is not one (`recd run`, `compare`, `bench`): opened before the work (a run of its own
    after a check, so an unreachable server fails before any work is done), then closed
    FAILED with the one-line reason (`fail`, with the runs it belongs to) or FINISHED with
    the summary (`close`). A command's body nests the stages' runs under its `run_id`."""

    tracker: Tracker
    run_id: str

    @classmethod
    def open(
        cls,
        tracker: Tracker,
        name: str,
        params: dict,
        parent_id: str | None = None,
        run_name: str | None = None,
    ):
        if not parent_id:
            tracker.check()
            tracker.close_abandoned()
        run_id = tracker.start(name, params, parent_id=parent_id, owned=True, run_name=run_name)
        return cls(tracker, run_id)

    @contextlib.contextmanager
    def system_metrics(self, every_s: float = 5.0):
        """Sample the machine (CPU, memory, disk, network, GPU) into this run while the
        block runs: MLflow's system metrics, shown in the run's System metrics tab."""
        try:  # the record of the work, never a reason for the work to fail
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(
                self.run_id, sampling_interval=every_s, tracking_uri=self.tracker.uri
            )
            monitor.start()
        except Exception as e:  # noqa: BLE001 - e.g. psutil missing
            logging.getLogger(__name__).warning("no system metrics for this run: %s", e)
            monitor = None
        try:
            yield
        finally:
            if monitor is not None:
                monitor.finish()

    def fail(self, reason: str, summary: dict | None = None, also: tuple[str, ...] = ()) -> None:
        """Close this run (and the runs `also` names) FAILED. A tracking failure here is not
        raised: the work's own failure is the one to report."""
        for run_id in (self.run_id, *also):
            with contextlib.suppress(TrackingError):
                self.tracker.finish(
                    run_id, {**(summary or {}), "status": "failed", "error": reason}
                )

    def close(self, summary: dict) -> dict:
        """Close FINISHED with `summary`; returns it with `mlflow.run_id`. If the server
        fails now, a `TrackingError` says this work is done but unrecorded, and carries the
        summary (the local runner adds which stages ran and which did not)."""
        try:
            self.tracker.finish(self.run_id, summary)
        except TrackingError as e:
            raise type(e)(f"its work is done but could not be recorded: {e}", summary) from None
        return {**summary, "mlflow.run_id": self.run_id}


OWNER_TAG = "recd.owner"


def _start_ticks(pid: int) -> str:
    """When process `pid` started (clock ticks since boot, Linux), "" where unknown: with
    the pid it names one process, never a later one that reuses the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]


def process_owner() -> str:
    """This process as `host:pid:start`."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_ticks(os.getpid())}"


def owner_alive(owner: str) -> bool:
    """Whether the process an owner tag names still runs (True where it cannot be told:
    another host, no start time recorded)."""
    host, _, rest = owner.partition(":")
    pid, _, ticks = rest.partition(":")
    if host != socket.gethostname() or not ticks or not pid.isdigit():
        return True
    return _start_ticks(int(pid)) == ticks


def histories(summary: dict) -> list[tuple[str, int, float]]:
    """Curves a summary carries under `<stage>.history` ({metric: [[step, value], ...]}),
    as (metric, step, value): MLflow keeps each as the metric's history, plotted by step."""
    out = []
    for key, curves in summary.items():
        if key.endswith(".history") and isinstance(curves, dict):
            for name, points in curves.items():
                out += [(name, int(p[0]), float(p[1])) for p in points if len(p) >= 2]
    return out


_DAY = re.compile(r"^(.*)\.(\d{4}-\d{2}-\d{2})$")


def _is_number(v) -> bool:
    return isinstance(v, bool) or isinstance(v, int | float) and math.isfinite(v)


def _day_keyed(v) -> bool:
    return isinstance(v, dict) and bool(v) and all(_DAY.match(f".{k}") for k in v)


def numeric(summary: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) summary, keys joined with '.'. Figures per day
    (`synth.oracle_ne.2026-11-24`, `days: {2026-11-24: {...}}`) are left to `by_day`: a
    metric key never holds a date, so runs of different days share their keys."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if _DAY.match(key) or _day_keyed(v):
            continue
        if _is_number(v):
            out[key] = float(v)
        elif isinstance(v, dict):
            out.update(numeric(v, f"{key}."))
    return out


def _days_of(key: str, value) -> list[str]:
    m = _DAY.match(key)
    if m:
        return [m.group(2)]
    return list(value) if _day_keyed(value) else []


def by_day(summary: dict) -> list[tuple[str, int, float]]:
    """(key, step, value) of the per-day figures: one metric per figure with a step per day
    in date order (the dates: the `recd.days` tag); `x.<date>` becomes `x.by_day`, a
    `days: {<date>: {...}}` summary `days.<figure>`."""
    days: set[str] = set()
    found: list[tuple[str, str, float]] = []
    for k, v in summary.items():
        m = _DAY.match(k)
        if m and _is_number(v):
            found.append((f"{m.group(1)}.by_day", m.group(2), float(v)))
        elif _day_keyed(v):
            for day, inner in v.items():
                if _is_number(inner):
                    found.append((k, day, float(inner)))
                elif isinstance(inner, dict):
                    found += [(f"{k}.{n}", day, x) for n, x in numeric(inner).items()]
    days = sorted({d for _, d, _ in found})
    return [(k, days.index(d), v) for k, d, v in found]


# the figures that answer "what did this run find?", in the order a reader wants them
HEADLINE = (
    "storage.ratio",
    "dpp.speedup",
    "train.speedup",
    "eval.ne",
    "eval.auc",
    "eval.ne_gap",
    "eval.auc_gap",
    "eval.oracle_ne",
    "eval.calibration",
    "dpp.samples_per_s",
    "train.samples_per_s",
)


def headline_rank(key: str) -> tuple[int, str] | None:
    """Where `key` (or its per-arm `key.<arm>`) stands among the headline figures."""
    for base in (key, key.rsplit(".", 1)[0]):
        if base in HEADLINE:
            return HEADLINE.index(base), key
    return None


# a command's arguments that say where its record goes, not what it did: not params
PLUMBING = ("tracking_uri", "experiment", "parent_run_id", "summary")
# summary figures that are settings the run used (the UI's Parameters), not measurements
SETTING = re.compile(
    r"\.(batch_size|batch_size_asked|epochs|lr_dense|lr_sparse|lr|members|"
    r"world_size|steps_per_epoch|workers|repeats|nproc|threads|bucket_rows|"
    r"row_group_size|dedup_window_days)(\.|$)"
)
# what a comparison's own run keeps besides the headline figures (its stage runs keep all)
COMPARISON_KEYS = ("compare.", "registry.", "bench.")


def settings(summary: dict, prefix: str = "") -> dict[str, str]:
    """The summary's settings and yes/no facts (`train.batch_size`, `train.lr_dense`,
    `compare.quality_ok`), as MLflow params: strings."""
    out: dict[str, str] = {}
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if _DAY.match(key) or _day_keyed(v):
            continue
        if isinstance(v, bool):
            out[key] = str(v).lower()
        elif isinstance(v, int | float) and SETTING.search(key):
            out[key] = f"{v:g}" if isinstance(v, float) else str(v)
        elif isinstance(v, dict):
            out.update(settings(v, f"{key}."))
    return out


def _duplicate_of_arm(key: str, figures: dict, arms: list[str]) -> bool:
    """`eval.ne` beside `eval.ne.dedup` with the same value: the first arm's figure again."""
    return any(figures.get(f"{key}.{a}") == figures[key] for a in arms)


def conditions() -> dict:
    """What a measurement depends on, as a run starts: the machine's CPUs, those the
    process may use (affinity and cgroup quota), and the load beside it."""

    return {
        "sys.cpus": os.cpu_count(),
        "sys.cpu_budget": cpu_budget(),
        "sys.load_1m_start": load_1m(),
    }


def _torch_facts() -> dict:

    if "torch" not in sys.modules:  # only commands that used torch report it
        return {}
    import torch

    return {"sys.torch": torch.__version__, "sys.cuda": torch.cuda.is_available()}
