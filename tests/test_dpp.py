"""DPP preprocessing: transforms, dedup == baseline after expansion, workers, bad input."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from recd_core.config import FeatureSpec, PreprocessConfig, TransformSpec
from recd_core.dpp.batch_store import BatchStore, expand
from recd_core.dpp.preprocess import PreprocessError, preprocess
from recd_core.dpp.transforms import hash_ids, model_spec, transform_dense, transform_ids, truncate
from recd_core.stored_files import PartitionDamaged

DAY, NEXT = "2026-11-01", "2026-11-02"


def test_id_transforms():
    v = np.array([5, 6, 7, 8, 9, 10])
    lengths = np.array([3, 0, 1, 2])
    assert [a.tolist() for a in truncate(v, lengths, 2, keep_last=False)] == [
        [5, 6, 8, 9, 10],
        [2, 0, 1, 2],
    ]
    assert [a.tolist() for a in truncate(v, lengths, 2, keep_last=True)] == [
        [6, 7, 8, 9, 10],
        [2, 0, 1, 2],
    ]
    h = hash_ids(np.arange(10_000), 97, stable_hash=True)
    assert h.min() >= 0 and h.max() < 97 and len(set(h.tolist())) == 97
    assert (
        hash_ids(np.array([2**62]), 97, True)[0] == hash_ids(np.array([2**62]), 97, True)[0]
    )  # stable
    assert hash_ids(np.array([100]), 97, stable_hash=False).tolist() == [3]
    seq = FeatureSpec(name="h", side="user", kind="sequence", table_size=10, max_length=3)
    values, lens = transform_ids(
        np.array([1, 2, 3, 4]), np.array([4]), seq, TransformSpec(hash=False, truncate=2)
    )
    assert values.tolist() == [3, 4] and lens.tolist() == [2], (
        "sequences keep their most recent ids"
    )


def test_ids_are_hashed_into_their_table_or_taken_as_row_indices():
    """`hash: false` (ids that already are row indices): no two ids share a row; hashed,
    most of a table's worth of distinct ids do (1 - 1/e of the rows stay empty)."""
    indices = FeatureSpec(name="x", side="item", kind="sparse", table_size=1000, hash=False)
    hashed = indices.model_copy(update={"hash": True})
    ids, ones = np.arange(1000), np.ones(1000, np.int64)
    assert transform_ids(ids, ones, indices, TransformSpec())[0].tolist() == ids.tolist()
    rows = transform_ids(ids, ones, hashed, TransformSpec())[0]
    assert 600 < len(set(rows.tolist())) < 665, "hashed: ~632 of 1000 rows used"
    overridden = transform_ids(ids, ones, indices, TransformSpec(hash=True))[0]
    assert overridden.tolist() == rows.tolist(), "a transform's own `hash` wins"
    cfg = PreprocessConfig()
    assert cfg.transform_for(indices).hash is False and cfg.transform_for(hashed).hash is True
    # the model's feature records how its ids found their rows (a warm start must match)
    assert model_spec(indices, cfg.transform_for(indices)).hash is False
    assert model_spec(indices, TransformSpec(hash=True)).hash is True
    with pytest.raises(ValueError, match="`hash` is for id features only"):
        FeatureSpec(name="d", side="user", kind="dense", dim=2, hash=False)


def test_dense_transforms():
    x = np.array([[np.nan, 1.0], [3.0, -2.0]], np.float32)
    t = TransformSpec(default=0.0, log1p=True, clip=(0.0, 1.0))
    out = transform_dense(x, t, None)
    assert np.allclose(out, [[0.0, np.log1p(1.0)], [1.0, 0.0]])
    stats = {"mean": [1.0, 1.0], "std": [2.0, 4.0]}
    assert np.allclose(
        transform_dense(np.array([[3.0, 5.0]], np.float32), TransformSpec(standardize=True), stats),
        [[1.0, 1.0]],
    )
    ids, lens = transform_dense(
        np.array([[0.5, 2.5]], np.float32), TransformSpec(buckets=[1.0, 2.0]), None
    )
    assert ids.tolist() == [0, 3 + 2] and lens.tolist() == [2], (
        "one id per dimension, offset by dimension"
    )
    with pytest.raises(ValueError, match="increasing"):
        TransformSpec(buckets=[2.0, 1.0])


def _tensors(batch):
    return {
        k: (batch.kjt[k].values.tolist(), batch.kjt[k].lengths.tolist()) for k in batch.kjt.keys
    }


