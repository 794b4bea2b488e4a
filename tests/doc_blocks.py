"""The commands of docs/operations.md as a reader pastes them: its fenced blocks, found by a
piece of their text, run in bash with the places that name a user's site (a host, a
warehouse, a day) swapped for the test's own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # where it starts in the page

    def where(self) -> str:
        return f"{OPERATIONS.name}:{self.line}"


def blocks(page: Path = OPERATIONS) -> list[Block]:
    """Every fenced block of the page, with its language (empty when unsaid)."""
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out.append(Block(m.group(1), "\n".join(lines[i + 1 : end]) + "\n", i + 1))
            i = end
        i += 1
    return out


def block_with(fragment: str) -> Block:
    """The one block holding `fragment`."""
    found = [b for b in blocks() if fragment in b.text]
    assert len(found) == 1, f"{len(found)} blocks of {OPERATIONS} hold {fragment!r}"
    return found[0]


def run_block(
    block: Block, swap: dict[str, str] | None = None, env: dict | None = None, timeout=300
) -> subprocess.CompletedProcess:
    """The block in `bash -e -o pipefail`, `swap`'s texts replaced, this venv's commands on
    the PATH; stdout, stderr and the exit status back."""
    text = block.text
    for old, new in (swap or {}).items():
        assert old in text, f"{block.where()}: no {old!r} to swap"
        text = text.replace(old, new)
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", text],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})},
    )
