"""Raw event lines for tests that damage them: the small day's clean lines, and one line with
fields changed or removed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def clean_lines(day_logs: Path, n: int | None = None) -> list[bytes]:
    """The first file's lines of a synthesized day (all, or the first `n`)."""
    lines = gzip.decompress(next(iter(sorted(day_logs.glob("*.gz")))).read_bytes()).splitlines()
    return lines[:n] if n else lines


def mutate(line: bytes, **changes) -> bytes:
    """The line with fields set (`KeyError` as a value removes the field)."""
    obj = json.loads(line)
    for k, v in changes.items():
        if v is KeyError:
            del obj[k]
        else:
            obj[k] = v
    return json.dumps(obj).encode()
