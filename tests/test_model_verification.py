"""A saved model is verified before anything trusts it: each way a sharded model's files
or its model.json can be damaged (bytes replaced at the same size, boxes overlapping or
reshaped, another dtype, accumulators dropped, a path out of the model) is refused by every
reader (evaluate, warm start, serve, the registry's loader) in one line naming the file,
exit 2, and nothing outside the model is read; the single-file model's checksum likewise.
A server keeps serving what it loaded when the files change under it, and never answers a
NaN score with a 200."""

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
from test_serving import Server
from test_train import DAY, NEXT, SMALL_MODEL

from recd_core.config import FeatureSet, PreprocessConfig, TrainConfig
from recd_core.dpp.preprocess import preprocess
from recd_core.errors import BadInput
from recd_core.modeling.launch import free_port
from recd_core.modeling.saved import load_model, predict
from recd_core.modeling.train import train
from recd_core.modeling.warm_start import initial_state
from recd_core.warehouse import Warehouse

BIN = Path(sys.executable).parent
BASE = dict(batch_size=256, model=SMALL_MODEL, threads=1, cooccurrence_weight=0.0, max_steps=6)


@pytest.fixture(scope="module")
def saved(samples_warehouse, tmp_path_factory) -> tuple[Path, Path, Path]:
    """A warehouse with a model of DAY saved as shard files (two shards a table: saved by
    rank 0 whole, then each table cut in two row ranges) and one saved as one file."""
    root = tmp_path_factory.mktemp("verified") / "wh"
    shutil.copytree(samples_warehouse, root)
    wh = Warehouse(root)
    preprocess(wh, DAY, PreprocessConfig(batch_size=256))
    sharded = Path(train(wh, DAY, TrainConfig(**BASE, saved_layout="shards"))["train.model_uri"])
    single = Path(train(wh, DAY, TrainConfig(**BASE, seed=1))["train.model_uri"])
    return root, sharded, single


