import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from recd_core.config import GenerateConfig, IngestConfig
from recd_core.data.generate import generate, session_clustered_order
from recd_core.data.ingest import ingest
from recd_core.dedup.unique import batch_factors, row_hashes

DAY = "2026-11-01"


@pytest.fixture
def generated(day_logs, warehouse, features):
    ingest(day_logs, warehouse, DAY, features, IngestConfig())
    summary = generate(
        warehouse, DAY, GenerateConfig(batch_size=512), layouts=("clustered", "shuffled")
    )
    return warehouse, summary


def test_clustered_layout_keeps_sessions_contiguous_ordered_by_user_then_time(generated):
    wh, _ = generated
    t = wh.read("samples", DAY, layout="clustered")
    sid = np.asarray(t["session_id"])
    starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
    assert len(starts) == len(np.unique(sid)), "each session is one contiguous run"
    users = np.asarray(t["user_id"])[starts]
    ts = np.asarray(t["ts"])
    assert (np.diff(users) >= 0).all(), "sessions ordered by user"
    same_user = np.diff(users) == 0
    assert (np.diff(ts[starts])[same_user] >= 0).all(), "then by session start"
    run_ts = np.split(ts, starts[1:])
    assert all((np.diff(r) >= 0).all() for r in run_ts), "then by time within the session"


def test_both_layouts_hold_the_same_samples(generated):
    wh, _ = generated
    c = wh.read("samples", DAY, layout="clustered").sort_by("event_id")
    s = wh.read("samples", DAY, layout="shuffled")
    assert not s["event_id"].equals(c["event_id"]), "shuffled is not in clustered order"
    assert s.sort_by("event_id").equals(c)
    assert c.equals(wh.read("events", DAY).sort_by("event_id"))


def test_summary_reports_storage_dedup_and_lower_bound(generated, features):
    _, s = generated
    for key in (
        "storage.bytes",
        "storage.rows",
        "storage.bytes_per_sample",
        "storage.sessions",
        "dedup.factor.mean",
    ):
        assert key in s
    for f in features.features:
        assert f"dedup.factor.{f.name}" in s
    clustered, shuffled = s["layouts"]["clustered"], s["layouts"]["shuffled"]
    assert s["storage.ratio"] == pytest.approx(
        shuffled["storage.bytes"] / clustered["storage.bytes"]
    )
    assert s["storage.ratio"] > 1.5
    assert clustered["storage.bytes"] <= 1.15 * clustered["storage.lower_bound_bytes"]
    # user-side features repeat within a session: clustered batches are full of duplicates
    assert clustered["dedup.factor.user_history"] > 8
    assert clustered["dedup.factor.user_history"] > 4 * shuffled["dedup.factor.user_history"]
    # item-side features do not care about the layout
    assert clustered["dedup.factor.item_id"] == pytest.approx(
        shuffled["dedup.factor.item_id"], rel=0.25
    )


def test_regenerating_is_idempotent(generated):
    wh, first = generated
    before = wh.read("samples", DAY, layout="shuffled")
    again = generate(wh, DAY, GenerateConfig(batch_size=512), layouts=("shuffled",))
    assert wh.read("samples", DAY, layout="shuffled").equals(before)
    assert again["storage.rows"] == first["layouts"]["shuffled"]["storage.rows"]


def test_row_groups_and_files_follow_config(day_logs, warehouse, features):
    import pyarrow.parquet as pq

    ingest(day_logs, warehouse, DAY, features, IngestConfig())
    generate(warehouse, DAY, GenerateConfig(row_group_size=500, max_rows_per_file=1500))
    files = warehouse.files("samples", DAY, layout="clustered")
    assert len(files) == int(
        np.ceil(warehouse.info("samples", DAY, layout="clustered").rows / 1500)
    )
    meta = pq.ParquetFile(files[0]).metadata
    assert meta.num_row_groups == 3
    assert meta.row_group(0).column(0).compression == "ZSTD"


def test_dedup_factor_by_hand():
    col = pa.array([[1, 2], [1, 2], [2, 1], [], [], None, [1, 2], [3]])
    h = row_hashes(col)
    assert h[0] == h[1] == h[6] and h[0] != h[2] and h[3] == h[4] and h[5] != h[3]
    assert batch_factors(h, 4).tolist() == [4 / 3, 4 / 4]
    ints = pa.array([5, 5, 5, 7])
    assert batch_factors(row_hashes(ints), 2).tolist() == [2.0, 1.0]
    floats = pa.array([0.5, 0.5, -0.5], pa.float32())
    assert batch_factors(row_hashes(floats), 3).tolist() == [1.5]


def test_session_order_tolerates_interleaved_input():
    t = pa.table(
        {
            "event_id": [1, 2, 3, 4, 5],
            "ts": [50, 10, 60, 20, 5],
            "session_id": [7, 8, 7, 8, 9],
            "user_id": [1, 1, 1, 1, 0],
        }
    )
    order = session_clustered_order(t, "user_id")
    assert t.take(pa.array(order))["event_id"].to_pylist() == [5, 2, 4, 1, 3]


