"""`recd train`: the DLRM on a day's session-clustered samples, dedup (IKJT) or baseline (KJT).

Both modes see the same batches in the same order (contiguous rows of the clustered layout,
batch order seeded per epoch); they differ only in how the batch is represented, so their
losses and weights agree to float tolerance. Embedding tables train with Adagrad on sparse
gradients, everything else with Adam.

Checkpoints (`<warehouse>/checkpoints/<run>/step-NNNNNNNN.pt`, written atomically) hold the
model, both optimizers and the position in the data; a run resumes from its latest one, so
a killed run and an uninterrupted one end with the same weights. The trained model is saved
as a state dict (`<warehouse>/models/<run>/model.pt`, loadable with `weights_only=True`)
plus `model.json` (feature set, configs, dedup plan, summary): never a pickled object.

Multi-process: `nproc > 1` spawns that many workers (gloo on CPU, nccl on CUDA), or run
under `torchrun`; each rank takes every `world`-th batch, DDP averages gradients, rank 0
writes checkpoints and the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import resource
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from recd_core.batch_store import BatchStore, decode_batch
from recd_core.batching import epoch_order
from recd_core.config import FeatureSet, TrainConfig
from recd_core.dpp import Prepared, batch_ranges, encode_batch
from recd_core.model import DLRM
from recd_core.warehouse import Warehouse


class BatchMismatch(ValueError):
    """The preprocessed batches are not what the training config asks for."""


class CheckpointError(Exception):
    """A checkpoint that cannot be read: named, with what to do about it."""


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def run_name(ds: str, cfg: TrainConfig, batches_id: str = "") -> str:
    """The training run's key: day, mode, config and the batches partition's write id. A
    retry on the same batches resumes the run's checkpoints; re-preprocessed batches (a new
    write id) start a new run instead of resuming onto other data."""
    key = cfg.model_dump_json(exclude={"device", "threads"}) + batches_id
    return f"{ds}-{cfg.mode}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


# -- bytes on the warehouse filesystem -------------------------------------------------------
def _write_bytes(wh: Warehouse, path: str, data: bytes) -> None:
    """Write atomically: a temporary name, then a move (atomic on local filesystems)."""
    wh.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with wh.fs.open_output_stream(tmp) as f:
        f.write(data)
    wh.fs.move(tmp, path)


def _read_bytes(wh: Warehouse, path: str) -> bytes:
    with wh.fs.open_input_stream(path) as f:
        return f.read()


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _torch_load(data: bytes, where: str):
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds on a damaged file
        first_line = (str(e).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(
            f"{where} is corrupt or not a recd checkpoint ({type(e).__name__}: {first_line}); "
            "delete it to resume from the previous checkpoint"
        ) from None


@dataclass
class Checkpoints:
    wh: Warehouse
    run: str
    keep: int

    @property
    def dir(self) -> str:
        return f"{self.wh.root}/checkpoints/{self.run}"

    def list(self) -> list[str]:
        import pyarrow.fs as pafs

        if self.wh.fs.get_file_info(self.dir).type != pafs.FileType.Directory:
            return []
        infos = self.wh.fs.get_file_info(pafs.FileSelector(self.dir))
        return sorted(
            i.path for i in infos if i.base_name.startswith("step-") and i.base_name.endswith(".pt")
        )

    def save(self, state: dict) -> str:
        path = f"{self.dir}/step-{state['step']:08d}.pt"
        _write_bytes(self.wh, path, _torch_bytes(state))
        for old in self.list()[: -self.keep]:
            self.wh.fs.delete_file(old)
        return path

    def latest(self) -> dict | None:
        paths = self.list()
        if not paths:
            return None
        state = _torch_load(_read_bytes(self.wh, paths[-1]), paths[-1])
        if (
            not isinstance(state, dict)
            or not {"model", "opt_dense", "opt_sparse", "step"} <= state.keys()
        ):
            raise CheckpointError(
                f"{paths[-1]} is not a recd checkpoint (keys: {sorted(state)[:6]})"
            )
        return state


def _peak_mem(device: torch.device) -> int:
    """Peak memory: CUDA's allocator peak, or this process's peak resident set. VmHWM belongs
    to the address space, which exec replaces; ru_maxrss survives fork+exec and would report
    a big parent's peak in a freshly spawned child."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def make_optimizers(model: DLRM, cfg: TrainConfig):
    sparse = torch.optim.Adagrad(model.sparse_parameters(), lr=cfg.lr_sparse)
    dense = torch.optim.Adam(model.dense_parameters(), lr=cfg.lr_dense)
    return dense, sparse


