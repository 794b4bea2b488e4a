"""MLflow run records: one run per command, in the experiment `recd` (or the one given).

A run holds the command's arguments as params, the numeric figures of its summary as
metrics (the contract keys: `storage.bytes`, `dpp.samples_per_s`, `train.samples_per_s`,
`eval.ne`, ...), tags that make the UI comparison easy (`recd.stage`, `mode`, `ds`), system
facts, and the whole summary as `summary.json`. Uses an explicit `MlflowClient` (no global
MLflow state). An HTTP tracking server is probed with a short timeout before the stage runs,
so an unreachable server fails the command at once instead of after the work.
"""

from __future__ import annotations

import math
import os
import platform
import urllib.error
import urllib.request
from dataclasses import dataclass

MAX_PARAM = 500


class TrackingError(Exception):
    """The tracking server cannot be reached or refuses the run."""


@dataclass(frozen=True)
class Tracker:
    uri: str
    experiment: str = "recd"
    timeout_s: float = 5.0

    def check(self) -> None:
        """Fail fast, with the URI named, if an HTTP tracking server does not answer."""
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

    def log(self, stage: str, params: dict, summary: dict) -> str:
        """Record one command run; returns the MLflow run id."""
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        try:
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment)
            tags = {
                "recd.stage": stage,
                "mode": str(
                    params.get("mode", summary.get("train.mode", summary.get("dpp.mode", "")))
                ),
                "ds": str(params.get("ds", summary.get("run.ds", ""))),
                "recd.status": str(summary.get("status", "ok")),
            }
            run = client.create_run(
                exp_id, run_name=f"{stage} {tags['ds']} {tags['mode']}".strip(), tags=tags
            )
            run_id = run.info.run_id
            metrics = [Metric(k, float(v), 0, 0) for k, v in numeric(summary).items()]
            facts = {
                "sys.python": platform.python_version(),
                "sys.machine": platform.machine(),
                "sys.cpus": os.cpu_count(),
                **_torch_facts(),
            }
            plist = [
                Param(k, str(v)[:MAX_PARAM])
                for k, v in {**params, **facts}.items()
                if v is not None
            ]
            client.log_batch(
                run_id, metrics=metrics, params=plist, tags=[RunTag("recd.version", "0.1.0")]
            )
            client.log_dict(run_id, summary, "summary.json")
            client.set_terminated(run_id, "FINISHED" if tags["recd.status"] == "ok" else "FAILED")
            return run_id
        except Exception as e:  # noqa: BLE001 - MLflow raises many kinds; name the server
            raise TrackingError(
                f"tracking to {self.uri} failed: {type(e).__name__}: {str(e)[:200]}"
            ) from None


def numeric(summary: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) summary, keys joined with '.'."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if isinstance(v, bool) or isinstance(v, int | float) and math.isfinite(v):
            out[key] = float(v)
        elif isinstance(v, dict):
            out.update(numeric(v, f"{key}."))
    return out


def _torch_facts() -> dict:
    import sys

    if "torch" not in sys.modules:  # only commands that used torch report it
        return {}
    import torch

    return {"sys.torch": torch.__version__, "sys.cuda": torch.cuda.is_available()}
