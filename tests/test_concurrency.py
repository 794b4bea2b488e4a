"""Two writers of one day, as when an operator re-runs a day while the scheduler does: both
end cleanly (exit 0, no traceback), and the partition they leave is one whole version."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from recd_core.warehouse import Warehouse

DAY = "2026-11-01"
RECD = str(Path(sys.executable).with_name("recd"))
TRIALS = 20


def _leftovers(root: Path) -> list[str]:
    """Staging or trash directories left behind: a half-done write for the next reader."""
    return [
        str(p.relative_to(root))
        for side in ("_staging", "_trash")
        for d in root.glob(f"*/{side}")
        for p in d.iterdir()
    ]


def test_threads_writing_one_partition_leave_one_whole_version(tmp_path):
    wh = Warehouse(tmp_path)
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for _ in range(10):
                with wh.writing("t", DAY) as w:
                    for f in range(3):  # three files: a mix of versions would show
                        w.write(pa.table({"w": [k] * 50, "f": [f] * 50}), max_rows_per_file=50)
                assert wh.read("t", DAY).num_rows == 150  # readers never see a swap half-done
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    t = wh.read("t", DAY)
    assert t.num_rows == 150 and len(set(t["w"].to_pylist())) == 1, "one writer's version"
    assert not _leftovers(tmp_path)


def _race(cmd: list[str]) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(), *p.communicate()) for p in procs]


@pytest.mark.parametrize("stage", ["ingest", "generate"])
def test_two_writers_of_a_day_both_end_cleanly(stage, day_logs, tmp_path):
    wh_root = tmp_path / "wh"
    ingest = [RECD, "ingest", "--source", day_logs, "--warehouse", wh_root, "--ds", DAY]
    generate = [RECD, "generate", "--warehouse", wh_root, "--ds", DAY, "--layout", "both"]
    subprocess.run(list(map(str, ingest)), check=True, capture_output=True)
    cmd = list(map(str, ingest if stage == "ingest" else generate))
    if stage == "generate":
        subprocess.run(cmd, check=True, capture_output=True)
    wh = Warehouse(wh_root)
    tables = (
        [("events", {}), ("quarantine", {})]
        if stage == "ingest"
        else [("samples", {"layout": "clustered"}), ("samples", {"layout": "shuffled"})]
    )
    expected = {(t, tuple(k.items())): wh.read(t, DAY, **k) for t, k in tables}
    for trial in range(TRIALS):
        for r in _race(cmd):
            assert r.returncode == 0 and "Traceback" not in r.stderr, (
                f"trial {trial}: exit {r.returncode}\n{r.stderr[-2000:]}"
            )
        assert not _leftovers(wh_root), f"trial {trial}"
        for (table, keys), want in expected.items():
            got = wh.read(table, DAY, **dict(keys))
            assert got.equals(want), f"trial {trial}: {table} {keys} is not one whole copy"
