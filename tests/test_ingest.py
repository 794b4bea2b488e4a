import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recd_core.config import IngestConfig
from recd_core.data.ingest import QuarantineExceeded, ingest
from recd_core.data.sources import SourceError

DAY = "2026-11-01"


def _clean_lines(day_logs, n=None):
    lines = gzip.decompress(next(iter(sorted(day_logs.glob("*.gz")))).read_bytes()).splitlines()
    return lines[:n] if n else lines


def _mutate(line: bytes, **changes) -> bytes:
    obj = json.loads(line)
    for k, v in changes.items():
        if v is KeyError:
            del obj[k]
        else:
            obj[k] = v
    return json.dumps(obj).encode()


def damaged_cases(clean: list[bytes]):
    """(damaged line, expected field or None, expected reason substring)."""
    c = iter(clean)
    return [
        (next(c)[:57], None, "invalid JSON"),  # truncated mid-line
        (next(c).replace(b'"user_id"', b'"user_\xff\xfeid"'), None, "invalid UTF-8"),
        (_mutate(next(c), user_id="12"), "user_id", "expected an integer"),
        (_mutate(next(c), label=True), "label", "expected an integer"),
        (_mutate(next(c), item_dense=[1.0, "x", 2.0, 3.0]), "item_dense", "expected a number"),
        (_mutate(next(c), user_friends=[1, 2.5]), "user_friends", "expected an integer"),
        (_mutate(next(c), user_id=-5), "user_id", "negative id -5"),
        (_mutate(next(c), item_tags=[3, -1]), "item_tags", "negative id in list"),
        (_mutate(next(c), user_dense=[float("nan")] * 16), "user_dense", "not finite"),
        (_mutate(next(c), item_dense=[1.0, float("inf"), 0.0, 0.0]), "item_dense", "not finite"),
        (_mutate(next(c), label=2), "label", "must be 0 or 1, got 2"),
        (_mutate(next(c), ts=-1), "ts", "negative value -1"),
        (_mutate(next(c), item_id=KeyError), "item_id", "missing required field 'item_id'"),
        (_mutate(next(c), session_id=None), "session_id", "missing required field"),
        (
            _mutate(next(c), user_history=list(range(129))),
            "user_history",
            "length 129 exceeds max_length 128",
        ),
        (_mutate(next(c), item_tags=[1, None]), "item_tags", "null list element"),
        (_mutate(next(c), item_dense=[1.0, 2.0]), "item_dense", "expected 4 values, got 2"),
        (_mutate(next(c), user_id=2**70), "user_id", "out of range"),
        (_mutate(next(c), item_tags={"a": 1}), "item_tags", "expected a list"),
        (b"[1, 2, 3]", None, "not a JSON object"),
        (b"null", None, "not a JSON object"),
        (b'"just a string"', None, "not a JSON object"),
        (next(c) + next(c), None, "more than one JSON value"),
        (next(c).replace(b'{"event_id"', b'{"label":0,"event_id"'), "label", "appears twice"),
        (b"", None, "empty line"),
        (b"   \t ", None, "empty line"),
    ], list(c)


def test_every_damaged_line_quarantined_with_reason_and_every_clean_line_accepted(
    day_logs, warehouse, features
):
    clean_all = _clean_lines(day_logs, 400)
    cases, clean = damaged_cases(clean_all)
    dup = clean[5]  # redelivered event: the second copy is quarantined
    out, expected = [], {}
    for i, line in enumerate(clean):
        out.append(line)
        if i < len(cases):
            out.append(cases[i][0])
            expected[len(out)] = cases[i]
    out.append(dup)
    expected[len(out)] = (dup, "event_id", "duplicate event_id")
    src = day_logs.parent / "damaged.jsonl.gz"
    src.write_bytes(gzip.compress(b"\n".join(out) + b"\n"))

    s = ingest(src, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=1.0))
    assert s["ingest.rows_in"] == len(out) == s["ingest.rows_ok"] + s["ingest.rows_quarantined"]
    assert s["ingest.rows_ok"] == len(clean)
    q = warehouse.read("quarantine", DAY).to_pylist()
    got = {r["line"]: r for r in q}
    assert set(got) == set(expected), "exactly the damaged lines are quarantined"
    for line_no, (raw, field, reason) in expected.items():
        row = got[line_no]
        assert reason in row["reason"], (line_no, row["reason"])
        assert row["field"] == field, (line_no, row)
        assert row["raw"] == raw, "the rejected bytes are kept exactly"
        assert row["source"] == str(src)
    events = warehouse.read("events", DAY)
    assert sorted(events["event_id"].to_pylist()) == sorted(
        json.loads(x)["event_id"] for x in clean
    )