def _copy(model: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "wh" / "models" / model.name
    shutil.copytree(model, dst)
    return dst


def _meta(model: Path) -> dict:
    return json.loads((model / "model.json").read_text())


def _write_meta(model: Path, meta: dict) -> None:
    (model / "model.json").write_text(json.dumps(meta))


def _first_table(meta: dict) -> dict:
    return max(meta["tables"]["tables"].values(), key=lambda t: t["rows"])


def _refused(model: Path, *words: str) -> str:
    """Every in-process reader refuses `model` in one line holding `words`: scoring's
    loader, the server's (private copies), a warm start of the same features; the message
    is returned."""
    features = FeatureSet.model_validate(_meta(model)["features"])
    messages = []
    for read in (
        lambda: load_model(str(model)),
        lambda: load_model(str(model), private=True),
        lambda: initial_state(str(model), features, TrainConfig(**BASE)),
    ):
        with pytest.raises(BadInput) as e:
            read()
        messages.append(str(e.value))
    for m in messages:
        assert "\n" not in m and all(w in m for w in words), (words, m)
    return messages[0]


def _cut_in_two(model: Path) -> None:
    """Each table's one shard (rank 0 saved it whole) rewritten as two row ranges, as a
    run of two processes saves it: the layouts the overlap and gap cases damage."""
    from recd_core.modeling.shard_files import LazyTable, layout, open_tables, write_shard
    from recd_core.modeling.tables import TableSpec

    meta = _meta(model)
    tables: dict[str, LazyTable] = open_tables(model, meta)
    entries, specs = [], []
    for key, t in meta["tables"]["tables"].items():
        lazy, rows, dim = tables[key], t["rows"], meta["tables"]["dim"]
        specs.append(TableSpec(t["name"], rows, ("f",), key, 0.05))
        acc = lazy.shards[0].accumulators
        half = rows // 2
        for r0, nr in ((0, half), (half, rows - half)):
            weights, part = lazy[r0 : r0 + nr, :], torch.from_numpy(np.array(acc[r0 : r0 + nr]))
            entry = write_shard(
                pafs.LocalFileSystem(), str(model), t["name"], (r0, 0, nr, dim), weights, part
            )
            entries.append((key, entry))
        for e in t["shards"]:
            for k in ("weights", "accumulators"):
                (model / e[k]).unlink()
    meta["tables"] = layout(meta["tables"]["dim"], 2, specs, entries)
    _write_meta(model, meta)


def test_each_damage_to_a_sharded_model_is_refused_by_every_reader(saved, tmp_path):
    _, sharded, _ = saved
    reference = load_model(str(sharded))  # the undamaged model loads
    assert reference[0] is not None

    # a shard's bytes replaced, the same size
    m = _copy(sharded, tmp_path / "bytes")
    shard = m / _first_table(_meta(m))["shards"][0]["weights"]
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(b ^ 0xFF for b in data[:64])
    shard.write_bytes(bytes(data))
    _refused(m, str(shard), "CRC-32")

    # the same file stored as float16 (half the values' bytes twice over: the same size)
    m = _copy(sharded, tmp_path / "f16")
    t = _first_table(_meta(m))
    shard = m / t["shards"][0]["weights"]
    values = np.fromfile(shard, "<f4")
    shard.write_bytes(np.concatenate([values, values]).astype("<f2").tobytes())
    _refused(m, str(shard), "CRC-32")
    meta = _meta(m)  # and declared float16 in model.json
    _first_table(meta)["shards"][0]["dtype"] = "float16"
    _write_meta(m, meta)
    _refused(m, "float16", "float32 shard files only")

    # a box reshaped to the same number of bytes (rows x dim as 2*rows x dim/2)
    m = _copy(sharded, tmp_path / "reshaped")
    meta = _meta(m)
    box = _first_table(meta)["shards"][0]["box"]
    box[2], box[3] = box[2] * 2, box[3] // 2
    _write_meta(m, meta)
    _refused(m, "outside the table")

    # two boxes overlapping, leaving a gap (a table in two row ranges, the first widened)
    m = _copy(sharded, tmp_path / "overlap")
    _cut_in_two(m)
    assert load_model(str(m))[0] is not None  # cut in two, it is still the same model
    meta = _meta(m)
    first, second = _first_table(meta)["shards"]
    second["box"][0] -= 5  # now overlaps the first by 5 rows; its last 5 rows a gap
    _write_meta(m, meta)
    _refused(m, "overlap")

    # the accumulators' entries removed (the warm start would continue Adagrad from zeros)
    m = _copy(sharded, tmp_path / "accumulators")
    meta = _meta(m)
    for e in _first_table(meta)["shards"]:
        del e["accumulators"], e["accumulators_crc32"]
    _write_meta(m, meta)
    _refused(m, "accumulators missing")


def test_a_path_out_of_the_model_is_refused_before_anything_is_read(saved, tmp_path):
    """`../` paths, absolute paths and links out: refused by name, nothing outside read
    (the file outside is a copy of the real shard, which the size and the checksum would
    both accept), and no size named."""
    _, sharded, _ = saved
    for how in ("dotdot", "absolute", "link"):
        m = _copy(sharded, tmp_path / how)
        meta = _meta(m)
        entry = _first_table(meta)["shards"][0]
        outside = tmp_path / how / "outside.f32"
        shutil.copyfile(m / entry["weights"], outside)
        if how == "dotdot":
            entry["weights"] = os.path.relpath(outside, m)
            assert entry["weights"].startswith("..")
        elif how == "absolute":
            entry["weights"] = str(outside)
        else:
            (m / entry["weights"]).unlink()
            (m / entry["weights"]).symlink_to(outside)
        _write_meta(m, meta)
        message = _refused(m, "refused, nothing read")
        assert "bytes" not in message and str(outside.stat().st_size) not in message
    m = _copy(sharded, tmp_path / "passwd")
    meta = _meta(m)
    _first_table(meta)["shards"][0]["weights"] = "/etc/passwd"
    _write_meta(m, meta)
    message = _refused(m, "/etc/passwd", "not a path inside")
    assert str(Path("/etc/passwd").stat().st_size) not in message


def test_the_single_file_model_is_checked_against_its_checksum(saved, tmp_path):
    _, _, single = saved
    features = FeatureSet.model_validate(_meta(single)["features"])
    meta = _meta(single)
    weights = (single / "model.pt").read_bytes()
    assert meta["checksums"]["model.pt"] == zlib.crc32(weights)
    assert meta["checksums"]["optimizer.pt"] == zlib.crc32((single / "optimizer.pt").read_bytes())
    m = _copy(single, tmp_path / "single")
    damaged = bytearray(weights)
    mid = len(damaged) // 2
    damaged[mid : mid + 64] = bytes(b ^ 0xFF for b in damaged[mid : mid + 64])  # torch loads it
    (m / "model.pt").write_bytes(bytes(damaged))
    _refused(m, "model.pt", "CRC-32")
    m = _copy(single, tmp_path / "optimizer")
    opt = bytearray((m / "optimizer.pt").read_bytes())
    mid = len(opt) // 2
    opt[mid : mid + 64] = bytes(b ^ 0xFF for b in opt[mid : mid + 64])
    (m / "optimizer.pt").write_bytes(bytes(opt))
    with pytest.raises(BadInput, match="optimizer.pt.*CRC-32"):
        initial_state(str(m), features, TrainConfig(**BASE))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "recd"), *args], capture_output=True, text=True, timeout=300)


