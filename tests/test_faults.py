"""Faults injected as they happen to a pipeline left alone: damaged, truncated, missing and
foreign files in the warehouse, a process killed mid-write, a full disk, a tracking server
that dies mid-run. Each case checks what an operator relies on: the documented exit code, a
one-line error naming what is wrong, no traceback, nothing trained on garbage, the previous
data intact, nothing left behind, and the next run succeeding.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from recd_cli import RECD, recd

from recd_core.config import GenerateConfig, PreprocessConfig
from recd_core.data.generate import generate
from recd_core.dpp.batch_store import BatchStore
from recd_core.dpp.preprocess import preprocess
from recd_core.leftovers import TMP_MARK, hold, sweep_files
from recd_core.modeling.launch import free_port
from recd_core.warehouse import MANIFEST, Warehouse

DAY = "2026-11-01"
SMALL = Path(__file__).parent / "configs/small.yaml"


def _flip(path: Path, at: float, n: int) -> None:
    """Change `n` bytes of a file in place, `at` (a fraction) of the way in."""
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i : i + n] = bytes(b ^ 0x5A for b in data[i : i + n])
    path.write_bytes(bytes(data))


def _partition(wh: Warehouse, table: str, **keys: str) -> Path:
    return Path(wh.partition_path(table, DAY, **keys))


def test_damaged_samples_are_named_and_never_trained_on(fresh_warehouse):
    """256 bytes changed inside a stored side file (the session-normalized user features):
    the page checksums catch it; preprocess names the file, publishes nothing."""
    part = _partition(fresh_warehouse, "samples", layout="clustered")
    side = next(part.glob("_side-*.parquet"))
    _flip(side, 0.4, 256)
    r = recd("preprocess", "--warehouse", fresh_warehouse.root, "--ds", DAY, code=2)
    assert side.name in r.stderr and "damaged" in r.stderr
    assert not fresh_warehouse.exists("batches", DAY, mode="dedup"), "nothing published"


def test_damaged_events_are_named(fresh_warehouse):
    events = next(_partition(fresh_warehouse, "events").glob("*.parquet"))
    _flip(events, 0.5, 64)
    r = recd("generate", "--warehouse", fresh_warehouse.root, "--ds", DAY, code=2)
    assert events.name in r.stderr and "damaged" in r.stderr and "rerun" in r.stderr


@pytest.mark.parametrize(
    "damage", ["foreign", "traversal", "empty", "missing", "truncated", "not json"]
)
def test_a_manifest_that_cannot_be_trusted_is_one_line(damage, fresh_warehouse, tmp_path):
    """A manifest is read, never obeyed blindly: a name that leads outside the partition,
    no files, a missing or truncated file, garbage: each an exit 2 naming it, no traceback,
    and no foreign file read as the day."""
    part = _partition(fresh_warehouse, "events")
    manifest = part / MANIFEST
    m = json.loads(manifest.read_text())
    foreign = tmp_path / "elsewhere" / "x.parquet"
    foreign.parent.mkdir()
    shutil.copy(next(part.glob("*.parquet")), foreign)  # a readable file: must not be read
    if damage == "foreign":
        m["files"] = [str(foreign)]
    elif damage == "traversal":
        m["files"] = [os.path.relpath(foreign, part)]
    elif damage == "empty":
        m["files"] = []
    elif damage == "missing":
        (part / m["files"][0]).unlink()
    elif damage == "truncated":
        data = (part / m["files"][0]).read_bytes()
        (part / m["files"][0]).write_bytes(data[: len(data) // 2])
    if damage == "not json":
        manifest.write_text("{ not json")
    else:
        manifest.write_text(json.dumps(m))
    r = recd("generate", "--warehouse", fresh_warehouse.root, "--ds", DAY, code=2)
    assert "events/ds=2026-11-01" in r.stderr
    words = {
        "foreign": "not a file of the partition",
        "traversal": "not a file of the partition",
        "empty": "lists no files",
        "missing": "is missing",
        "truncated": "is damaged",
        "not json": "is damaged",
    }
    assert words[damage] in r.stderr


@pytest.mark.parametrize("row_group, batch", [(128, 16), (1024, 128)])
def test_preprocess_lists_exactly_the_files_it_wrote(row_group, batch, fresh_warehouse):
    """Small row groups and batches give splits without validation rows (or without training
    rows): the manifest lists only the files written, and every one of them opens."""
    generate(fresh_warehouse, DAY, GenerateConfig(row_group_size=row_group, batch_size=batch))
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=batch))
    listed = fresh_warehouse.files("batches", DAY, mode="dedup")
    on_disk = {p.name for p in _partition(fresh_warehouse, "batches", mode="dedup").iterdir()}
    assert {Path(p).name for p in listed} == on_disk - {MANIFEST}
    train, valid = (
        BatchStore(fresh_warehouse, DAY, "dedup", split) for split in ("train", "validation")
    )
    m = fresh_warehouse.manifest("batches", DAY, mode="dedup")
    assert len(train) == m["batches"] and len(valid) == m["validation"]["batches"] > 0
    train[len(train) - 1], valid[len(valid) - 1]  # the last batch of each decodes


def test_damaged_batches_are_caught_by_their_crc(fresh_warehouse):
    """Arrow IPC files carry no checksums of their own: the manifest's CRC-32 catches them."""
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=1024))
    shard = next(_partition(fresh_warehouse, "batches", mode="dedup").glob("shard-*.arrow"))
    _flip(shard, 0.5, 16)
    r = recd("train", "--warehouse", fresh_warehouse.root, "--ds", DAY, code=2)
    assert shard.name in r.stderr and "CRC-32" in r.stderr


