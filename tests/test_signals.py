"""Signals and run locks: a stopped `recd train` stops every process it started, and a
retry never trains beside a leftover of the run it retries."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from recd_core.config import PreprocessConfig, TrainConfig
from recd_core.dpp.preprocess import preprocess
from recd_core.modeling import checkpoints
from recd_core.modeling.checkpoints import RunBusy, one_writer
from recd_core.modeling.train import train

DAY = "2026-11-01"


def _ranks(parent: psutil.Process) -> list[psutil.Process]:
    """The training ranks torch spawned under `parent`."""
    out = []
    for p in parent.children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_sigterm_to_a_two_process_train_stops_every_rank_and_the_retry_trains(fresh_warehouse):
    wh = fresh_warehouse
    # no validation slice: nothing stops the run early, it trains all its passes
    preprocess(wh, DAY, PreprocessConfig(batch_size=256, validation_fraction=0.0))
    cmd = [
        sys.executable,
        "-m",
        "recd_core.cli",
        "train",
        "--warehouse",
        str(wh.root),
        "--ds",
        DAY,
        "--nproc",
        "2",
        "--batch-size",
        "256",
    ]
    # started as a shell's background job is (SIGINT ignored, inherited by the ranks): torch's
    # own parent-death signal to its ranks is a SIGINT, which they then never see
    proc = subprocess.Popen(
        [*cmd, "--epochs", "5000"],
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    while len(ranks := _ranks(parent)) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.2)
    time.sleep(3)  # well into their work
    proc.send_signal(signal.SIGTERM)  # a pod stopped, an Airflow task timed out
    assert proc.wait(timeout=30) == -signal.SIGTERM
    gone, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive, f"ranks left running: {[p.pid for p in alive]}"
    # the retry (one process) takes the day's lock at once, no leftover holding it, and trains
    retry = subprocess.run(
        [*cmd[:-4], "--batch-size", "256", "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert retry.returncode == 0, retry.stderr[-2000:]


def test_a_run_waits_for_a_live_writer_of_its_day_then_says_so(fresh_warehouse, monkeypatch):
    wh = fresh_warehouse
    preprocess(wh, DAY, PreprocessConfig(batch_size=512))
    monkeypatch.setattr(checkpoints, "RUN_LOCK_WAIT_S", 0.5)
    cfg = TrainConfig(batch_size=512, epochs=1, max_steps=2)
    with one_writer(wh, DAY, "dedup"):  # a leftover still holding the day's run
        with pytest.raises(RunBusy, match="another live process is training") as e:
            train(wh, DAY, cfg)
        assert e.value.retryable and e.value.exit_code == 1
    assert train(wh, DAY, cfg)["train.steps"] == 2  # once it is gone, the run trains
