import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from event_lines import clean_lines, mutate
from hypothesis import given, settings
from hypothesis import strategies as st

from recd_core.config import IngestConfig
from recd_core.data.ingest import QuarantineExceeded, ingest
from recd_core.data.raw_bytes import SourceError

DAY = "2026-11-01"


def test_quarantine_over_the_limit_does_not_publish_events(day_logs, warehouse, features):
    ingest(day_logs, warehouse, DAY, features, IngestConfig())  # a good earlier run
    before = warehouse.read("events", DAY)
    lines = clean_lines(day_logs, 100)
    bad = [mutate(ln, label=7) for ln in lines[:10]] + lines[10:]
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
        [
            sys.executable,
            "-m",
            "recd_core.cli",
            "ingest",
            "--source",
            str(tmp_path / "nope"),
            "--warehouse",
            str(tmp_path / "wh"),
            "--ds",
            DAY,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "source not found" in lines[0]


def test_validation_is_order_preserving_and_exact(day_logs, warehouse, features):
    ingest(day_logs, warehouse, DAY, features, IngestConfig())
    events = warehouse.read("events", DAY)
    first = json.loads(clean_lines(day_logs, 1)[0])
    row = events.slice(0, 1).to_pylist()[0]
    for k, v in first.items():
        if isinstance(v, list) and v and isinstance(v[0], float):
            assert np.allclose(row[k], v, atol=1e-6)
        elif isinstance(v, float):
            assert abs(row[k] - v) < 1e-6
        else:
            assert row[k] == v, k


def test_an_id_past_the_table_of_a_feature_whose_ids_are_row_indices_is_quarantined(
    day_logs, warehouse, features
):
    """The synthetic feature set's ids are row indices (`hash: false`): an id at or past
    the table would wrap onto another id's row, so it is bad input; hashed, any id fits."""
    lines = clean_lines(day_logs, 20)
    items, tags = features["item_id"].table_size, features["item_tags"].table_size
    lines[3] = mutate(lines[3], item_id=items)
    lines[7] = mutate(lines[7], item_tags=[1, tags + 5])
    src = day_logs.parent / "beyond.jsonl"
    src.write_bytes(b"\n".join(lines))
    s = ingest(src, warehouse, DAY, features, IngestConfig(max_quarantine_fraction=1.0))
    q = sorted(warehouse.read("quarantine", DAY).to_pylist(), key=lambda r: r["line"])
    assert [(r["line"], r["field"]) for r in q] == [(4, "item_id"), (8, "item_tags")]
    assert q[0]["reason"] == (
        f"field 'item_id': id not below table_size {items} "
        f"(its ids are row indices: hash false), got {items}"
    )
    assert q[1]["reason"].startswith(f"field 'item_tags': id in list not below table_size {tags}")
    assert s["ingest.rows_ok"] == 18
    hashed = features.model_copy(
        update={"features": [f.model_copy(update={"hash": True}) for f in features.features]}
    )
    assert ingest(src, warehouse, DAY, hashed, IngestConfig())["ingest.rows_ok"] == 20


def test_an_event_whose_user_features_differ_within_its_session_is_quarantined(
    day_logs, warehouse, features
):
    lines = clean_lines(day_logs, 60)
    rows = [json.loads(x) for x in lines]
    sid = rows[0]["session_id"]
    same = [i for i, r in enumerate(rows) if r["session_id"] == sid]
    assert len(same) >= 2, "the first session has several events"
    victim = same[-1]
    lines[victim] = mutate(lines[victim], user_age=rows[victim]["user_age"] + 1)
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


def test_day_wide_checks_span_files_and_only_the_rows_they_reject_are_dropped(
    day_logs, tmp_path, warehouse, features
):
    """Ingest streams file by file; a redelivery and a session snapshot that changes are
    still found when the first copy / the session's first event is in another file."""
    lines = clean_lines(day_logs)
    first = json.loads(lines[0])
    same_session = [
        i for i, ln in enumerate(lines) if json.loads(ln)["session_id"] == first["session_id"]
    ]
    assert len(same_session) > 1
    changed = mutate(lines[same_session[1]], user_age=first["user_age"] + 1)
    src = tmp_path / "split"
    src.mkdir()
    parts = [lines[:1000], lines[1000:2000], lines[2000:]]
    parts[0] = [ln for i, ln in enumerate(parts[0]) if i != same_session[1]]
    parts[2] = [*parts[2], lines[10], changed]  # a redelivery; the session's later event
    for k, part in enumerate(parts):
        (src / f"events-{k}.jsonl").write_bytes(b"\n".join(part) + b"\n")
    s = ingest(src, warehouse, DAY, features, IngestConfig())
    q = warehouse.read("quarantine", DAY).to_pylist()
    assert [(r["source"].rsplit("/", 1)[1], r["line"], r["field"]) for r in q] == [
        ("events-2.jsonl", len(parts[2]) - 1, "event_id"),
        ("events-2.jsonl", len(parts[2]), "user_age"),
    ]
    redelivered = json.loads(lines[10])["event_id"]
    assert q[0]["reason"].startswith(f"duplicate event_id {redelivered}")
    assert f"events-0.jsonl:{parts[0].index(lines[10]) + 1})" in q[0]["reason"]
    assert q[1]["reason"].startswith("field 'user_age': differs from the first event")
    assert q[1]["raw"] == changed and q[0]["raw"] == lines[10], "the exact bytes"
    published = sorted(warehouse.read("events", DAY)["event_id"].to_pylist())
    assert published == sorted(
        json.loads(ln)["event_id"] for ln in lines if ln != lines[same_session[1]]
    )
    assert s["ingest.rows_in"] == len(lines) + 1 and s["ingest.rows_ok"] == len(lines) - 1


@pytest.mark.slow
def test_ray_engine_on_a_local_instance_matches_the_local_engine(day_logs, tmp_path, features):
    """Files parsed by Ray tasks, damaged lines and a redelivery across files included: the
    same events and quarantine partitions, byte for byte in content, as the local engine."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from recd_core.warehouse import Warehouse

    lines = clean_lines(day_logs)
    src = tmp_path / "src"
    src.mkdir()
    chunks = [lines[:1500], [b"{broken", *lines[1500:3000]], [*lines[3000:], lines[7]]]
    for k, chunk in enumerate(chunks):
        (src / f"events-{k}.jsonl").write_bytes(b"\n".join(chunk) + b"\n")
    parts = {}
    for engine in ("local", "ray"):
        wh = Warehouse(tmp_path / engine)
        cfg = IngestConfig(engine=engine, workers=2, max_quarantine_fraction=1)
        s = ingest(src, wh, DAY, features, cfg)
        parts[engine] = (wh.read("events", DAY), wh.read("quarantine", DAY), s["ingest.rows_ok"])
    (ev_l, q_l, ok_l), (ev_r, q_r, ok_r) = parts["local"], parts["ray"]
    assert ev_r.equals(ev_l) and q_r.equals(q_l) and ok_r == ok_l == len(lines)
    assert q_l.num_rows == 2  # the broken line, the redelivery


# -- the shared parse: a session's user-side text parsed once (data/shared_parse.py) ------------
def _plain(data: bytes, schema: pa.Schema):
    """Arrow's parse of the lines as they are (None where Arrow refuses them)."""
    import pyarrow.json as pj

    opts = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        return pj.read_json(
            pa.BufferReader(data),
            read_options=pj.ReadOptions(use_threads=False),
            parse_options=opts,
        )
    except pa.ArrowInvalid:
        return None


def _shared(data: bytes, schema: pa.Schema, shared: list[str]):
    import pyarrow.json as pj

    from recd_core.data.shared_parse import parse_shared
    from recd_core.data.sources import Lines

    lines = Lines.of(data)
    return parse_shared(
        data, lines.starts, lines.ends, schema, shared, pj.ReadOptions(use_threads=False)
    )


def test_a_sessions_user_side_text_is_parsed_once_into_the_same_table(
    day_logs, features, warehouse
):
    from recd_core.data.sources import read_json_lines
    from recd_core.schema import events_schema

    schema, user = events_schema(features), [f.name for f in features.by_side("user")]
    data = b"\n".join(clean_lines(day_logs))
    got = _shared(data, schema, user)
    assert got is not None, "the synthesized day's lines take the shared parse"
    assert got.equals(_plain(data, schema))
    src = day_logs.parent / "day.jsonl"
    src.write_bytes(data)
    (once, _), (whole, _) = read_json_lines(src, schema, user), read_json_lines(src, schema)
    assert once.table.equals(whole.table) and (once.lines == whole.lines).all()
    assert once.shared_lines == len(data.splitlines()) and whole.shared_lines == 0
    s = ingest(day_logs, warehouse, DAY, features, IngestConfig())
    assert s["ingest.rows_shared_parse"] == s["ingest.rows_in"], "the summary says so"


SESSION = [{"event_id": i, "user_id": 7, "user_tags": [1, 2], "item_id": 3 * i} for i in range(8)]
SMALL = pa.schema(
    [
        ("event_id", pa.int64()),
        ("user_id", pa.int64()),
        ("user_tags", pa.list_(pa.int64())),
        ("item_id", pa.int64()),
    ]
)


def _session_lines(**one_line) -> bytes:
    """Eight events of one session, compact JSON; `one_line` replaces the fourth's text."""
    lines = [json.dumps(r, separators=(",", ":")).encode() for r in SESSION]
    for k, v in one_line.items():
        lines[3] = lines[3].replace(k.encode(), v.encode(), 1)
    return b"\n".join(lines) + b"\n"


@pytest.mark.parametrize(
    "change",
    [
        {'"user_id":7': '"user_id":"7"'},  # a string value: Arrow refuses it
        {'"user_id":7': '"user_id":{"a":7}'},  # a nested object
        {'"item_id"': '"x":"a\\\\","item_id"'},  # a backslash in an unknown field's string
        {'"user_id":7,"user_tags":[1,2]': '"user_tags":[1,2],"user_id":7'},  # other key order
        {'"user_id":7': '"user_id":7,"user_id":8'},  # a key twice
        {'"user_tags":[1,2]': '"user_tags":[1,"user_id":2]'},  # a key inside a list
        {'"user_tags":[1,2],': '"user_tags":[1,2]'},  # a missing comma
        {'"user_id":7': '"user_id":7.5'},  # a fraction in an id
        {'"event_id":3,': '"event_id":3,"user_id":9,'},  # a shared key outside the span
    ],
)
def test_lines_the_shared_parse_cannot_cut_safely_are_left_to_the_plain_parse(change):
    data = _session_lines(**change)
    got, plain = _shared(data, SMALL, ["user_id", "user_tags"]), _plain(data, SMALL)
    assert got is None or (plain is not None and got.equals(plain)), change
    assert _shared(_session_lines(), SMALL, ["user_id", "user_tags"]).equals(
        _plain(_session_lines(), SMALL)
    ), "the undamaged session takes the shared parse"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_damage_to_a_line_gives_the_plain_parse_or_declines(data):
    """Whatever one edit does to one line of a session (a byte replaced, inserted or
    removed), the shared parse gives Arrow's table of the lines or leaves them to it."""
    text = bytearray(_session_lines())
    at = data.draw(st.integers(0, len(text) - 2))
    byte = data.draw(st.sampled_from(b'{}[]":,\\ 0-9.ea'))
    how = data.draw(st.sampled_from(["replace", "insert", "remove"]))
    if how == "replace":
        text[at] = byte
    elif how == "insert":
        text.insert(at, byte)
    else:
        del text[at]
    if b"\n\n" in text or not all(
        ln.startswith(b"{") and ln.endswith(b"}") for ln in bytes(text).splitlines()
    ):
        return  # the reader's own line checks deal with these, before any parse
    got, plain = _shared(bytes(text), SMALL, ["user_id", "user_tags"]), _plain(bytes(text), SMALL)
    assert got is None or (plain is not None and got.equals(plain)), bytes(text)


def test_lines_that_share_little_are_left_to_the_plain_parse_after_a_look_at_the_first():
    """Logs without sessions (every line its own user) are declined (by a look at the
    block's first lines); a session's block longer than that look is not."""
    from recd_core.data.shared_parse import PROBE_LINES

    n = 2 * PROBE_LINES
    rows = [{"event_id": i, "user_id": i, "user_tags": [1, 2], "item_id": 3} for i in range(n)]
    own = b"\n".join(json.dumps(r, separators=(",", ":")).encode() for r in rows) + b"\n"
    assert _shared(own, SMALL, ["user_id", "user_tags"]) is None
    for r in rows:
        r["user_id"] = 7  # one user
    one = b"\n".join(json.dumps(r, separators=(",", ":")).encode() for r in rows) + b"\n"
    got = _shared(one, SMALL, ["user_id", "user_tags"])
    assert got is not None and got.equals(_plain(one, SMALL))


def test_many_small_files_are_read_as_one_text_and_quarantined_by_file(
    day_logs, tmp_path, warehouse, features
):
    """600 one-line files (a few gzipped, one damaged, one cut short, one a repeat, one that
    expands past its share of the text) ingest as the same lines in one file do: the same
    events, each refusal named by its own file and line, and a handful of events files
    instead of 600."""
    import gzip

    lines = clean_lines(day_logs, 600)
    src = tmp_path / "many"
    src.mkdir()
    for k, line in enumerate(lines):
        name = src / f"part-{k:05d}.jsonl"
        if k % 50 == 7:  # gzipped members among plain ones
            (src / f"part-{k:05d}.jsonl.gz").write_bytes(gzip.compress(line + b"\n"))
        elif k == 10:
            name.write_bytes(b'{"event_id": 1, "broken\n')
        elif k == 30:
            name.write_bytes(lines[5] + b"\n")  # event 5 again
        elif k == 40:  # a gzip stream cut short: what came out of it is kept
            (src / f"part-{k:05d}.jsonl.gz").write_bytes(gzip.compress(line + b"\n" + line)[:-12])
        elif k == 20:  # 1 KB that expands to 1 MB, past its share: read on its own
            padded = line + b" " * (1 << 20) + b"\n"
            (src / f"part-{k:05d}.jsonl.gz").write_bytes(gzip.compress(padded))
        else:
            name.write_bytes(line)  # no final newline: still its own line
    s = ingest(src, warehouse, DAY, features, IngestConfig())
    q = {
        (r["source"].rsplit("/", 1)[1], r["line"]): r
        for r in warehouse.read("quarantine", DAY).to_pylist()
    }
    assert q[("part-00010.jsonl", 1)]["reason"].startswith("invalid JSON")
    assert q[("part-00030.jsonl", 1)]["field"] == "event_id"
    assert "part-00005.jsonl:1" in q[("part-00030.jsonl", 1)]["reason"]
    assert q[("part-00030.jsonl", 1)]["raw"] == lines[5], "the exact bytes"
    # its second line, cut mid-way, and the stream's end: each named in its own file
    cut = {k[1]: r["reason"] for k, r in q.items() if k[0] == "part-00040.jsonl.gz"}
    assert "gzip stream truncated" in cut[3] and 2 in cut, cut
    events = warehouse.read("events", DAY)
    expected = {json.loads(ln)["event_id"] for k, ln in enumerate(lines) if k not in (10, 30, 40)}
    assert expected <= set(events["event_id"].to_pylist())
    assert s["ingest.files"] == 600 and s["ingest.rows_ok"] == events.num_rows
    assert len(warehouse.info("events", DAY).files) < 10
