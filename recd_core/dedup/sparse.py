"""Jagged tensors: KeyedJaggedTensor (one row per sample) and InverseKeyedJaggedTensor (one
row per *distinct* sample value, plus the map back). API names follow TorchRec.

KeyedJaggedTensor, keys ["f1", "f2"], batch of 3:

    f1: [1, 2] [] [3]        f2: [7] [7] [8, 9]

    values  = [1, 2, 3, 7, 7, 8, 9]        key-major: all of f1's rows, then f2's
    lengths = [2, 0, 1, 1, 1, 2]           one per (key, sample)
    offsets = [0, 2, 2, 3, 4, 5, 7]        cumsum of lengths, leading 0

InverseKeyedJaggedTensor: the same batch, with the features of a group deduplicated
together (two samples share a unique row only if every feature of the group is equal):

    group ("f1", "f2"), samples 0..3 below; samples 0 and 2 are identical:

    f1: [1, 2] [3] [1, 2] [3]     f2: [7] [8] [7] [8, 9]

    unique = KeyedJaggedTensor over 3 unique rows:
        f1: [1, 2] [3] [3]        f2: [7] [8] [8, 9]
    inverse_indices = [0, 1, 0, 2]         sample i is unique row inverse_indices[i]

Expanding (`to_kjt`) is exact: `unique` rows gathered by `inverse_indices`. Modules that see
only the group's features (embedding bags, the history encoder) run on `unique` and their
outputs are expanded with `index_select(0, inverse_indices)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from recd_core.dedup.unique import list_parts as _list_parts
from recd_core.dedup.unique import unique_rows
from recd_core.errors import BadInput


class JaggedError(BadInput, ValueError):
    """A jagged tensor whose parts do not fit together."""


@dataclass(frozen=True)
class JaggedTensor:
    """One key's rows: `values[offsets[i]:offsets[i+1]]` is row i."""

    values: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor

    def to_list(self) -> list[list[int]]:
        v, o = self.values.tolist(), self.offsets.tolist()
        return [v[o[i] : o[i + 1]] for i in range(len(o) - 1)]


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


class KeyedJaggedTensor:
    """Variable-length id lists for several keys over one batch (layout: module docstring)."""

    def __init__(
        self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, *, validate: bool = True
    ):
        self.keys = list(keys)
        self.values = values
        self.lengths = lengths
        if validate:
            self.validate()
        self.offsets = _offsets(self.lengths)

    def validate(self) -> None:
        if self.values.dim() != 1 or self.lengths.dim() != 1:
            raise JaggedError("values and lengths must be 1-D tensors")
        if self.values.dtype != torch.int64 or self.lengths.dtype != torch.int64:
            raise JaggedError(
                f"values and lengths must be int64, got {self.values.dtype}/{self.lengths.dtype}"
            )
        if len(self.keys) == 0 or self.lengths.numel() % len(self.keys):
            raise JaggedError(
                f"{self.lengths.numel()} lengths do not split evenly over {len(self.keys)} keys"
            )
        if self.lengths.numel() and bool((self.lengths < 0).any()):
            raise JaggedError("negative length")
        total = int(self.lengths.sum()) if self.lengths.numel() else 0
        if total != self.values.numel():
            raise JaggedError(f"lengths sum to {total} but there are {self.values.numel()} values")

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys)

    def length_per_key(self) -> torch.Tensor:
        return self.lengths.view(len(self.keys), -1).sum(1)

    def __getitem__(self, key: str) -> JaggedTensor:
        k = self.keys.index(key)
        b = self.batch_size
        lo, hi = int(self.offsets[k * b]), int(self.offsets[(k + 1) * b])
        lengths = self.lengths[k * b : (k + 1) * b]
        return JaggedTensor(self.values[lo:hi], lengths, self.offsets[k * b : (k + 1) * b + 1] - lo)

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self.keys}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            self.keys,
            self.values.to(device, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
            validate=False,
        )

    def pin_memory(self) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            self.keys, self.values.pin_memory(), self.lengths.pin_memory(), validate=False
        )

    def select_rows(self, rows: torch.Tensor) -> KeyedJaggedTensor:
        """The rows `rows` (a gather, per key): the expansion of an IKJT."""
        parts_v, parts_l = [], []
        for key in self.keys:
            jt = self[key]
            lengths = jt.lengths.index_select(0, rows)
            starts = jt.offsets[:-1].index_select(0, rows)
            idx = torch.repeat_interleave(starts - _offsets(lengths)[:-1], lengths) + torch.arange(
                int(lengths.sum()), device=lengths.device
            )
            parts_v.append(jt.values.index_select(0, idx))
            parts_l.append(lengths)
        return KeyedJaggedTensor(self.keys, torch.cat(parts_v), torch.cat(parts_l), validate=False)

    def equals(self, other: KeyedJaggedTensor) -> bool:
        return (
            self.keys == other.keys
            and torch.equal(self.lengths.cpu(), other.lengths.cpu())
            and torch.equal(self.values.cpu(), other.values.cpu())
        )

    def __repr__(self) -> str:
        return f"KeyedJaggedTensor(keys={self.keys}, batch_size={self.batch_size}, values={self.values.numel()})"


