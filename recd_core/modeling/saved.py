"""A trained model on disk, in one place for every reader (evaluate, the registry, serving,
warm start): the model directory, its two files, and scoring with it.

    <warehouse>/models/<run>/          (or any local copy, e.g. MLflow's model artifacts)
        model.pt      the state dict: plain `torch.save` of tensors (loaded weights_only),
                      `calibration` among them ([slope, offset] of the logit, fitted on
                      the validation slice)
        optimizer.pt  both optimizers' state at the end of training (Adam's moments, the
                      tables' Adagrad accumulators): the next day's warm start continues
                      it, as incremental training does, instead of restarting the
                      optimizer (whose first steps then undo much of the model)
        model.json    {"features": the model's FeatureSet, "train": its TrainConfig,
                       "prepared": DPP's transforms, statistics and dedup groups (score with
                       these), "summary": the training summary, "checksums": the CRC-32
                       of model.pt and optimizer.pt, checked by every reader}

A model whose tables no process holds (a sharded run's, `train.saved_layout`) keeps them as
shard files beside these, every rank writing its own: model.pt and optimizer.pt then hold
the rest, model.json's "tables" the layout (shard_files.py). Readers get the same model
either way: `load_model` maps the shards' rows on demand (`MappedDLRM`), a warm start reads
the row ranges it places. Nothing is trusted before it is verified: model.pt and
optimizer.pt against their recorded checksums (a model saved before checksums were recorded
is read as it is), the shard files as shard_files.py says; a failure is a `ModelError`, one
line naming the file.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import io
import json
import shutil
import tempfile
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from recd_core.config import FeatureSet, ModelConfig, TrainConfig
from recd_core.dpp.batch_store import Batch, decode_batch
from recd_core.dpp.encode import Prepared, batch_ranges, encode_batch
from recd_core.errors import BadInput, first_line
from recd_core.leftovers import owned_tempdir, write_atomically
from recd_core.modeling.model import Model, build_model
from recd_core.modeling.shard_files import LazyTable, files_of, is_sharded, open_tables
from recd_core.warehouse import Warehouse


class ModelError(BadInput):
    """A saved model that cannot be read (damaged, or not a recd model): named, with why."""


class CheckpointError(BadInput):
    """A checkpoint that cannot be read: named, with what to do about it."""


@dataclasses.dataclass
class Saved:
    """What the run's model is saved from (rank 0's; None elsewhere): `figures` for the
    summary, `state` (None: the model's own state dict), `optimizer`, and `tables`:
    model.json's shard layout when the tables were written as shard files (then `state`
    and `optimizer` hold the rest; shard_files.py)."""

    figures: dict
    state: dict | None
    optimizer: dict | None
    tables: dict | None = None


def without_tables(state: dict, optimizer: dict, specs) -> tuple[dict, dict]:
    """The state and optimizer state a sharded layout's model.pt and optimizer.pt hold:
    everything but the tables and their accumulators (those are in the shard files)."""
    keys = {s.key for s in specs}
    dense = {k: v.detach().cpu() for k, v in state.items() if k not in keys}
    return dense, {
        "dense": optimizer["dense"],
        "sparse": {"param_groups": optimizer["sparse"]["param_groups"]},
    }


def write_bytes(wh: Warehouse, path: str, data: bytes) -> None:
    """Write atomically, leaving nothing behind on failure (recd_core/leftovers.py)."""
    write_atomically(wh.fs, path, data)


def read_bytes(wh: Warehouse, path: str) -> bytes:
    with wh.fs.open_input_stream(path) as f:
        return f.read()


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_load(data: bytes, where: str, what: str = "checkpoint"):
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of odd files
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds on a damaged file
        first = first_line(e, 160)
        if first.startswith("Weights only load failed"):
            first = "it holds Python objects, not only tensors: refused, nothing was run"
        if what != "checkpoint":
            raise ModelError(
                f"{where} is corrupt or not a recd {what} ({type(e).__name__}: {first})"
            ) from None
        raise CheckpointError(
            f"{where} is corrupt or not a recd checkpoint ({type(e).__name__}: {first}); "
            "delete it to resume from the previous checkpoint"
        ) from None


OPTIMIZER_FILE = "optimizer.pt"


def _saved_file(location: str, name: str, optional: bool = False) -> tuple[bytes, str] | None:
    """One file of a saved model (a local directory, or `<warehouse>/models/<run>`): its
    bytes and where it was read; a missing one is a `ModelError`, or None when `optional`."""
    path = Path(location)
    if path.is_dir():
        if (path / name).is_file():
            return (path / name).read_bytes(), str(path / name)
    elif "/models/" not in location:
        raise ModelError(
            f"model not found: {location} (expected a model directory or <warehouse>/models/<run>)"
        )
    else:
        wh, base = _model_location(location)
        if wh.exists_file(f"{base}/{name}"):
            return read_bytes(wh, f"{base}/{name}"), f"{base}/{name}"
        if not wh.exists_file(f"{base}/model.json"):
            raise ModelError(f"model not found: {location}")
    if optional:
        return None
    raise ModelError(f"{location} has no {name}: not a recd model, or an incomplete copy of one")


def _verified(meta: dict, name: str, data: bytes, where: str) -> bytes:
    """`data`, the model's file `name`, once its CRC-32 is the one model.json records."""
    recorded = (meta.get("checksums") or {}).get(name)
    if recorded is not None and zlib.crc32(data) != recorded:
        raise ModelError(
            f"{where}: its bytes do not match the CRC-32 model.json records "
            "(changed or damaged since it was saved)"
        )
    return data


