"""A model's tables as shard files: written by every rank of a sharded run, so no process
ever holds a whole table, and read on demand, memory-mapped, so a reader pages in only the
rows it looks up (evaluate, the registry's scoring, serving) or the row ranges it places
(a warm start onto any number of processes: the shards are cut again on load).

    <model dir>/
        model.json   "tables": {"layout": "shards", "dim": d, "world": N,
                                "tables": {<state key>: {"name": t_items, "rows": R,
                                   "shards": [{"box": [r0, c0, nr, nc],
                                               "weights": "tables/t_items.r0-r1.c0-c1.f32",
                                               "accumulators": "tables/....acc.f32"}, ...]}}}
        model.pt      the dense weights only (calibration among them)
        optimizer.pt  the dense optimizer's state; the tables' Adagrad param groups
        tables/t_items.0-2048000.0-16.f32        a shard's weights: nr x nc float32,
                                                 row-major, little-endian (memory-mapped)
        tables/t_items.0-2048000.0-16.acc.f32    its rows' Adagrad accumulators (nr float32)

Raw arrays rather than torch files: a memory map reads a row range without reading the
file, and writing streams the shard in row blocks (torch.save of a shard would copy it
whole, and save a view's whole storage). A shard's bytes are checked against its box when
opened: a short file is refused in one line naming it.

The readers are duck-typed for the two places a table's state is consumed: `LazyTable`
(`.shape`, `table[r0:r1, c0:c1]`, `rows(ids)`) and `LazyAccumulator` (`.numel()`,
`acc[r0:r1]`) stand in for the single-process layout's tensors, and `materialized` turns
a state holding them into plain tensors (a one-process run that holds the tables)."""

from __future__ import annotations

import mmap
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recd_core.errors import BadInput
from recd_core.leftovers import write_atomically

LAYOUT = "shards"
ROW_BLOCK = 1 << 16  # rows a write converts at once: the writer's memory beyond the shard


class ShardFileError(BadInput):
    """A shard file that cannot be read as its model.json describes it."""


def shard_name(table: str, box: tuple[int, int, int, int], folder: str = "tables") -> str:
    r0, c0, nr, nc = box
    return f"{folder}/{table}.{r0}-{r0 + nr}.{c0}-{c0 + nc}"