class InverseKeyedJaggedTensor:
    """A feature group's distinct rows (`unique`, a KJT) and `inverse_indices` (batch length)."""

    def __init__(
        self, unique: KeyedJaggedTensor, inverse_indices: torch.Tensor, *, validate: bool = True
    ):
        self.unique = unique
        self.inverse_indices = inverse_indices
        if validate:
            self.validate()

    def validate(self) -> None:
        inv = self.inverse_indices
        if inv.dim() != 1 or inv.dtype != torch.int64:
            raise JaggedError("inverse_indices must be a 1-D int64 tensor")
        n = self.unique.batch_size
        if inv.numel() and (int(inv.min()) < 0 or int(inv.max()) >= n):
            raise JaggedError(
                f"inverse index out of range: values in [{int(inv.min())}, {int(inv.max())}] "
                f"but there are {n} unique rows"
            )

    @property
    def keys(self) -> list[str]:
        return self.unique.keys

    @property
    def batch_size(self) -> int:
        return self.inverse_indices.numel()

    @property
    def num_unique(self) -> int:
        return self.unique.batch_size

    def to_kjt(self) -> KeyedJaggedTensor:
        return self.unique.select_rows(self.inverse_indices)

    @classmethod
    def from_kjt(cls, kjt: KeyedJaggedTensor) -> InverseKeyedJaggedTensor:
        """Deduplicate a KJT's rows (all its keys together), exactly."""
        lengths = kjt.lengths.view(len(kjt.keys), -1).cpu().numpy()
        flat = [kjt[k].values.cpu().numpy() for k in kjt.keys]
        first, inverse = unique_rows(flat, list(lengths))
        uniq = kjt.select_rows(torch.from_numpy(first).to(kjt.lengths.device))
        return cls(uniq, torch.from_numpy(inverse).to(kjt.lengths.device), validate=False)

    def to(
        self, device: torch.device | str, non_blocking: bool = False
    ) -> InverseKeyedJaggedTensor:
        return InverseKeyedJaggedTensor(
            self.unique.to(device, non_blocking),
            self.inverse_indices.to(device, non_blocking=non_blocking),
            validate=False,
        )

    def pin_memory(self) -> InverseKeyedJaggedTensor:
        return InverseKeyedJaggedTensor(
            self.unique.pin_memory(), self.inverse_indices.pin_memory(), validate=False
        )

    def __repr__(self) -> str:
        return f"InverseKeyedJaggedTensor(keys={self.keys}, batch_size={self.batch_size}, unique={self.num_unique})"


# -- from Arrow ----------------------------------------------------------------------------------
def kjt_from_arrow(batch: pa.Table | pa.RecordBatch, keys: list[str]) -> KeyedJaggedTensor:
    """A KJT over `keys` (list or scalar id columns) of an Arrow batch."""
    parts = [_list_parts(batch.column(k)) for k in keys]
    values = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    lengths = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return KeyedJaggedTensor(keys, values, lengths, validate=False)


def ikjt_from_arrow(batch: pa.Table | pa.RecordBatch, keys: list[str]) -> InverseKeyedJaggedTensor:
    """An IKJT deduplicating `keys` together: only unique rows are materialized as tensors."""
    parts = [_list_parts(batch.column(k)) for k in keys]
    first, inverse = unique_rows([p[0] for p in parts], [p[1] for p in parts])
    uniq = kjt_from_arrow(batch.take(pa.array(first)), keys)
    return InverseKeyedJaggedTensor(uniq, torch.from_numpy(inverse), validate=False)


def to_torchrec(x: KeyedJaggedTensor | InverseKeyedJaggedTensor):
    """TorchRec's KeyedJaggedTensor (needs the `torchrec` extra). An IKJT becomes a
    variable-batch KJT (one stride per key = the unique rows) with `inverse_indices`."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TrecKJT

    if isinstance(x, KeyedJaggedTensor):
        return TrecKJT(keys=x.keys, values=x.values, lengths=x.lengths)
    n = x.num_unique
    inverse = x.inverse_indices.unsqueeze(0).expand(len(x.keys), -1).contiguous()
    return TrecKJT(
        keys=x.keys,
        values=x.unique.values,
        lengths=x.unique.lengths,
        stride_per_key_per_rank=[[n] for _ in x.keys],
        inverse_indices=(x.keys, inverse),
    )


def from_torchrec(kjt) -> KeyedJaggedTensor | InverseKeyedJaggedTensor:
    """TorchRec's KJT -> recd's: a variable-batch KJT with `inverse_indices` (one stride per
    key, as `to_torchrec` writes an IKJT) becomes an IKJT, a plain one a KJT."""
    keys = list(kjt.keys())
    values, lengths = kjt.values(), kjt.lengths().to(torch.int64)
    if kjt.variable_stride_per_key():
        strides = kjt.stride_per_key()
        if len(set(strides)) != 1:
            raise BadInput(f"a variable-batch KJT with strides {strides}: one per IKJT group")
        inverse = kjt.inverse_indices_or_none()
        if inverse is None:
            raise BadInput("a variable-batch KJT without inverse_indices is no IKJT")
        inv_keys, inv = inverse
        if list(inv_keys) != keys or not bool((inv == inv[:1]).all()):
            raise BadInput("an IKJT's keys share one inverse_indices row; this KJT's differ")
        unique = KeyedJaggedTensor(keys, values, lengths)
        return InverseKeyedJaggedTensor(unique, inv[0].to(torch.int64))
    return KeyedJaggedTensor(keys, values, lengths)
