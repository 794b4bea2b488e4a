"""Failures an orchestrator can act on: one absurd value quarantines its line, and bad
configuration or a read-only warehouse is one line with exit 2 (final), never a traceback
that the retry policy would run again and again."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from recd_cli import ingest_day, recd

from recd_core.config import PACKAGE_CONFIGS
from recd_core.config_files import load_yaml
from recd_core.warehouse import Warehouse

DAY = "2026-11-01"


def test_a_5000_digit_integer_quarantines_its_line_and_the_day_goes_on(tmp_path, small_logs):
    src = tmp_path / "logs" / f"ds={DAY}"
    shutil.copytree(small_logs / f"ds={DAY}", src)
    f = next(src.glob("*.jsonl.gz"))
    lines = gzip.decompress(f.read_bytes()).splitlines()
    lines[7] = lines[7].replace(b'"user_id":', b'"user_id":' + b"9" * 5000 + b',"was":', 1)
    f.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    out = tmp_path / "s.json"
    ingest_day(src, tmp_path / "wh", DAY, out, code=0)
    s = json.loads(out.read_text())
    assert s["ingest.rows_quarantined"] == 1 and s["ingest.rows_ok"] == len(lines) - 1
    assert s["ingest.rows_in"] == len(lines)
    (row,) = Warehouse(tmp_path / "wh").read("quarantine", DAY).to_pylist()
    assert row["line"] == 8 and row["field"] == "user_id" and "5000 digits" in row["reason"]


def test_a_spill_dir_that_is_missing_is_one_line(tmp_path, samples_warehouse):
    data = load_yaml(PACKAGE_CONFIGS / "synthetic.yaml")
    data.setdefault("generate", {})["spill_dir"] = str(tmp_path / "missing")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    wh = tmp_path / "wh"
    shutil.copytree(samples_warehouse, wh)
    r = recd("generate", "--warehouse", wh, "--ds", DAY, "--config", cfg, code=2)
    assert "generate.spill_dir" in r.stderr and "not a directory" in r.stderr


def test_days_past_the_calendar_are_one_line(tmp_path):
    r = recd("synth", "--logs", tmp_path / "logs", "--ds", "9999-12-31", "--days", "2", code=2)
    assert "go past 9999-12-31" in r.stderr


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only filesystem (a tmpfs remounted read-only): EROFS, not a permission bit."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    ok = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if ok.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {ok.stderr.decode().strip()}")
    (mnt / "wh").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    try:
        yield mnt / "wh"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_read_only_warehouse_is_one_line_and_final(read_only_dir, small_logs):
    r = recd(
        "ingest",
        "--source",
        small_logs / f"ds={DAY}",
        "--warehouse",
        read_only_dir,
        "--ds",
        DAY,
        code=2,
    )
    assert "cannot be written" in r.stderr and "read-only file system" in r.stderr
    assert not any(Path(read_only_dir).iterdir())


LOCK_DB = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
con.execute("ROLLBACK")
"""


def _hold_lock(db: Path, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_DB, str(db), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_locked_tracking_store_is_waited_for_then_retryable(tmp_path):
    from recd_core.errors import TrackingError, TrackingStoreUnwritable
    from recd_core.mlops.tracking import Tracker

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    recd(
        "--tracking-uri",
        uri,
        "synth",
        "--logs",
        tmp_path / "a",
        "--ds",
        DAY,
        "--preset",
        "small",
        "--days",
        "1",
        code=0,
    )
    holder = _hold_lock(db, 8)  # a lock that passes: the command waits for it
    recd(
        "--tracking-uri",
        uri,
        "synth",
        "--logs",
        tmp_path / "b",
        "--ds",
        DAY,
        "--preset",
        "small",
        "--days",
        "1",
        code=0,
    )
    holder.wait()
    holder = _hold_lock(db, 20)  # one that does not, within the wait: retryable, not final
    with pytest.raises(TrackingError, match="stayed locked") as e:
        Tracker(uri, timeout_s=0.5, lock_wait_s=2).check()
    assert e.value.retryable and not isinstance(e.value, TrackingStoreUnwritable)
    holder.kill()


def test_commands_that_first_use_a_fresh_tracking_store_together_all_succeed(tmp_path):
    procs = []
    for round_ in range(3):
        uri = f"sqlite:///{tmp_path}/m{round_}.db"
        procs += [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "recd_core.cli",
                    "--tracking-uri",
                    uri,
                    "synth",
                    "--logs",
                    str(tmp_path / f"l{round_}{k}"),
                    "--ds",
                    DAY,
                    "--preset",
                    "small",
                    "--days",
                    "1",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(2)
        ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]


def test_a_parquet_export_that_decodes_past_the_limit_is_refused_before_reading(
    tmp_path, small_logs
):
    """0.4 MB on disk, its footer declaring 2 MB, 1 GB once decoded (a long list repeated,
    dictionary- and run-length-encoded): refused whole from its footer, the day goes on."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "logs" / f"ds={DAY}"
    shutil.copytree(small_logs / f"ds={DAY}", src)
    n = 130_000
    lists = pa.ListArray.from_arrays(
        pa.array(np.arange(0, n * 1000 + 1, 1000, np.int32)),
        pa.array(np.full(n * 1000, 7, np.int64)),
    )
    pq.write_table(
        pa.table({"user_history": lists, "event_id": pa.array(np.arange(n))}),
        src / "export.parquet",
        compression="zstd",
    )
    assert (src / "export.parquet").stat().st_size < 1 << 20
    out = tmp_path / "s.json"
    ingest_day(src, tmp_path / "wh", DAY, out, code=0)
    s = json.loads(out.read_text())
    ((name, why),) = s["ingest.refused_files"].items()
    assert name.endswith("export.parquet") and "expands past the limit" in why
    lines = sum(len(gzip.decompress(f.read_bytes()).splitlines()) for f in src.glob("*.gz"))
    assert s["ingest.rows_ok"] == lines and s["ingest.rows_in"] == lines + 1


def test_an_object_store_that_does_not_answer_is_retryable_in_one_line(tmp_path, small_logs):
    """An S3 endpoint that is down: Arrow's client retries, then exit 1 (the orchestrator
    retries), one line naming the warehouse; never exit 2, which would stop the retries."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wh = f"s3://recd-bucket/wh?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    r = recd("ingest", "--source", small_logs / f"ds={DAY}", "--warehouse", wh, "--ds", DAY, code=1)
    assert "unreachable" in r.stderr and "retry" in r.stderr and f"127.0.0.1:{port}" in r.stderr