def test_a_small_memory_budget_streams_in_buckets_with_the_same_result(generated):
    """Rows move through spill files a bucket at a time: many small buckets (batches that
    straddle them) give the same partitions and the same figures as one bucket."""
    wh, _ = generated
    one = GenerateConfig(batch_size=300, row_group_size=500, memory_budget_mb=4096)
    many = one.model_copy(update={"memory_budget_mb": 16})
    s_one = generate(wh, DAY, one, layouts=("clustered", "shuffled"))
    t_one = {lay: wh.read("samples", DAY, layout=lay) for lay in ("clustered", "shuffled")}
    s_many = generate(wh, DAY, many, layouts=("clustered", "shuffled"))
    assert (
        s_many["generate.bucket_rows"]
        < t_one["clustered"].num_rows
        <= s_one["generate.bucket_rows"]
    )
    assert s_many["generate.bucket_rows"] % 500 == 0, "buckets hold whole row groups"
    for lay, t in t_one.items():
        assert wh.read("samples", DAY, layout=lay).equals(t)
        hashes = row_hashes(t["user_history"])
        direct = float(batch_factors(hashes, 300).mean())
        assert s_many["layouts"][lay]["dedup.factor.user_history"] == pytest.approx(direct)
    for k in (
        "storage.bytes",
        "storage.sessions",
        "dedup.factor.mean",
        "dedup.factor.user_group",
        "storage.lower_bound_bytes",
    ):
        assert s_many[k] == s_one[k], k


def test_the_ray_engine_writes_the_same_partitions_and_figures(generated):
    """`engine: ray` (a local Ray instance): the spilling and each output file are Ray tasks;
    the files, byte for byte, and every figure equal the local engine's (several files,
    several buckets each, batches that straddle both)."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    wh, _ = generated
    local = GenerateConfig(
        batch_size=300, row_group_size=500, max_rows_per_file=1800, memory_budget_mb=16
    )
    on_ray = local.model_copy(update={"engine": "ray", "workers": 2})
    layouts = ("clustered", "shuffled")
    figures, files = {}, {}
    for cfg in (local, on_ray):
        # each engine writes afresh (a build of what is there would keep the first's files)
        shutil.rmtree(Path(wh.root) / "samples", ignore_errors=True)
        s = generate(wh, DAY, cfg, layouts=layouts)
        figures[cfg.engine] = {
            k: v for k, v in s.items() if k.split(".")[0] in ("storage", "dedup")
        }
        assert not s["storage.kept"]
        files[cfg.engine] = [
            [Path(f).read_bytes() for f in wh.stored_files("samples", DAY, layout=lay)]
            for lay in layouts
        ]
        assert s["generate.engine"] == cfg.engine
    assert len(files["local"][0]) > 1 and figures["local"]["storage.files"] > 1
    assert s["generate.bucket_rows"] < 1800
    assert files["ray"] == files["local"]
    assert figures["ray"] == figures["local"]


def test_the_clustered_layout_is_stored_session_normalized_and_reads_back_whole(generated):
    """Each session's user-side values are stored once (per row group): fewer bytes than the
    plain files, the same rows through the warehouse, the same figures, the same DPP batches."""
    from recd_core.config import PreprocessConfig
    from recd_core.dpp.preprocess import preprocess

    wh, normalized = generated
    rows = wh.read("samples", DAY, layout="clustered")
    user = [f for f in rows.column_names if f.startswith("user_")]
    assert wh.normalized_columns("samples", DAY, layout="clustered") == user
    cfg = PreprocessConfig(batch_size=512, validation_fraction=0.1)
    batches = [
        preprocess(wh, DAY, cfg.model_copy(update={"mode": m})) for m in ("dedup", "baseline")
    ]
    shards = {m: _shards(wh, m) for m in ("dedup", "baseline")}
    plain = generate(wh, DAY, GenerateConfig(batch_size=512, normalize_sessions=False))
    assert wh.normalized_columns("samples", DAY, layout="clustered") == []
    assert wh.read("samples", DAY, layout="clustered").equals(rows)
    assert plain["storage.bytes"] > normalized["storage.bytes"]
    same = {k: v for k, v in plain.items() if k.startswith("dedup.") or k == "storage.rows"}
    assert same == {k: normalized["layouts"]["clustered"][k] for k in same}
    for m, s in zip(("dedup", "baseline"), batches, strict=True):
        again = preprocess(wh, DAY, cfg.model_copy(update={"mode": m}))
        assert _shards(wh, m) == shards[m], f"{m}: the same batches from either storage"
        assert again["dpp.samples"] == s["dpp.samples"]


def _shards(wh, mode):
    return [Path(f).read_bytes() for f in wh.files("batches", DAY, mode=mode)]