def test_truncated_gzip_keeps_readable_rows_and_reports_the_cut(day_logs, warehouse, features):
    src = next(iter(sorted(day_logs.glob("*.gz"))))
    data = src.read_bytes()
    cut = day_logs.parent / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    s = ingest(cut, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=1.0))
    q = warehouse.read("quarantine", DAY).to_pylist()
    assert any("truncated" in r["reason"] for r in q)
    assert s["ingest.rows_ok"] > 100
    assert s["ingest.rows_in"] == s["ingest.rows_ok"] + s["ingest.rows_quarantined"]


def test_a_deeply_nested_line_is_quarantined_and_the_day_published(day_logs, warehouse, features):
    clean = _clean_lines(day_logs, 50)
    deep = [b"[" * 10_000 + b"]" * 10_000,
            b'{"event_id": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}"]  # fmt: skip
    src = day_logs.parent / "deep.jsonl"
    src.write_bytes(b"\n".join(clean[:25] + deep + clean[25:]) + b"\n")
    s = ingest(src, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=1.0))
    assert s["ingest.rows_in"] == 52 and s["ingest.rows_ok"] == 50
    q = warehouse.read("quarantine", DAY).to_pylist()
    assert len(q) == 2 and all(r["reason"].startswith("invalid JSON") for r in q)


def test_a_file_name_that_is_not_utf8_is_kept_escaped_in_the_quarantine(day_logs, tmp_path,
                                                                       warehouse, features):  # fmt: skip
    src = tmp_path / "latin1"
    src.mkdir()
    clean = _clean_lines(day_logs, 20)
    (src / os.fsdecode(b"ev\xe9.jsonl")).write_bytes(b"\n".join([*clean, b"{broken"]) + b"\n")
    s = ingest(src, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=1.0))
    assert s["ingest.rows_ok"] == 20 and s["ingest.rows_quarantined"] == 1
    (bad,) = warehouse.read("quarantine", DAY).to_pylist()
    assert bad["source"].endswith("ev\\xe9.jsonl") and bad["line"] == 21


def test_a_utf8_bom_at_the_start_of_a_file_is_accepted(day_logs, tmp_path, warehouse, features):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b"\n".join(_clean_lines(day_logs, 30)) + b"\n")
    s = ingest(src, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=0.0))
    assert s["ingest.rows_ok"] == 30 and s["ingest.rows_quarantined"] == 0


def test_a_valid_event_with_a_huge_unknown_field_is_accepted(day_logs, tmp_path, warehouse,
                                                              features):  # fmt: skip
    """Unknown fields are ignored, however large (one bigger than Arrow's 4 MiB block was
    quarantined as a "straddling object")."""
    clean = _clean_lines(day_logs, 10)
    big = clean[3][:-1] + b', "blob": "' + b"x" * (6 << 20) + b'"}'
    src = tmp_path / "big.jsonl"
    src.write_bytes(b"\n".join([*clean[:3], big, *clean[4:]]) + b"\n")
    s = ingest(src, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=0.0))
    assert s["ingest.rows_ok"] == 10


def test_quarantine_over_the_limit_does_not_publish_events(day_logs, warehouse, features):
    ingest(day_logs, warehouse, DAY, features, IngestConfig())  # a good earlier run
    before = warehouse.read("events", DAY)
    lines = _clean_lines(day_logs, 100)
    bad = [_mutate(ln, label=7) for ln in lines[:10]] + lines[10:]
    src = day_logs.parent / "bad.jsonl"
    src.write_bytes(b"\n".join(bad))
    with pytest.raises(QuarantineExceeded, match=r"10 of 100 rows \(10.0%\) quarantined"):
        ingest(src, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=0.05))
    assert warehouse.read("quarantine", DAY).num_rows == 10, (
        "the quarantine is written for inspection"
    )
    assert warehouse.read("events", DAY).equals(before), (
        "the previous events partition is untouched"
    )


