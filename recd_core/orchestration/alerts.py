"""Telling someone a scheduled run needs them: a failed run, a run past its deadline.

A notifier is any callable `notify(message: str, **details)`, named by an import path
(`package.module:function`) in the orchestrator's settings (`RECD_NOTIFIER`), so a site plugs
in its pager or chat without touching the DAGs; the default writes one ERROR line to the
`recd.alerts` logger (the scheduler's, the triggerer's or the task's log).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

DEFAULT = "recd_core.orchestration.alerts:log_alert"


def log_alert(message: str, **details) -> None:
    """The default notifier: one ERROR line."""
    extra = " ".join(f"{k}={v}" for k, v in details.items() if v is not None)
    logging.getLogger("recd.alerts").error(
        "recd alert: %s%s", message, f" ({extra})" if extra else ""
    )


def notifier(path: str = DEFAULT) -> Callable[..., None]:
    """The notifier at import path `module:function` (a clear error for a bad path)."""
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"notifier {path!r} cannot be imported ({e}): give module:function"
        ) from None
    if not callable(fn):
        raise ValueError(f"notifier {path!r} is not callable")
    return fn


async def deadline_missed(notifier_path: str = DEFAULT, message: str = "", **kwargs) -> None:
    """An Airflow Deadline Alert's callback (it runs in the triggerer, awaited): the message
    to the configured notifier. Airflow adds its context as a keyword argument."""
    context = kwargs.get("context") or {}
    run = context.get("dag_run") if isinstance(context, dict) else None
    notifier(notifier_path)(message, run_id=getattr(run, "run_id", None))
