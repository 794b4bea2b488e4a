"""End to end through the `recd` console script on the small preset."""

import gzip
import json
import time
from pathlib import Path

import pytest
from recd_cli import recd

DAY = "2026-11-01"
SMALL_CONFIG = Path(__file__).parent / "configs/small.yaml"  # days of seconds


@pytest.mark.slow
def test_synth_ingest_generate_with_contract_summaries(tmp_path: Path):
    logs, wh = tmp_path / "logs", tmp_path / "wh"
    recd(
        "synth",
        "--logs",
        logs,
        "--preset",
        "small",
        "--ds",
        DAY,
        "--days",
        "2",
        "--seed",
        "3",
        "--summary",
        tmp_path / "synth.json",
    )
    assert sorted(p.name for p in logs.iterdir()) == ["ds=2026-11-01", "ds=2026-11-02"]
    r = recd(
        "ingest",
        "--source",
        logs / f"ds={DAY}",
        "--warehouse",
        wh,
        "--ds",
        DAY,
        "--summary",
        tmp_path / "ingest.json",
    )
    assert "ingest.rows_ok" in r.stdout  # a readable summary
    ing = json.loads((tmp_path / "ingest.json").read_text())
    assert ing["status"] == "ok"
    assert ing["ingest.rows_in"] == ing["ingest.rows_ok"] + ing["ingest.rows_quarantined"] > 3000
    assert ing["ingest.rows_per_s"] > 0
    recd(
        "generate",
        "--warehouse",
        wh,
        "--ds",
        DAY,
        "--layout",
        "both",
        "--batch-size",
        "512",
        "--summary",
        tmp_path / "gen.json",
    )
    gen = json.loads((tmp_path / "gen.json").read_text())
    for key in (
        "storage.bytes",
        "storage.rows",
        "storage.bytes_per_sample",
        "storage.sessions",
        "dedup.factor.mean",
        "dedup.factor.user_history",
        "storage.lower_bound_bytes",
        "storage.ratio",
    ):
        assert key in gen, key
    assert gen["storage.rows"] == ing["ingest.rows_ok"]
    assert gen["storage.ratio"] > 1.5
    assert (wh / "samples" / "layout=clustered" / f"ds={DAY}" / "_manifest.json").exists()
    assert (wh / "samples" / "layout=shuffled" / f"ds={DAY}" / "_manifest.json").exists()


@pytest.mark.slow
def test_run_is_idempotent_for_a_day(tmp_path: Path):
    args = (
        "run",
        "--warehouse",
        tmp_path / "wh",
        "--logs",
        tmp_path / "logs",
        "--ds",
        DAY,
        "--config",
        SMALL_CONFIG,
    )
    recd(*args, "--summary", tmp_path / "a.json")
    first = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "wh").rglob("*.parquet")}
    recd(*args, "--summary", tmp_path / "b.json")
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["synth.days"] == 2 and b["synth.days"] == 0, "the days' logs are reused"
    for key in ("ingest.rows_ok", "storage.rows", "storage.bytes", "storage.ratio"):
        assert a[key] == b[key], key
    second = list((tmp_path / "wh").rglob("*.parquet"))
    assert len(second) == len(first), "same partitions, no duplicates"
    data = [p for p in second if not p.name.startswith("_side-")]  # session-normalized
    assert {p.parent for p in second} == {p.parent for p in data}
    tables = sorted(str(p.parent.relative_to(tmp_path / "wh")) for p in data)
    assert tables == sorted(
        [
            "events/ds=2026-11-01",
            "quarantine/ds=2026-11-01",
            "samples/layout=clustered/ds=2026-11-01",
            "samples/layout=shuffled/ds=2026-11-01",
            # the evaluation day (the day after)
            "events/ds=2026-11-02",
            "quarantine/ds=2026-11-02",
            "samples/layout=clustered/ds=2026-11-02",
        ]
    )


def test_run_takes_every_config_override_and_hands_it_to_its_stages(tmp_path: Path):
    """`recd run --max-steps 3 --workers 1`: the train stage takes the one, ingest, generate
    and preprocess the other, and no stage refuses what is another's."""
    recd(
        "run",
        "--warehouse",
        tmp_path / "wh",
        "--logs",
        tmp_path / "logs",
        "--ds",
        DAY,
        "--config",
        SMALL_CONFIG,
        "--max-steps",
        "3",
        "--workers",
        "1",
        "--summary",
        tmp_path / "s.json",
    )
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["train.steps"] == 3


def test_quarantine_gate_exits_nonzero_with_one_line(tmp_path: Path, day_logs):
    src = tmp_path / "bad.jsonl"
    lines = gzip.decompress(next(iter(sorted(day_logs.glob("*.gz")))).read_bytes()).splitlines()[
        :50
    ]
    src.write_bytes(b"\n".join([b"{broken"] * 10 + lines))
    r = recd(
        "ingest",
        "--source",
        src,
        "--warehouse",
        tmp_path / "wh",
        "--ds",
        DAY,
        "--summary",
        tmp_path / "s.json",
        code=None,
    )
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "not published" in r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert (
        s["status"] == "failed"
        and s["ingest.rows_quarantined"] == 10
        and s["ingest.published"] is False
    )
    assert not (tmp_path / "wh" / "events" / f"ds={DAY}").exists()
    assert (tmp_path / "wh" / "quarantine" / f"ds={DAY}" / "_manifest.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (("generate", "--warehouse", "{tmp}/wh", "--ds", DAY), "no partition events/ds=2026-11-01"),
        (
            ("ingest", "--source", "{tmp}", "--warehouse", "{tmp}/wh", "--ds", "2026-13-01"),
            "YYYY-MM-DD",
        ),
        (("synth", "--logs", "{tmp}/x", "--ds", "tomorrow"), "--ds must be a date"),
        (
            (
                "ingest",
                "--source",
                "{tmp}",
                "--warehouse",
                "{tmp}/wh",
                "--ds",
                DAY,
                "--config",
                "{tmp}/none.yaml",
            ),
            "config file not found",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args, message):
    r = recd(*(a.format(tmp=tmp_path) for a in args), code=None)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr


def test_run_without_a_day_trains_on_the_day_before_the_last_complete_one():
    """`recd run` / `recd compare` without `--ds` follow the schedule's day rule: the model
    is scored on the last day that is over (yesterday), so it trains on the day before; a
    run at 00:30 does not score on a day that has just begun."""
    import datetime as dt

    from recd_core.orchestration.schedule import training_day_or_default

    at = dt.datetime(2026, 11, 27, 0, 30, tzinfo=dt.UTC)
    assert training_day_or_default(None, at) == "2026-11-25"
    assert training_day_or_default(None, at.replace(hour=23)) == "2026-11-25"
    assert training_day_or_default("2026-10-01", at) == "2026-10-01"


def test_work_that_goes_quiet_still_says_so_in_a_log_at_every_interval(monkeypatch, capsys):
    """Off a terminal (a task log), progress is lines: one each interval while work runs,
    whether or not it advances, so a long step never reads as a hang."""
    from recd_core import report

    monkeypatch.setattr(report, "LINE_EVERY_S", 0.3)
    with report.progress("train", None) as advance:
        time.sleep(1.0)  # one long step: no advance
        advance("day 1", 5)
        time.sleep(0.45)
    lines = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("train: working, ") for ln in lines) >= 2, lines
    assert any(ln.startswith("train: 5 done, ") and "(day 1)" in ln for ln in lines), lines
