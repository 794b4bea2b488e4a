"""The batch format: `Batch`, what the model consumes, and DPP's preprocessed Arrow IPC
batches (see dpp/preprocess.py) decoded into it.

Kept apart from dpp/preprocess.py so DPP workers never import torch, and from modeling/model.py so the format
does not depend on the network.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from recd_core.config import FeatureSet
from recd_core.dedup.sparse import InverseKeyedJaggedTensor, KeyedJaggedTensor
from recd_core.stored_files import damage_named
from recd_core.warehouse import Warehouse


@dataclass
class Batch:
    """One training batch. `kjt`: per-sample id features; `groups`: deduplicated ones.
    `shared`: the groups' unique-row results (embeddings, history tokens) kept across the
    batches of one ranking request, whose unique rows are the same user row in every batch
    (scoring/ranking.py): the model computes them for the first batch and reuses them; None
    elsewhere (training, evaluation: each batch its own unique rows)."""

    dense: torch.Tensor  # [B, D] float32
    kjt: KeyedJaggedTensor | None
    labels: torch.Tensor  # [B] float32
    groups: dict[str, InverseKeyedJaggedTensor] = field(default_factory=dict)
    shared: dict | None = None

    @property
    def size(self) -> int:
        return self.labels.numel()

    def part(self, k: int, parts: int) -> Batch:
        """The k-th of `parts` contiguous slices of the samples (a sharded run's rank takes
        one): per-sample features sliced, each group keeping the unique rows its slice uses
        (session-clustered batches keep most of their duplicates within a slice)."""
        lo, hi = k * self.size // parts, (k + 1) * self.size // parts
        rows = torch.arange(lo, hi, device=self.labels.device)
        kjt = self.kjt.select_rows(rows) if self.kjt is not None else None
        groups = {}
        for g, ik in self.groups.items():
            used, inverse = torch.unique(ik.inverse_indices[lo:hi], return_inverse=True)
            groups[g] = InverseKeyedJaggedTensor(
                ik.unique.select_rows(used), inverse, validate=False
            )
        return Batch(self.dense[lo:hi], kjt, self.labels[lo:hi], groups)

    def to(self, device, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.kjt.to(device, non_blocking) if self.kjt is not None else None,
            self.labels.to(device, non_blocking=non_blocking),
            {g: ik.to(device, non_blocking) for g, ik in self.groups.items()},
        )


def _tensor(rb: pa.RecordBatch, name: str, dtype=None) -> torch.Tensor:
    arr = np.asarray(rb.column(name).values)
    t = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
    return t.to(dtype) if dtype is not None else t


def decode_batch(rb: pa.RecordBatch, model: FeatureSet, groups: dict[str, list[str]]) -> Batch:
    """A batch record -> tensors (KJT for per-sample ids, an IKJT per group)."""
    labels = _tensor(rb, "labels")
    n = labels.numel()
    dense = _tensor(rb, "dense").view(n, -1)
    grouped = {k for ks in groups.values() for k in ks}
    keys = [f.name for f in model.features if f.kind != "dense" and f.name not in grouped]
    kjt = None
    if keys:
        kjt = KeyedJaggedTensor(
            keys,
            torch.cat([_tensor(rb, f"ids.{k}.values") for k in keys]),
            torch.cat([_tensor(rb, f"ids.{k}.lengths", torch.int64) for k in keys]),
        )
    iks = {}
    for g, gkeys in groups.items():
        uniq = KeyedJaggedTensor(
            gkeys,
            torch.cat([_tensor(rb, f"group.{g}.{k}.values") for k in gkeys]),
            torch.cat([_tensor(rb, f"group.{g}.{k}.lengths", torch.int64) for k in gkeys]),
        )
        iks[g] = InverseKeyedJaggedTensor(uniq, _tensor(rb, f"group.{g}.inverse", torch.int64))
    return Batch(dense, kjt, labels, iks)


def expand(batch: Batch) -> Batch:
    """A dedup batch as the baseline batch it stands for (every id feature per sample)."""
    if not batch.groups:
        return batch
    parts = [batch.kjt] if batch.kjt is not None else []
    parts += [ik.to_kjt() for ik in batch.groups.values()]
    keys = [k for p in parts for k in p.keys]
    values = torch.cat([p[k].values for p in parts for k in p.keys])
    lengths = torch.cat([p[k].lengths for p in parts for k in p.keys])
    return Batch(batch.dense, KeyedJaggedTensor(keys, values, lengths), batch.labels, {})


def read_manifest(wh: Warehouse, ds: str, mode: str) -> dict:
    return wh.manifest("batches", ds, mode=mode)


def model_shape(wh: Warehouse, ds: str, mode: str) -> tuple[FeatureSet, int]:
    """What a day's training batches size the model by, from the manifest alone (no batch
    file read or verified): the model's features and `BatchStore.samples()`."""
    manifest = read_manifest(wh, ds, mode)
    features = FeatureSet.model_validate(manifest["prepared"]["model"])
    return features, manifest["batches"] * manifest["batch_size"]