def test_dedup_batches_expand_to_the_baseline_batches(fresh_warehouse):
    d = preprocess(fresh_warehouse, DAY, PreprocessConfig(mode="dedup", batch_size=512))
    b = preprocess(fresh_warehouse, DAY, PreprocessConfig(mode="baseline", batch_size=512))
    assert (
        d["dpp.samples"]
        == b["dpp.samples"]
        == fresh_warehouse.info("samples", DAY, layout="clustered").rows
    )
    assert d["dpp.bytes_out"] < b["dpp.bytes_out"]
    dedup, base = (
        BatchStore(fresh_warehouse, DAY, "dedup"),
        BatchStore(fresh_warehouse, DAY, "baseline"),
    )
    assert len(dedup) == len(base) == d["dpp.batches"]
    for i in range(len(dedup)):
        x, y = dedup[i], base[i]
        assert x.groups["user"].num_unique < x.size / 4
        ex = expand(x)
        assert torch.equal(ex.dense, y.dense) and torch.equal(ex.labels, y.labels)
        assert _tensors(ex) == _tensors(y)


def _shard_bytes(wh, mode="dedup"):
    return [open(p, "rb").read() for p in wh.files("batches", DAY, mode=mode)]


def test_output_is_the_same_for_one_and_two_workers(fresh_warehouse):
    cfg = PreprocessConfig(batch_size=256, batches_per_split=2)
    preprocess(fresh_warehouse, DAY, cfg)
    one = _shard_bytes(fresh_warehouse)
    s = preprocess(fresh_warehouse, DAY, cfg.model_copy(update={"workers": 2}))
    assert s["dpp.workers"] == 2 and len(one) > 2
    assert _shard_bytes(fresh_warehouse) == one, "identical shards, in the same order"
    preprocess(fresh_warehouse, DAY, cfg.model_copy(update={"workers": 2, "executor": "thread"}))
    assert _shard_bytes(fresh_warehouse) == one, "threads too"


def test_batch_files_are_arrow_ipc_as_documented(fresh_warehouse):
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=1024))
    path = fresh_warehouse.files("batches", DAY, mode="dedup")[0]
    reader = ipc.open_file(pa.OSFile(path))
    rb = reader.get_batch(0)
    assert rb.num_rows == 1
    names = set(rb.schema.names)
    assert {
        "labels",
        "dense",
        "group.user.inverse",
        "ids.item_id.values",
        "group.user.user_history.lengths",
    } <= names
    assert len(rb.column("labels").values) == 1024
    manifest = fresh_warehouse.manifest("batches", DAY, mode="dedup")
    assert manifest["prepared"]["groups"]["user"] and "user_dense" in manifest["prepared"]["stats"]


def test_eval_day_uses_the_training_statistics(fresh_warehouse):
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=1024))
    preprocess(fresh_warehouse, NEXT, PreprocessConfig(batch_size=1024), stats_from=DAY)
    train_stats = fresh_warehouse.manifest("batches", DAY, mode="dedup")["prepared"]["stats"]
    assert (
        fresh_warehouse.manifest("batches", NEXT, mode="dedup")["prepared"]["stats"] == train_stats
    )


def _rewrite_samples(wh, table):
    with wh.writing("samples", DAY, layout="clustered") as w:
        w.write(table)


def test_bad_samples_fail_with_file_and_column_and_publish_nothing(fresh_warehouse):
    good = fresh_warehouse.read("samples", DAY, layout="clustered")
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=1024))
    before = _shard_bytes(fresh_warehouse)
    i = good.schema.get_field_index("user_age")
    _rewrite_samples(
        fresh_warehouse,
        good.set_column(
            i, pa.field("user_age", pa.string()), pc_str(good["user_age"])
        ).replace_schema_metadata(good.schema.metadata),
    )
    with pytest.raises(
        PreprocessError,
        match=r"part-00000-.*\.parquet: column 'user_age' is string, expected int64",
    ):
        preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=1024))
    _rewrite_samples(
        fresh_warehouse,
        good.drop_columns(["item_tags"]).replace_schema_metadata(good.schema.metadata),
    )
    with pytest.raises(PreprocessError, match=r"column 'item_tags' is missing"):
        preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=1024))
    _rewrite_samples(fresh_warehouse, good)
    path = fresh_warehouse.files("samples", DAY, layout="clustered")[0]
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(PartitionDamaged, match=r"part-00000-.*\.parquet is damaged \(1000 bytes"):
        preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=1024))
    assert _shard_bytes(fresh_warehouse) == before, "the earlier batches partition is untouched"


