"""`recd` as a person runs it, for the tests: the console script installed beside this
Python, in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RECD = Path(sys.executable).with_name("recd")


def recd(
    *args,
    code: int | None = 0,
    env: dict | None = None,
    options: tuple[str, ...] = (),
    prefix: tuple[str, ...] = (),
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """`recd [options] ARGS` (after `prefix`, e.g. a resource limit), with `env` laid over
    this environment. `code`: the exit status wanted, with no traceback and, for a failure,
    one line on stderr (`recd <command>: error: ...`); None: any, unchecked."""
    r = subprocess.run(
        [*prefix, str(RECD), *options, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    if code is None:
        return r
    said = f"recd {' '.join(map(str, args))[:300]}: exit {r.returncode}, wanted {code}"
    assert r.returncode == code, f"{said}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if code:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
        assert len(lines) == 1 and ": error: " in lines[0], r.stderr
    return r


def ingest_day(
    src: Path, warehouse: Path, ds: str, summary: Path, *options: str, code: int = 0
) -> dict:
    """`recd ingest --source SRC` of day `ds` into `warehouse`: its summary."""
    recd(
        "ingest",
        "--source",
        src,
        "--warehouse",
        warehouse,
        "--ds",
        ds,
        "--summary",
        summary,
        *options,
        code=code,
    )
    return json.loads(summary.read_text())