def test_parquet_source_matches_json_and_mistyped_columns_are_quarantined(
    day_logs, warehouse, features, tmp_path
):
    s_json = ingest(day_logs, warehouse, DAY, features, IngestConfig())
    from_json = warehouse.read("events", DAY)
    pq.write_table(from_json, tmp_path / "events.parquet")
    s_pq = ingest(tmp_path / "events.parquet", warehouse, DAY, features, IngestConfig())
    assert s_pq["ingest.rows_ok"] == s_json["ingest.rows_ok"]
    assert warehouse.read("events", DAY).equals(from_json)

    bad = from_json.slice(0, 50).set_column(
        from_json.schema.get_field_index("user_id"), "user_id", pa.array(["u"] * 50)
    )
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(QuarantineExceeded):
        ingest(tmp_path / "bad.parquet", warehouse, DAY, features, IngestConfig())
    q = warehouse.read("quarantine", DAY)
    assert q.num_rows == 50
    assert set(q["field"].to_pylist()) == {"user_id"}
    assert "cannot be read as int64" in q["reason"][0].as_py()
    assert json.loads(q["raw"][0].as_py())["user_id"] == "u"  # the row itself is kept

    narrow = from_json.slice(0, 20).drop_columns(["item_id"])
    pq.write_table(narrow, tmp_path / "narrow.parquet")
    s = ingest(
        tmp_path / "narrow.parquet",
        warehouse,
        DAY,
        features,
        IngestConfig(max_quarantine_fraction=1),
    )
    assert s["ingest.rows_quarantined"] == 20
    assert set(warehouse.read("quarantine", DAY)["reason"].to_pylist()) == {
        "missing required field 'item_id'"
    }


def test_missing_and_unreadable_sources_fail_with_one_line(tmp_path, warehouse, features):
    with pytest.raises(SourceError, match="source not found"):
        ingest(tmp_path / "nope", warehouse, DAY, features, IngestConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no input files"):
        ingest(tmp_path / "empty", warehouse, DAY, features, IngestConfig())
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SourceError, match="not a readable Parquet file"):
        ingest(tmp_path / "x.parquet", warehouse, DAY, features, IngestConfig())
    r = subprocess.run(
        [sys.executable, "-m", "recd_core.cli", "ingest", "--source", str(tmp_path / "nope"),
         "--warehouse", str(tmp_path / "wh"), "--ds", DAY],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "source not found" in lines[0]


def test_validation_is_order_preserving_and_exact(day_logs, warehouse, features):
    ingest(day_logs, warehouse, DAY, features, IngestConfig())
    events = warehouse.read("events", DAY)
    first = json.loads(_clean_lines(day_logs, 1)[0])
    row = events.slice(0, 1).to_pylist()[0]
    for k, v in first.items():
        if isinstance(v, list) and v and isinstance(v[0], float):
            assert np.allclose(row[k], v, atol=1e-6)
        elif isinstance(v, float):
            assert abs(row[k] - v) < 1e-6
        else:
            assert row[k] == v, k


def test_an_event_whose_user_features_differ_within_its_session_is_quarantined(
    day_logs, warehouse, features
):
    lines = _clean_lines(day_logs, 60)
    rows = [json.loads(x) for x in lines]
    sid = rows[0]["session_id"]
    same = [i for i, r in enumerate(rows) if r["session_id"] == sid]
    assert len(same) >= 2, "the first session has several events"
    victim = same[-1]
    lines[victim] = _mutate(lines[victim], user_age=rows[victim]["user_age"] + 1)
    src = day_logs.parent / "drift.jsonl"
    src.write_bytes(b"\n".join(lines))
    s = ingest(src, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=1.0))
    q = warehouse.read("quarantine", DAY).to_pylist()
    assert [r["line"] for r in q] == [victim + 1] and q[0]["field"] == "user_age"
    assert f"differs from the first event of session {sid}" in q[0]["reason"]
    assert s["ingest.rows_ok"] == len(lines) - 1
    from recd_core.schema import sessions_checked

    assert sessions_checked(warehouse.read("events", DAY).schema)
    ingest(src, warehouse, DAY, features, IngestConfig(check_sessions=False))
    assert warehouse.read("events", DAY).num_rows == len(lines)
    assert not sessions_checked(warehouse.read("events", DAY).schema)