def train_step(model, batch, opt_dense, opt_sparse, amp: bool) -> float:
    opt_dense.zero_grad(set_to_none=True)
    opt_sparse.zero_grad(set_to_none=True)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with ctx:
        logits = model(batch)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    loss.backward()
    opt_dense.step()
    opt_sparse.step()
    return float(loss.detach())


def _train_worker(
    rank: int, world: int, wh_uri: str, ds: str, cfg: TrainConfig, result_path: str | None
) -> dict:
    distributed = world > 1
    device = resolve_device(cfg.device)
    if distributed:
        if device.type == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # Adagrad rebuilds sparse gradients internally; torch warns about invariant checks.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    wh = Warehouse(wh_uri)
    store = BatchStore(wh, ds, cfg.mode)
    if store.manifest["batch_size"] != cfg.batch_size:
        raise BatchMismatch(
            f"batches/mode={cfg.mode}/ds={ds} were preprocessed with batch size "
            f"{store.manifest['batch_size']}, the training config asks for {cfg.batch_size}: "
            f"re-run `recd preprocess --batch-size {cfg.batch_size}` or train with that size"
        )
    features = store.model_features
    model = DLRM(features, cfg.model)
    model.init_output_bias(store.click_rate())
    model = model.to(device)
    opt_dense, opt_sparse = make_optimizers(model, cfg)
    name = run_name(ds, cfg, batches_id(wh, ds, cfg.mode))
    ckpts = Checkpoints(wh, name, cfg.keep_checkpoints)
    step = 0
    state = ckpts.latest()
    if state is not None:
        model.load_state_dict(state["model"])
        opt_dense.load_state_dict(state["opt_dense"])
        opt_sparse.load_state_dict(state["opt_sparse"])
        step = int(state["step"])
    net = DistributedDataParallel(model) if distributed else model
    n_batches = len(store)
    per_epoch = len(range(rank, n_batches, world))
    total = per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    resumed_at = step
    losses: list[float] = []
    samples = 0
    t0 = time.perf_counter()
    while step < total:
        epoch, k = divmod(step, per_epoch)
        b = int(epoch_order(n_batches, cfg.seed, epoch)[rank::world][k])
        batch = store[b].to(device)
        losses.append(
            train_step(net, batch, opt_dense, opt_sparse, cfg.amp and device.type == "cuda")
        )
        samples += batch.size
        step += 1
        if rank == 0 and (step % cfg.checkpoint_every == 0 or step == total):
            ckpts.save(_checkpoint_state(model, opt_dense, opt_sparse, step, cfg))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    summary = {
        "train.mode": cfg.mode,
        "train.run": name,
        "train.steps": step,
        "train.resumed_from_step": resumed_at,
        "train.samples": samples * world,
        "train.samples_per_s": samples * world / seconds if seconds > 0 and samples else 0.0,
        "train.loss": float(np.mean(losses[-10:])) if losses else float("nan"),
        "train.seconds": seconds,
        "train.peak_mem_bytes": _peak_mem(device),
        "train.device": str(device),
        "train.world_size": world,
        "train.dedup_groups": {g: len(fs) for g, fs in store.groups.items()},
        "train.batch_size": store.manifest["batch_size"],
    }
    if rank == 0:
        summary["train.model_uri"] = save_model(
            wh, name, model, cfg, store.manifest["prepared"], summary
        )
        if result_path:
            with open(result_path, "w") as f:
                json.dump(summary, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def batches_id(wh: Warehouse, ds: str, mode: str) -> str:
    return str(wh.manifest("batches", ds, mode=mode).get("write_id", ""))


def _checkpoint_state(model, opt_dense, opt_sparse, step: int, cfg: TrainConfig) -> dict:
    return {
        "model": model.state_dict(),
        "opt_dense": opt_dense.state_dict(),
        "opt_sparse": opt_sparse.state_dict(),
        "step": step,
        "config": cfg.model_dump_json(),
    }


def save_model(
    wh: Warehouse, run: str, model: DLRM, cfg: TrainConfig, prepared: dict, summary: dict
) -> str:
    base = f"{wh.root}/models/{run}"
    _write_bytes(
        wh, f"{base}/model.pt", _torch_bytes({k: v.cpu() for k, v in model.state_dict().items()})
    )
    meta = {
        "features": model.features.model_dump(mode="json"),
        "train": cfg.model_dump(mode="json"),
        "prepared": prepared,  # DPP's transforms, statistics and dedup groups: score with these
        "summary": {k: v for k, v in summary.items() if k != "train.model_uri"},
    }
    _write_bytes(wh, f"{base}/model.json", json.dumps(meta, indent=1).encode())
    return f"{wh.uri.rstrip('/')}/models/{run}"


def _model_location(uri: str) -> tuple[Warehouse, str]:
    """A model URI (`<warehouse>/models/<run>`) as its warehouse and the path inside it."""
    wh_uri, run = uri.rsplit("/models/", 1)
    wh = Warehouse(wh_uri)
    return wh, f"{wh.root}/models/{run}"


def load_model(uri: str) -> tuple[DLRM, dict]:
    """A saved model (state dict + model.json) at `<warehouse>/models/<run>`, for scoring."""
    wh, base = _model_location(uri)
    meta = json.loads(_read_bytes(wh, f"{base}/model.json"))
    return model_from(meta, _read_bytes(wh, f"{base}/model.pt"), f"{base}/model.pt"), meta


def load_model_dir(path: str | Path) -> tuple[DLRM, dict]:
    """The same two files from a local directory (a copy, e.g. MLflow's model artifacts)."""
    path = Path(path)
    meta = json.loads((path / "model.json").read_text())
    return model_from(meta, (path / "model.pt").read_bytes(), str(path / "model.pt")), meta


@contextlib.contextmanager
def model_dir(uri: str):
    """A local directory holding the saved model's two files (copied from an object store)."""
    wh, base = _model_location(uri)
    if wh.fs.type_name == "local":
        yield Path(base)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("model.pt", "model.json"):
            (Path(tmp) / name).write_bytes(_read_bytes(wh, f"{base}/{name}"))
        yield Path(tmp)


def model_from(meta: dict, weights: bytes, where: str) -> DLRM:
    features = FeatureSet.model_validate(meta["features"])
    model = DLRM(features, TrainConfig.model_validate(meta["train"]).model)
    model.load_state_dict(_torch_load(weights, where))
    return model.eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(
    rank: int, world: int, wh_uri: str, ds: str, cfg_json: str, result_path: str
) -> None:
    _train_worker(rank, world, wh_uri, ds, TrainConfig.model_validate_json(cfg_json), result_path)


def train(warehouse: Warehouse, ds: str, cfg: TrainConfig, nproc: int = 1) -> dict:
    """Train (resuming from the run's latest checkpoint); returns rank 0's summary."""
    warehouse.info("batches", ds, mode=cfg.mode)  # fail early, naming the partition
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        return _train_worker(
            int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), warehouse.uri, ds, cfg, None
        )
    if nproc <= 1:
        return _train_worker(0, 1, warehouse.uri, ds, cfg, None)
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = f"{tmp}/rank0.json"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        mp.start_processes(
            _spawn_entry,
            args=(nproc, warehouse.uri, ds, cfg.model_dump_json(), result),
            nprocs=nproc,
            start_method="spawn",
        )
        with open(result) as f:
            return json.load(f)


def predict(
    model: DLRM,
    meta: dict,
    table: pa.Table,
    batch_size: int = 4096,
    device: str = "cpu",
    trust_sessions: bool = True,
) -> np.ndarray:
    """Click probabilities for a samples table, preprocessed exactly as in training (the
    run's transforms and statistics), deduplicated like the training batches. Rows that did
    not pass ingest's session check (`trust_sessions=False`, e.g. served requests) are
    deduplicated by comparing values instead of by session id."""
    prep = Prepared.from_json(json.dumps(meta["prepared"]))
    if not trust_sessions and prep.dedup_method == "session":
        prep = dataclasses.replace(prep, dedup_method="runs")
    out = []
    model = model.to(device)
    with torch.no_grad():
        for lo, hi in batch_ranges(table.num_rows, batch_size):
            rb = encode_batch(table.slice(lo, hi - lo), prep)
            batch = decode_batch(rb, prep.model, prep.groups).to(device)
            out.append(torch.sigmoid(model(batch)).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0, np.float32)