def _wait_for(predicate, timeout: float = 60.0, every: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(every)
    pytest.fail("timed out waiting")


@pytest.mark.parametrize("stage", ["ingest", "generate", "preprocess"])
def test_a_stage_killed_mid_write_leaves_the_day_intact_and_the_next_run_clean(
    stage, fresh_warehouse, small_logs, tmp_path
):
    """SIGKILL while a stage writes (its staging directory has files): the committed
    partition is untouched; what the killed run left (staging, generate's spill directory:
    nobody can clean up after a SIGKILL) is removed by the next run, which succeeds."""
    wh = fresh_warehouse
    if stage == "preprocess":
        preprocess(wh, DAY, PreprocessConfig())
    table, keys = {
        "ingest": ("events", {}),
        "generate": ("samples", {"layout": "clustered"}),
        "preprocess": ("batches", {"mode": "dedup"}),
    }[stage]
    before = wh.manifest(table, DAY, **keys)["write_id"]
    spill = tmp_path / "spill"
    spill.mkdir()
    env = {**os.environ, "TMPDIR": str(spill)}
    args = ["--source", str(small_logs / f"ds={DAY}")] if stage == "ingest" else []
    cmd = [RECD, stage, "--warehouse", str(wh.root), "--ds", DAY, *args]
    staging = Path(wh.root) / table / "_staging"

    def writing():
        return any(f.is_file() and f.name != "_writer.lock" for f in staging.rglob("*"))

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(writing, every=0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert writing(), "killed mid-write: its staging is there"
    assert wh.manifest(table, DAY, **keys)["write_id"] == before, "the committed day untouched"
    # and whole (sizes, checksums, CRCs)
    BatchStore(wh, DAY, "dedup") if table == "batches" else wh.read(table, DAY, **keys)
    recd(stage, "--warehouse", wh.root, "--ds", DAY, *args, code=0, env=env)
    # the day whole after it (rebuilt, or kept where built from the same inputs and config)
    BatchStore(wh, DAY, "dedup") if table == "batches" else wh.read(table, DAY, **keys)
    assert not list(spill.glob("recd-*")), "the spill directories are swept"
    assert not [p for p in Path(wh.root).rglob("*") if p.parent.name == "_staging"]


def test_a_checkpoint_write_killed_midway_is_swept_and_a_live_one_kept(tmp_path):
    """A writer killed mid-write leaves its temporary file; while a writer lives the sweep
    leaves its file alone (its lock is held), once it is killed the next writer removes it."""
    wh = Warehouse(tmp_path / "wh")
    ckpts = Path(wh.root) / "checkpoints" / "run"
    ckpts.mkdir(parents=True)
    tmp = ckpts / f"step-00000100.pt{TMP_MARK}dead"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from recd_core.leftovers import hold; "
                f"fd = hold({str(tmp)!r}); open({str(tmp)!r}, 'ab').write(b'x' * 4096); "
                "print('writing', flush=True); time.sleep(120)"
            ),
        ],
        stdout=subprocess.PIPE,
    )
    assert child.stdout.readline().strip() == b"writing"
    assert sweep_files(wh.fs, str(ckpts)) == [] and tmp.exists(), "a live writer's is kept"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert sweep_files(wh.fs, str(ckpts)) == [tmp.name] and not tmp.exists()
    fd = hold(ckpts / f"step-1.pt{TMP_MARK}mine")  # this process's own, live
    try:
        assert sweep_files(wh.fs, str(ckpts)) == []
    finally:
        os.close(fd)


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MB tmpfs (the suite runs as root in CI); skipped where mounting is refused."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(disk: Path, leave_mb: float) -> Path:
    """A ballast file that leaves about `leave_mb` free on `disk`."""
    free = shutil.disk_usage(disk).free
    ballast = disk / "ballast"
    with ballast.open("wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(0, free - int(leave_mb * (1 << 20))))
    return ballast


def _leftover_files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if TMP_MARK in p.name or p.parent.name == "_staging"
    )