SPLIT_PREFIX = {"train": "shard-", "validation": "valid-"}


class BatchStore:
    """A preprocessed day's training or validation batches, in order, read and decoded to
    tensors on demand (`split`: which files of the partition, see dpp/preprocess.py).

    Only the files' footers are read up front: a batch is read from its file when asked for,
    so memory holds a batch, not the day (the files stay open; the OS caches them)."""

    def __init__(self, wh: Warehouse, ds: str, mode: str, split: str = "train"):
        self.manifest = read_manifest(wh, ds, mode)
        prepared = self.manifest["prepared"]
        self.model_features = FeatureSet.model_validate(prepared["model"])
        self.groups: dict[str, list[str]] = prepared["groups"]
        self.fs = wh.fs
        self.left_out: dict[str, str] = {}  # window days not trained on, and why
        self._readers: dict[str, ipc.RecordBatchFileReader] = {}
        # the readers are shared by threads (a run's oracle reads ahead in the background)
        self._lock = threading.Lock()
        self.refs: list[tuple[str, int]] = []  # (file, batch within it), in order
        prefix = SPLIT_PREFIX[split]
        for path in wh.files("batches", ds, mode=mode):
            if path.rsplit("/", 1)[-1].startswith(prefix):
                wh.verify(path, self.manifest)  # its CRC-32: IPC files carry none of their own
                self.refs += [(path, i) for i in range(self._reader(path).num_record_batches)]

    def _reader(self, path: str) -> ipc.RecordBatchFileReader:
        if path not in self._readers:
            with damage_named(path):
                self._readers[path] = ipc.open_file(self.fs.open_input_file(path))
        return self._readers[path]

    def prepend(self, older: BatchStore) -> None:
        """Train on `older`'s batches first (a window of days)."""
        self._readers.update(older._readers)
        self.refs = older.refs + self.refs

    def record(self, i: int) -> pa.RecordBatch:
        path, k = self.refs[i]
        with damage_named(path), self._lock:
            return self._reader(path).get_batch(k)

    def __len__(self) -> int:
        return len(self.refs)

    def samples(self) -> int:
        """About the samples in the batches: whole batches' worth (over by under a batch
        a file), what `ModelConfig.for_samples` sizes the model by."""
        return len(self.refs) * self.manifest["batch_size"]

    def __getitem__(self, i: int) -> Batch:
        return decode_batch(self.record(i), self.model_features, self.groups)

    def __iter__(self) -> Iterator[Batch]:
        return (self[i] for i in range(len(self)))

    def click_rate(self) -> float:
        total = clicks = 0.0
        for i in range(len(self)):
            labels = np.asarray(self.record(i).column("labels").values)
            total, clicks = total + labels.size, clicks + float(labels.sum())
        return clicks / total if total else 0.0
