"""The error taxonomy: every failure recd expects is a `RecdError`, which carries its exit
code and whether a retry can fix it. The CLI, the components and the Airflow task factory
read these two attributes and nothing else, so a failure means the same everywhere.

    RecdError                       exit 1, retryable   (base; not raised itself)
    ├── BadInput                    exit 2, final       input, config, arguments, a missing
    │   ├── ConfigError                                 partition, an unreadable model or
    │   ├── SourceError                                 checkpoint: the same input fails again
    │   ├── PartitionNotFound, PartitionDamaged
    │   ├── StaleInput, FeaturesDiffer                  (lineage.py: an input rewritten since,
    │   ├── EvaluationLeak                              another feature set; a day the model
    │   │                                               trained on)
    │   ├── PreprocessError, BatchMismatch, JaggedError
    │   └── CheckpointError, ModelError
    ├── GateFailed                  exit 3, final       the work ran; its result failed a gate
    │   └── QuarantineExceeded                          (too many bad rows, arms differ)
    ├── TrackingError               exit 4, retryable   the tracking server is unreachable or
    │   │                                               refuses the run
    │   └── TrackingStoreUnwritable exit 4, final       the store refuses writes (permissions,
    │                                                   a read-only file): a retry cannot help
    ├── RunBusy                     exit 1, retryable   another live process trains the same
    │                                                   day and arm (a leftover still ending)
    ├── StorageFull                 exit 1, retryable   no space left on a device (or a quota):
    │                                                   what was being written is removed, the
    │                                                   committed partitions are intact; free
    │                                                   space and the same command succeeds
    └── StorageUnreachable          exit 1, retryable   the warehouse's store does not answer
                                                        (endpoint down, DNS, network), after
                                                        the filesystem's own retries

Anything else (a bug, a killed worker) keeps its traceback, exits 1 from the CLI and is
retried by the orchestrators' retry policy.
"""

from __future__ import annotations

import errno
import os
from typing import ClassVar


class RecdError(Exception):
    """A failure with a one-line reason. `summary`: figures worth keeping (e.g. the
    quarantine counts of a day that failed its gate)."""

    exit_code: ClassVar[int] = 1
    retryable: ClassVar[bool] = True

    def __init__(self, message: str, summary: dict | None = None):
        super().__init__(message)
        self.summary = summary or {}

    def __str__(self) -> str:
        # one line, whatever the cause wrote (pydantic and pyarrow messages span lines)
        return " ".join(super().__str__().split())


class BadInput(RecdError):
    """The input (files, config, arguments, a model) cannot be used: fix it and rerun."""

    exit_code = 2
    retryable = False


class GateFailed(RecdError):
    """The stage did its work, but the result failed a quality gate."""

    exit_code = 3
    retryable = False


class TrackingError(RecdError):
    """The tracking server cannot be reached or refuses the run."""

    exit_code = 4
    retryable = True


class TrackingStoreUnwritable(TrackingError):
    """The tracking store cannot be written (a read-only file or directory): fix it, rerun."""

    retryable = False


class StorageFull(RecdError):
    """A device (or quota) ran out of space while recd wrote to it."""


class StorageUnreachable(RecdError):
    """The warehouse's store does not answer (an object store's endpoint down, DNS, a
    network outage), after the filesystem's own retries: the same command succeeds once it
    answers."""


# how Arrow's filesystems (its S3 client's curl errors) and the OS say "no answer"
_NETWORK_WORDS = (
    "NETWORK_CONNECTION",
    "curlCode",
    "Could not connect",
    "Could not resolve",
    "Connection refused",
    "Connection reset",
    "timed out",
    "Timeout was reached",
)
_NETWORK_ERRNOS = (
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
)


def network_failure(e: BaseException) -> bool:
    """Is `e` a store that did not answer (retryable), rather than one that refused?"""
    return isinstance(e, OSError) and (
        e.errno in _NETWORK_ERRNOS or any(w in str(e) for w in _NETWORK_WORDS)
    )


def unreachable(e: OSError, where: str) -> StorageUnreachable:
    """`e` as a one-line StorageUnreachable naming `where` and the store's own words."""
    words = " ".join(str(e).split())
    cause = words.split("; Details:")[0].split(" operation: ")[-1][:160]
    err = StorageUnreachable(f"{where} is unreachable ({cause}): retry when it answers")
    err.__cause__ = e
    return err


def first_line(e: BaseException, limit: int, empty: str = "") -> str:
    """The first line of an exception's message, at most `limit` characters (`empty` when it
    has none): causes from Arrow, torch or MLflow span many lines, a reason is one."""
    return (str(e).strip().splitlines() or [empty])[0][:limit]


def classify(e: BaseException) -> RecdError | None:
    """`e` as a `RecdError`: itself, a `ValueError` (a malformed value: `--ds 2026-13-01`,
    an argument pydantic refuses) as `BadInput`, a full device as `StorageFull`; None for
    anything unexpected."""
    if isinstance(e, RecdError):
        return e
    if isinstance(e, OSError) and (
        e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e)
    ):
        where = f" writing {e.filename}" if e.filename else ""
        err = StorageFull(
            f"no space left on the device{where}: free space and rerun "
            "(what was being written was removed; committed data is intact)"
        )
        err.__cause__ = e
        return err
    if network_failure(e):
        return unreachable(e, "the warehouse's store")
    if isinstance(e, ValueError):
        err = BadInput(str(e))
        err.__cause__ = e
        return err
    return None


def of_exit(code: int, reason: str) -> RecdError:
    """The failure a recd process reported by its exit code (a stage run as a subprocess:
    the same class, so the caller's exit code and retry policy are the child's)."""
    kind = next(
        (k for k in (BadInput, GateFailed, TrackingError) if k.exit_code == code), RecdError
    )
    return kind(reason or f"exited {code}")


def os_error_words(e: OSError) -> str:
    """An OS error in a few words: pyarrow's "[Errno 13] Cannot create directory '…'. Detail:
    …" as "Cannot create directory '…' (permission denied)"."""
    text = str(e).split(". Detail")[0].removeprefix(f"[Errno {e.errno}] ")
    return f"{text} ({os.strerror(e.errno).lower()})" if e.errno else text