def read_saved(location: str) -> tuple[dict, bytes, str]:
    """model.json (parsed) and model.pt (bytes, verified) of a saved model, local or in a
    warehouse."""
    text, where_meta = _saved_file(location, "model.json")
    weights, where = _saved_file(location, "model.pt")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):
        raise ModelError(f"{where_meta} is not JSON: a damaged or partial copy") from None
    if not isinstance(meta, dict):
        raise ModelError(f"{where_meta} is not a recd model's model.json")
    return meta, _verified(meta, "model.pt", weights, where), where


def read_optimizer(location: str, meta: dict | None = None) -> dict | None:
    """The optimizer state saved beside a model (`optimizer.pt`, verified against `meta`,
    its model.json), or None (a model saved without one: the optimizer then starts afresh)."""
    found = _saved_file(location, OPTIMIZER_FILE, optional=True)
    if found is None:
        return None
    meta = meta if meta is not None else read_saved(location)[0]
    return torch_load(_verified(meta, OPTIMIZER_FILE, *found), found[1], "model")


def saved_tables(location: str, meta: dict, private: bool = False) -> dict[str, LazyTable]:
    """The verified shard files of the sharded model at `location` (shard_files.py), mapped;
    `private`: mapped from copies that are unlinked once mapped, so nothing else can change
    or truncate what the process reads (the kernel frees them with the last map)."""
    directory = local_model_dir(location, meta)
    try:
        if not private:
            return open_tables(directory, meta)
        with owned_tempdir("recd-private-model-") as copies:  # a killed loader's: swept
            return open_tables(directory, meta, Path(copies))
    except (KeyError, TypeError, AttributeError) as e:
        what = f"missing {e}" if isinstance(e, KeyError) else first_line(e, 120)
        raise ModelError(
            f"{directory / 'model.json'}: its tables' layout is damaged ({what})"
        ) from None


def save_model(
    wh: Warehouse,
    run: str,
    model: Model,
    cfg: TrainConfig,
    prepared: dict,
    summary: dict,
    optimizer: dict | None = None,
    state: dict | None = None,
    lineage: dict | None = None,
    tables: dict | None = None,
) -> str:
    """`state`: the weights to save when they are not `model.state_dict()` (a sharded
    run's, gathered into the single-process layout, or all but its tables); `lineage`:
    what it was built from (lineage.py), with the days it trained on; `tables`: the shard
    layout, when the run's ranks wrote the tables as shard files (shard_files.py). model.json
    is written last: a model without it is incomplete."""
    base = model_base(wh, run)
    state = model.state_dict() if state is None else state
    files = {"model.pt": torch_bytes({k: v.cpu() for k, v in state.items()})}
    if optimizer is not None:
        files[OPTIMIZER_FILE] = torch_bytes(optimizer)
    for name, data in files.items():
        write_bytes(wh, f"{base}/{name}", data)
    meta = {
        "features": model.features.model_dump(mode="json"),
        "train": cfg.model_dump(mode="json"),
        "prepared": prepared,  # DPP's transforms, statistics and dedup groups: score with these
        "summary": {k: v for k, v in summary.items() if k != "train.model_uri"},
        **({"lineage": lineage} if lineage else {}),
        **({"tables": tables} if tables else {}),
        "checksums": {name: zlib.crc32(data) for name, data in files.items()},
    }
    write_bytes(wh, f"{base}/model.json", json.dumps(meta, indent=1).encode())
    return model_uri(wh, run)


def model_base(wh: Warehouse, run: str) -> str:
    """Where run `run`'s model is saved, inside the warehouse's filesystem."""
    return f"{wh.root}/models/{run}"


def model_uri(wh: Warehouse, run: str) -> str:
    """Run `run`'s model as a URI (`<warehouse>/models/<run>`: what the summaries name)."""
    return f"{wh.uri.rstrip('/')}/models/{run}"


def _model_location(uri: str) -> tuple[Warehouse, str]:
    """A model URI (`<warehouse>/models/<run>`) as its warehouse and the path inside it."""
    wh_uri, run = uri.rsplit("/models/", 1)
    wh = Warehouse(wh_uri)
    return wh, f"{wh.root}/models/{run}"


