"""Property-based tests of ingestion: valid events always pass unchanged; a corrupted line is
always quarantined (and only that line), whatever the corruption and wherever it lands."""

import json
import math
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recd_core.config import FeatureSet, IngestConfig
from recd_core.data.ingest import ingest
from recd_core.warehouse import Warehouse

FEATURES = FeatureSet.model_validate(
    {
        "name": "props",
        "features": [
            {"name": "user_id", "side": "user", "kind": "sparse", "table_size": 100},
            {
                "name": "user_tags",
                "side": "user",
                "kind": "id_list",
                "table_size": 100,
                "max_length": 5,
            },
            {"name": "user_emb", "side": "user", "kind": "dense", "dim": 2},
            {"name": "item_id", "side": "item", "kind": "sparse", "table_size": 100},
            {"name": "item_score", "side": "item", "kind": "dense"},
        ],
    }
)
I64 = st.integers(min_value=0, max_value=2**63 - 1)
DAY = "2026-11-01"
DAY_START = 1_793_491_200_000  # 2026-11-01T00:00Z in ms
# what a day accepts: from a day before it (late arrivals) to an hour after it (clock skew)
TS_OK = st.integers(DAY_START - 86_400_000, DAY_START + 25 * 3_600_000 - 1)
F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def events(draw, min_size=1, max_size=30):
    """Valid events: a few sessions, each with its user-side snapshot (shared by all its
    events, as ingest requires), and per-event item/context values."""
    n = draw(st.integers(min_size, max_size))
    ids = draw(st.lists(I64, min_size=n, max_size=n, unique=True))
    sessions = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "session_id": I64,
                    "user_id": I64,
                    "user_tags": st.lists(I64, max_size=5),
                    "user_emb": st.lists(F32, min_size=2, max_size=2),
                }
            ),
            min_size=1,
            max_size=4,
            unique_by=lambda s: s["session_id"],
        )
    )
    return [
        {
            "event_id": eid,
            "ts": draw(TS_OK),
            **draw(st.sampled_from(sessions)),
            "label": draw(st.sampled_from([0, 1])),
            "item_id": draw(I64),
            "item_score": draw(F32),
        }
        for eid in ids
    ]


CORRUPTIONS = {
    "user_id": st.one_of(
        st.integers(max_value=-1),
        st.text(max_size=3),
        st.floats(allow_nan=False).filter(lambda x: x != int(x) if math.isfinite(x) else True),
        st.booleans(),
        st.integers(min_value=2**63),
    ),
    "label": st.one_of(
        st.integers().filter(lambda x: x not in (0, 1)),
        st.booleans(),
        st.none(),
        st.text(max_size=2),
    ),
    "user_tags": st.one_of(
        st.lists(I64, min_size=6, max_size=9),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.integers(),
        st.just([None]),
    ),
    "user_emb": st.one_of(
        st.lists(F32, min_size=0, max_size=1),
        st.lists(F32, min_size=3, max_size=4),
        st.just([float("nan"), 1.0]),
        st.just([1.0, float("-inf")]),
    ),
    "item_score": st.one_of(
        st.just(float("nan")), st.just(float("inf")), st.text(max_size=2), st.lists(F32, max_size=2)
    ),
    "ts": st.one_of(
        st.integers(max_value=-1),
        st.none(),
        st.integers(0, DAY_START - 86_400_001),
        st.integers(DAY_START + 25 * 3_600_000, 2**63 - 1),
    ),
}


def _ingest(lines: list[bytes]):
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "events.jsonl"
        src.write_bytes(b"\n".join(lines) + b"\n")
        wh = Warehouse(Path(d) / "wh")
        summary = ingest(src, wh, DAY, FEATURES, IngestConfig(max_quarantine_fraction=1.0))
        events = wh.read("events", DAY) if summary["ingest.rows_ok"] else None
        return summary, events, wh.read("quarantine", DAY).to_pylist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events())
def test_valid_events_are_all_accepted_unchanged(rows):
    summary, table, quarantine = _ingest([json.dumps(r).encode() for r in rows])
    assert quarantine == [] and summary["ingest.rows_ok"] == len(rows)
    got = {r["event_id"]: r for r in table.to_pylist()}
    for r in rows:
        g = got[r["event_id"]]
        for k, v in r.items():
            if k in ("user_emb", "item_score"):
                assert np.array_equal(np.float32(g[k]), np.float32(v)), k
            else:
                assert g[k] == v, k


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events(min_size=2), st.data())
def test_one_corrupted_line_is_quarantined_alone(rows, data):
    victim = data.draw(st.integers(0, len(rows) - 1))
    lines = [json.dumps(r).encode() for r in rows]
    how = data.draw(st.sampled_from([*CORRUPTIONS, "missing", "truncate"]))
    field = None
    if how == "truncate":
        lines[victim] = lines[victim][: data.draw(st.integers(0, len(lines[victim]) - 1))]
    elif how == "missing":
        field = data.draw(st.sampled_from(sorted(rows[victim])))
        del rows[victim][field]
        lines[victim] = json.dumps(rows[victim]).encode()
    else:
        field = how
        rows[victim][field] = data.draw(CORRUPTIONS[field])
        lines[victim] = json.dumps(rows[victim]).encode()
    summary, table, quarantine = _ingest(lines)
    assert (
        summary["ingest.rows_in"]
        == len(rows)
        == summary["ingest.rows_ok"] + summary["ingest.rows_quarantined"]
    )
    assert [q["line"] for q in quarantine] == [victim + 1]
    assert quarantine[0]["raw"] == lines[victim] and quarantine[0]["reason"]
    if field is not None:
        assert quarantine[0]["field"] == field, quarantine[0]
    assert summary["ingest.rows_ok"] == len(rows) - 1
