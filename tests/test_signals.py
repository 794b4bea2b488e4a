"""Signals and run locks: a stopped `recd train` stops every process it started, and a
retry never trains beside a leftover of the run it retries."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
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


def test_a_second_run_of_a_day_waits_for_the_live_one_saying_so_then_uses_its_model(
    fresh_warehouse, monkeypatch, capsys
):
    """A manual run beside the scheduled one: the second waits while the first trains (a
    line every `WAIT_SAY_EVERY_S`, no error), then finds the first's model and uses it."""
    wh = fresh_warehouse
    preprocess(wh, DAY, PreprocessConfig(batch_size=512))
    monkeypatch.setattr(checkpoints, "WAIT_SAY_EVERY_S", 0.4)
    cfg = TrainConfig(batch_size=512, epochs=1, max_steps=2)
    first = train(wh, DAY, cfg)
    assert first["train.steps"] == 2 and not first.get("train.reused")
    holding, release = threading.Event(), threading.Event()

    def other_run():  # the run still holding the day's lock
        with one_writer(wh, DAY, "dedup"):
            holding.set()
            release.wait(30)

    t = threading.Thread(target=other_run)
    t.start()
    holding.wait(10)
    threading.Timer(1.5, release.set).start()
    second = train(wh, DAY, cfg)
    t.join()
    out = capsys.readouterr().out
    assert out.count("is training this day and arm; waiting for it") >= 2, out
    assert "trained by an earlier run on the same batches" in out
    assert second["train.reused"] and second["train.model_uri"] == first["train.model_uri"]
    assert second["train.val_ne"] == first["train.val_ne"]
    # a bounded wait gives up instead: retryable
    with one_writer(wh, DAY, "dedup"):
        bounded = one_writer(wh, DAY, "dedup", wait_s=0.3, say=lambda line: None)
        with pytest.raises(RunBusy, match="another live process is training") as e, bounded:
            pass
        assert e.value.retryable and e.value.exit_code == 1