def load_model(uri: str, private: bool = False) -> tuple[Model, dict]:
    """A saved model (state dict + model.json) at `<warehouse>/models/<run>` or in a local
    directory (a copy, e.g. MLflow's model artifacts), verified, for scoring; `private`: a
    sharded model's tables mapped from copies of its own (a server, which must outlive
    whatever happens to the files it loaded)."""
    meta, weights, where = read_saved(str(uri))
    try:
        if is_sharded(meta):
            from recd_core.modeling.mapped_model import MappedDLRM

            features = FeatureSet.model_validate(meta["features"])
            tables = saved_tables(str(uri), meta, private)
            model = MappedDLRM(features, saved_train_config(meta).model, tables)
            model.load_state_dict(torch_load(weights, where, "model"))
            return model.eval(), meta
        return model_from(meta, weights, where), meta
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        if isinstance(e, BadInput):
            raise
        what = f"missing {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:160]
        raise ModelError(f"{uri} is not a recd model ({what})") from None


def _copy_model(wh: Warehouse, base: str, target: Path) -> None:
    """The saved model's files (model.pt, model.json, optimizer.pt, its shard files) from
    the warehouse into the local directory `target`."""
    meta = read_bytes(wh, f"{base}/model.json")
    names = ["model.pt", *files_of(json.loads(meta))]
    if wh.exists_file(f"{base}/{OPTIMIZER_FILE}"):  # optional: models saved before it
        names.append(OPTIMIZER_FILE)
    for name in names:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        with wh.fs.open_input_stream(f"{base}/{name}") as src, open(target / name, "wb") as dst:
            while block := src.read(1 << 24):
                dst.write(block)
    (target / "model.json").write_bytes(meta)  # last, as it was written


@contextlib.contextmanager
def model_dir(uri: str):
    """A local directory holding the saved model's files (copied from an object store)."""
    wh, base = _model_location(uri)
    if wh.fs.type_name == "local":
        yield Path(base)
        return
    with owned_tempdir("recd-model-") as tmp:  # a killed run's: swept
        _copy_model(wh, base, Path(tmp))
        yield Path(tmp)


def local_model_dir(location: str, meta: dict) -> Path:
    """A local directory holding the model at `location` whole, to map its shard files: the
    directory itself, or a copy of one in an object store (removed when the process ends)."""
    if Path(location).is_dir():
        return Path(location)
    wh, base = _model_location(location)
    if wh.fs.type_name == "local":
        return Path(base)

    tmp = Path(tempfile.mkdtemp(prefix="recd-mapped-model-"))
    atexit.register(shutil.rmtree, tmp, True)
    _copy_model(wh, base, tmp)
    return tmp


def saved_meta(uri: str) -> dict:
    """A saved model's model.json (its features, transforms, training summary)."""
    wh, base = _model_location(uri)
    return json.loads(read_bytes(wh, f"{base}/model.json"))


def saved_summary(uri: str) -> dict:
    """The training summary stored in a saved model's model.json."""
    return saved_meta(uri).get("summary", {})


def saved_train_config(meta: dict) -> TrainConfig:
    """The TrainConfig a saved model was trained with."""
    return TrainConfig.model_validate(meta["train"])


def lineage_key(features: FeatureSet, model: ModelConfig) -> str:
    """What a warm start needs to match: the model's input features and its model config,
    hashed. Two models with the same key have weights of the same shape and meaning, so one
    can start from the other (`train.initial_state` checks the same two things)."""
    text = json.dumps(
        [features.model_dump(mode="json"), model.model_dump(mode="json")], sort_keys=True
    )
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def saved_lineage_key(location: str) -> str:
    """`lineage_key` of a saved model (a local directory or `<warehouse>/models/<run>`)."""
    meta = json.loads(_saved_file(str(location), "model.json")[0])
    return lineage_key(FeatureSet.model_validate(meta["features"]), saved_train_config(meta).model)


def model_from(meta: dict, weights: bytes, where: str) -> Model:
    features = FeatureSet.model_validate(meta["features"])
    model = build_model(features, saved_train_config(meta).model)
    model.load_state_dict(torch_load(weights, where, "model"))
    return model.eval()


def batches_of(
    meta: dict, table: pa.Table, batch_size: int = 4096, trust_sessions: bool = True
) -> Iterator[Batch]:
    """A samples table as model batches, preprocessed exactly as in training (the run's
    transforms and statistics) and deduplicated like the training batches: what every
    scoring path feeds the model (`predict`, `evaluate.score_day`). Rows that did not pass
    ingest's session check (`trust_sessions=False`, e.g. served requests) are deduplicated by
    comparing values instead of by session id."""
    prep = Prepared.from_json(json.dumps(meta["prepared"]))
    if not trust_sessions and prep.dedup_method == "session":
        prep = dataclasses.replace(prep, dedup_method="runs")
    for lo, hi in batch_ranges(table.num_rows, batch_size):
        yield decode_batch(encode_batch(table.slice(lo, hi - lo), prep), prep.model, prep.groups)


def predict(
    model: Model,
    meta: dict,
    table: pa.Table,
    batch_size: int = 4096,
    device: str = "cpu",
    trust_sessions: bool = True,
    deadline: float | None = None,
) -> np.ndarray:
    """Click probabilities for a samples table (`batches_of`); past `deadline` (a
    `time.monotonic()` value) it stops between batches with TimeoutError."""
    out = []
    model = model.to(device)
    with torch.inference_mode():
        for batch in batches_of(meta, table, batch_size, trust_sessions):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            out.append(torch.sigmoid(model(batch.to(device))).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0, np.float32)