def pc_str(col):
    import pyarrow.compute as pc

    return pc.cast(col, pa.string())


def test_config_naming_an_unknown_feature_is_an_error_from_the_cli(fresh_warehouse, tmp_path):
    cfg = tmp_path / "pipe.yaml"
    cfg.write_text(
        "features: synthetic\npreprocess:\n  transforms:\n    user_shoe_size: {log1p: true}\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "recd_core.cli",
            "preprocess",
            "--warehouse",
            fresh_warehouse.uri,
            "--ds",
            DAY,
            "--config",
            str(cfg),
        ],
        capture_output=True,
        text=True,
    )
    assert (
        r.returncode == 2 and "'user_shoe_size'" in r.stderr and r.stderr.strip().count("\n") == 0
    )
    assert not fresh_warehouse.exists("batches", DAY, mode="dedup")


@pytest.mark.slow
def test_ray_engine_on_a_local_instance_matches_the_local_engine(fresh_warehouse):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    cfg = PreprocessConfig(batch_size=256, batches_per_split=4)
    preprocess(fresh_warehouse, DAY, cfg)
    local = _shard_bytes(fresh_warehouse)
    s = preprocess(fresh_warehouse, DAY, cfg.model_copy(update={"engine": "ray", "workers": 2}))
    assert s["dpp.engine"] == "ray" and len(local) > 2
    assert _shard_bytes(fresh_warehouse) == local


def test_session_dedup_is_used_only_on_checked_data_and_matches_value_comparison(fresh_warehouse):
    from recd_core.config import DedupConfig

    s = preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=512))
    assert s["dpp.dedup_method"] == "session", "ingest checked the sessions of this data"
    by_session = [expand(b) for b in BatchStore(fresh_warehouse, DAY, "dedup")]
    runs = preprocess(
        fresh_warehouse, DAY, PreprocessConfig(batch_size=512, dedup=DedupConfig(method="runs"))
    )
    assert runs["dpp.dedup_method"] == "runs"
    by_value = [expand(b) for b in BatchStore(fresh_warehouse, DAY, "dedup")]
    for a, b in zip(by_session, by_value, strict=True):
        assert _tensors(a) == _tensors(b) and torch.equal(a.dense, b.dense)
    # unchecked samples: `auto` compares values, `session` is refused
    t = fresh_warehouse.read("samples", DAY, layout="clustered")
    meta = {k: v for k, v in t.schema.metadata.items() if k != b"recd.sessions_checked"}
    _rewrite_samples(fresh_warehouse, t.replace_schema_metadata(meta))
    assert (
        preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=512))["dpp.dedup_method"]
        == "runs"
    )
    with pytest.raises(PreprocessError, match="needs samples whose ingest checked sessions"):
        preprocess(
            fresh_warehouse,
            DAY,
            PreprocessConfig(batch_size=512, dedup=DedupConfig(method="session")),
        )


@pytest.mark.parametrize("method", ["session", "runs"])
def test_batches_encoded_a_chunk_at_a_time_equal_one_at_a_time(
    fresh_warehouse, method, monkeypatch
):
    """The kept rows of a scattered mask, batches of 300 in chunks of 700 rows (two batches
    and a remainder): every record equals `encode_batch` of that batch's rows alone, dedup
    groups included."""
    from recd_core.config import DedupConfig
    from recd_core.dpp import encode as dpp
    from recd_core.dpp.encode import encode_batch, encode_batches
    from recd_core.dpp.preprocess import prepare
    from recd_core.schema import feature_set_of

    rows = fresh_warehouse.read("samples", DAY, layout="clustered")
    cfg = PreprocessConfig(batch_size=300, dedup=DedupConfig(method=method))
    prep = prepare(rows, feature_set_of(rows.schema), cfg)
    assert prep.groups and prep.dedup_method == method
    keep = np.random.default_rng(0).random(rows.num_rows) < 0.9
    kept = rows.filter(pa.array(keep))
    monkeypatch.setattr(dpp, "CHUNK_ROWS", 700)
    got = list(encode_batches(rows, keep, prep, 300))
    assert len(got) == -(-kept.num_rows // 300) and len(got) > 4
    for i, rb in enumerate(got):
        assert rb.equals(encode_batch(kept.slice(300 * i, 300), prep)), f"batch {i}"