def write_array(fs, path: str, tensor: torch.Tensor) -> int:
    """`tensor` (2-d or 1-d, any layout) as raw float32 at `path`, streamed in row blocks,
    whole or not at all; its CRC-32."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raise RuntimeError("shard files are little-endian")
    crc = 0

    def blocks():
        nonlocal crc
        for lo in range(0, tensor.shape[0], ROW_BLOCK):
            data = tensor[lo : lo + ROW_BLOCK].detach().to("cpu", torch.float32)
            data = data.contiguous().numpy().tobytes()
            crc = zlib.crc32(data, crc)
            yield data

    write_atomically(fs, path, blocks())
    return crc


def write_shard(fs, base: str, table: str, box, weights: torch.Tensor,
                accumulators: torch.Tensor | None, folder: str = "tables") -> dict:  # fmt: skip
    """One shard of one table (its weights, its rows' accumulators) in `base`/`folder`; its
    model.json entry (its files named relative to `base`)."""
    name = shard_name(table, box, folder)
    entry = {"box": list(box), "weights": f"{name}.f32",
             "crc32": write_array(fs, f"{base}/{name}.f32", weights)}  # fmt: skip
    if accumulators is not None:
        acc = accumulators.reshape(-1)[: box[2]]
        entry["accumulators"] = f"{name}.acc.f32"
        entry["accumulators_crc32"] = write_array(fs, f"{base}/{name}.acc.f32", acc)
    return entry


def layout(dim: int, world: int, specs, entries: list[dict]) -> dict:
    """model.json's "tables": every rank's entries (`(state key, table name, rows, entry)`),
    per table in `specs` order; refuses a table whose shards do not cover it."""
    tables = {s.key: {"name": s.name, "rows": s.rows, "shards": []} for s in specs}
    for key, entry in entries:
        tables[key]["shards"].append(entry)
    for key, t in tables.items():
        t["shards"].sort(key=lambda e: (e["box"][0], e["box"][1]))
        area = sum(e["box"][2] * e["box"][3] for e in t["shards"])
        if area != t["rows"] * dim:
            raise RuntimeError(f"{key}: its shards cover {area} of {t['rows'] * dim} values")
    return {"layout": LAYOUT, "dim": dim, "world": world, "tables": tables}


def is_sharded(meta: dict) -> bool:
    return (meta.get("tables") or {}).get("layout") == LAYOUT


@dataclass
class _Shard:
    r0: int
    c0: int
    nr: int
    nc: int
    weights: np.memmap
    accumulators: np.memmap | None


def _mapped(path: Path, shape: tuple[int, ...]) -> np.memmap:
    expected = int(np.prod(shape)) * 4
    try:
        size = path.stat().st_size
    except OSError:
        raise ShardFileError(f"{path}: the model's shard file is missing") from None
    if size != expected:
        raise ShardFileError(
            f"{path}: {size} bytes, its box {'x'.join(map(str, shape))} float32 needs "
            f"{expected} (a damaged or partial copy of the model)"
        )
    if not expected:
        return np.zeros(shape, np.float32)  # type: ignore[return-value]
    return np.memmap(path, dtype="<f4", mode="r", shape=shape)


class LazyTable:
    """One table, its rows read from its shard files when asked: `table[r0:r1, c0:c1]`
    (a box, for a shard of another placement), `rows(ids)` (a lookup), `materialize()`."""

    def __init__(self, key: str, rows: int, dim: int, shards: list[_Shard]):
        self.key, self.shape, self.shards = key, (rows, dim), shards

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        r0, r1, _ = rows.indices(self.shape[0])
        c0, c1, _ = cols.indices(self.shape[1])
        out = torch.empty(max(r1 - r0, 0), max(c1 - c0, 0))
        for s in self.shards:
            lo, hi = max(r0, s.r0), min(r1, s.r0 + s.nr)
            left, right = max(c0, s.c0), min(c1, s.c0 + s.nc)
            if lo < hi and left < right:  # one copy: from the map into `out`
                part = s.weights[lo - s.r0 : hi - s.r0, left - s.c0 : right - s.c0]
                out.numpy()[lo - r0 : hi - r0, left - c0 : right - c0] = part
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), dim]: the rows of `ids` (each distinct row read once)."""
        unique, inverse = torch.unique(ids.cpu(), return_inverse=True)
        out = torch.empty(len(unique), self.shape[1])
        u = unique.numpy()
        for s in self.shards:
            mine = np.nonzero((u >= s.r0) & (u < s.r0 + s.nr))[0]
            if len(mine):
                out[mine, s.c0 : s.c0 + s.nc] = torch.from_numpy(s.weights[u[mine] - s.r0])
        return out[inverse]

    def materialize(self) -> torch.Tensor:
        return self[:, :]

    def release(self) -> None:
        """Give back the pages of the shard files read so far (a placement that copied its
        rows needs them no more; they would count in the process's memory until then)."""
        for s in self.shards:
            for m in (s.weights, s.accumulators):
                if isinstance(m, np.memmap) and getattr(m, "_mmap", None) is not None:
                    m._mmap.madvise(mmap.MADV_DONTNEED)


class LazyAccumulator:
    """One table's per-row Adagrad accumulators from its shard files (a column-wise
    shard's is the mean over its columns: the row's is their column-weighted mean)."""

    def __init__(self, table: LazyTable):
        self.table = table

    def numel(self) -> int:
        return self.table.shape[0]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        r0, r1, _ = rows.indices(self.table.shape[0])
        out = torch.zeros(max(r1 - r0, 0))
        dim = self.table.shape[1]
        for s in self.table.shards:
            lo, hi = max(r0, s.r0), min(r1, s.r0 + s.nr)
            if lo < hi and s.accumulators is not None:
                part = torch.from_numpy(np.array(s.accumulators[lo - s.r0 : hi - s.r0]))
                out[lo - r0 : hi - r0] += part * (s.nc / dim)
        return out

    def materialize(self) -> torch.Tensor:
        return self[:]

    def release(self) -> None:
        self.table.release()


def open_tables(directory: Path, meta: dict) -> dict[str, LazyTable]:
    """The tables of the sharded model in `directory` (model.json parsed as `meta`), by
    their key in the single-process state dict; every shard file checked for its size."""
    spec = meta["tables"]
    dim = int(spec["dim"])
    out = {}
    for key, t in spec["tables"].items():
        shards = []
        for e in t["shards"]:
            r0, c0, nr, nc = (int(v) for v in e["box"])
            acc = e.get("accumulators")
            shards.append(_Shard(r0, c0, nr, nc, _mapped(directory / e["weights"], (nr, nc)),
                                 _mapped(directory / acc, (nr,)) if acc else None))  # fmt: skip
        out[key] = LazyTable(key, int(t["rows"]), dim, shards)
    return out


def materialized(obj):
    """`obj` (a state dict, an optimizer state, nested) with its lazy tables and
    accumulators read whole: for a process that holds the tables."""
    if isinstance(obj, LazyTable | LazyAccumulator):
        return obj.materialize()
    if isinstance(obj, dict):
        return {k: materialized(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [materialized(v) for v in obj]
    return obj


def files_of(meta: dict) -> list[str]:
    """The shard files a sharded model's model.json names (relative to the model)."""
    if not is_sharded(meta):
        return []
    return [e[k] for t in meta["tables"]["tables"].values() for e in t["shards"]
            for k in ("weights", "accumulators") if k in e]  # fmt: skip