def test_evaluate_and_serve_refuse_a_damaged_model_with_exit_2_in_one_line(saved, tmp_path):
    root, sharded, _ = saved
    m = _copy(sharded, tmp_path / "cli")
    shard = m / _first_table(_meta(m))["shards"][0]["weights"]
    data = bytearray(shard.read_bytes())
    data[100:104] = b"\x00\x00\xc0\x7f"  # one NaN, the same size
    shard.write_bytes(bytes(data))
    shutil.copytree(
        root, tmp_path / "wh", dirs_exist_ok=True, ignore=shutil.ignore_patterns("models")
    )
    r = _cli("evaluate", "--warehouse", str(tmp_path / "wh"), "--model-uri", str(m), "--ds", DAY)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert str(shard) in r.stderr and "Traceback" not in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.json").write_text(json.dumps(_meta(sharded)))  # no model.pt beside it
    for model, words in ((m, "CRC-32"), (empty, "has no model.pt")):
        r = _cli("serve", "--model", str(model), "--port", str(free_port()))
        assert r.returncode == 2, r.stdout + r.stderr
        assert words in r.stderr and "Traceback" not in r.stderr


def _served(model: Path) -> tuple[Server, bytes]:
    """`recd serve --model DIR` (test_serving's `Server`) and its probe request (the
    readiness request: ids 0, one candidate)."""
    from recd_core.serving.app import load_served

    port = free_port()
    cmd = [str(BIN / "recd"), "serve", "--model", str(model), "--port", str(port)]
    return Server(cmd, "", port), load_served(str(model)).scorer.probe


def _ready(server: Server) -> int:
    try:
        with urllib.request.urlopen(server.url("/ready"), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_served_model_survives_its_files_being_truncated_replaced_or_deleted(saved, tmp_path):
    _, sharded, _ = saved
    m = _copy(sharded, tmp_path / "served")
    server, probe = _served(m)
    try:
        status, before = server.post(probe)
        assert status == 200, before
        files = sorted((m / "tables").iterdir())
        for f in files[: len(files) // 2]:
            os.truncate(f, 0)  # a mapped file truncated: SIGBUS for a server mapping it
        for f in files[len(files) // 2 :]:
            f.write_bytes(b"\xff" * f.stat().st_size)  # replaced in place
        shutil.rmtree(m / "tables")
        for _ in range(3):
            assert server.post(probe) == (200, before)
            assert _ready(server) == 200
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_model_scoring_nan_is_a_500_naming_it_and_never_ready(saved, tmp_path):
    """A model whose files are intact but whose weights are not numbers (trained that way,
    checksums and all): each score a 500 naming the model, /ready 503, never a 200."""
    _, sharded, _ = saved
    m = _copy(sharded, tmp_path / "nan")
    meta = _meta(m)
    for t in meta["tables"]["tables"].values():
        for e in t["shards"]:
            path = m / e["weights"]
            path.write_bytes(np.full(path.stat().st_size // 4, np.nan, "<f4").tobytes())
            e["crc32"] = zlib.crc32(path.read_bytes())
    _write_meta(m, meta)
    server, probe = _served(m)
    try:
        status, body = server.post(probe)
        assert status == 500 and str(m) in json.loads(body)["message"], body
        assert "not numbers" in body and "\n" not in body.strip()
        assert _ready(server) == 503
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_verified_model_scores_as_before(saved):
    """Verification changes nothing it accepts: the private copies score as the files."""
    root, sharded, _ = saved
    wh = Warehouse(root)
    rows = wh.read("samples", NEXT, layout="clustered").slice(0, 500)
    a = predict(*load_model(str(sharded)), rows)
    b = predict(*load_model(str(sharded), private=True), rows)
    np.testing.assert_array_equal(a, b)