def test_a_full_disk_fails_cleanly_and_freeing_space_is_enough(small_disk, small_logs):
    """Each stage on a full disk: a one-line StorageFull, exit 1 (retryable), nothing half
    written left (no staging, no temporary file), the day before intact; freeing the space
    lets the same command succeed. A checkpoint or model write (`write_atomically`, ~150 MB
    on the small preset) the same, at the library level."""
    from recd_core.errors import StorageFull, classify
    from recd_core.leftovers import write_atomically

    wh = small_disk / "wh"
    common = ("--warehouse", wh, "--ds", DAY)
    recd("ingest", "--source", small_logs / f"ds={DAY}", *common, code=0)
    recd("generate", *common, code=0)
    recd("preprocess", *common, code=0)
    ballast = _fill(small_disk, 0.3)
    for stage, args in (
        ("ingest", ("--source", small_logs / f"ds={DAY}")),
        ("generate", ()),
        ("preprocess", ()),
    ):
        r = recd(stage, *common, *args, code=1)
        assert "no space left on the device" in r.stderr, r.stderr
        assert _leftover_files(wh) == [], f"{stage} left {_leftover_files(wh)}"
        assert Warehouse(wh).read("samples", DAY, layout="clustered").num_rows > 0, "intact"
    ckpt = f"{Warehouse(wh).root}/checkpoints/run/step-00000001.pt"
    with pytest.raises(OSError) as e:
        write_atomically(Warehouse(wh).fs, ckpt, b"\0" * (4 << 20))
    assert isinstance(classify(e.value), StorageFull)
    assert _leftover_files(wh) == [], "the partial checkpoint is removed"
    ballast.unlink()
    for stage, args in (
        ("ingest", ("--source", small_logs / f"ds={DAY}")),
        ("generate", ()),
        ("preprocess", ()),
    ):
        recd(stage, *common, *args, code=0)
    write_atomically(Warehouse(wh).fs, ckpt, b"\0" * (4 << 20))
    assert _leftover_files(wh) == []


def _mlflow_server(db: Path, port: int) -> subprocess.Popen:
    mlflow = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen(
        [
            str(mlflow),
            "server",
            "--backend-store-uri",
            f"sqlite:///{db}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--default-artifact-root",
            str(db.parent / "artifacts"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def up():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return server.poll() is not None and pytest.fail("the MLflow server did not start")

    _wait_for(up, timeout=120, every=0.2)
    return server


def _kill(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def test_a_tracking_server_killed_mid_run_is_told_truthfully_and_cleaned_up(tmp_path):
    """The server dies while `recd run` works: exit 4 (retryable), one line that names the
    stages done and those not run (never "the work succeeded"); the runs it left RUNNING are
    closed FAILED by the next command once the server is back."""
    from mlflow.tracking import MlflowClient

    port, db = free_port(), tmp_path / "mlflow.db"
    uri = f"http://127.0.0.1:{port}"
    server = _mlflow_server(db, port)
    cmd = [
        RECD,
        "--tracking-uri",
        uri,
        "run",
        "--warehouse",
        str(tmp_path / "wh"),
        "--logs",
        str(tmp_path / "logs"),
        "--ds",
        DAY,
        "--config",
        str(SMALL),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    client = MlflowClient(tracking_uri=uri)

    def training():
        try:
            runs = client.search_runs(["0", "1"], "tags.`recd.stage` = 'train'")
        except Exception:  # noqa: BLE001 - the experiment may not exist yet
            return False
        return bool(runs)

    try:
        _wait_for(training, timeout=300, every=0.2)
    except BaseException:  # neither the server nor the run outlives a failed wait
        proc.kill()
        raise
    finally:
        _kill(server)
    _, stderr = proc.communicate(timeout=600)
    assert "Traceback" not in stderr, stderr[-3000:]
    assert proc.returncode == 4, stderr
    line = stderr.strip().splitlines()[-1]
    assert "not run:" in line and "register" in line and "succeeded" not in line, line
    server = _mlflow_server(db, port)
    try:
        running = client.search_runs(["1"], "attributes.status = 'RUNNING'")
        assert running, "the dead run left runs open"
        recd(
            "--tracking-uri",
            uri,
            "synth",
            "--logs",
            tmp_path / "logs2",
            "--ds",
            DAY,
            "--preset",
            "small",
            code=0,
        )
        for run in running:
            after = client.get_run(run.info.run_id)
            assert after.info.status == "FAILED" and after.data.tags["recd.status"] == "abandoned"
    finally:
        _kill(server)
