"""docs/operations.md as a reader meets it: every command block parses in its language, and
every JSON body it sends is JSON (no `...` standing for the rest). The blocks that can run
here run in the tests of what they drive, pasted as written: the serving requests and
`recd status` (test_serving.py), the REST trigger (test_airflow_server.py)."""

from __future__ import annotations

import json
import subprocess

from doc_blocks import blocks

# a curl that only notes what it would send (each -d body into $BODIES, NUL-separated) and
# answers as the token endpoint does, so a block's later lines run on
FAKE_CURL = """
curl() {
  while [ $# -gt 0 ]; do
    if [ "$1" = -d ]; then printf '%s\\0' "$2" >> "$BODIES"; shift; fi
    shift
  done
  printf '{"access_token": "t"}'
}
"""


def test_every_block_of_the_operations_page_parses_and_sends_json(tmp_path):
    found = blocks()
    assert len(found) > 10
    sent = 0
    for block in found:
        if block.lang == "python":
            compile(block.text, block.where(), "exec")
            continue
        syntax = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
        assert syntax.returncode == 0, f"{block.where()}: {syntax.stderr}"
        if "curl " not in block.text:
            continue
        bodies = tmp_path / f"bodies-{block.line}"
        bodies.touch()
        subprocess.run(
            ["bash", "-c", FAKE_CURL + block.text],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "PASSWORD": "p", "BODIES": str(bodies)},
            timeout=60,
        )
        for body in filter(None, bodies.read_text().split("\0")):
            if body.startswith("@"):  # a file the block made or downloaded
                continue
            try:
                json.loads(body)
            except ValueError as e:
                raise AssertionError(
                    f"{block.where()}: sends a body that is not JSON ({e})"
                ) from None
            sent += 1
    assert sent >= 4  # the token, the unpause, the trigger, the ranking request
