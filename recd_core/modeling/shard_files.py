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
whole, and save a view's whole storage).

Verified before trusted (`open_tables`): model.json is the manifest, and nothing it names
is read until it holds together: every path a plain one inside the model's directory (no
`..`, no absolute path, no link out, a regular file), every box inside its table and named
as its file is, the boxes of a table tiling it exactly (no overlap, no gap), float32 only,
accumulators on every shard of a table or on none (as the table's `"accumulators"` says),
and each file of its box's size and of the CRC-32 recorded when it was written (one
sequential pass while opening; the pages it reads are the ones the map then finds cached).
A failure is one line naming the file and what is wrong, never what the file holds.
A reader that must outlive changes to the files (a server) takes `private`: each shard is
copied into a directory the process owns, checked there and mapped, and the copy unlinked
once mapped, so a shard truncated, replaced or deleted under it changes nothing it reads (a
mapped file truncated under its reader is a SIGBUS).

The readers are duck-typed for the two places a table's state is consumed: `LazyTable`
(`.shape`, `table[r0:r1, c0:c1]`, `rows(ids)`) and `LazyAccumulator` (`.numel()`,
`acc[r0:r1]`) stand in for the single-process layout's tensors, and `materialized` turns
a state holding them into plain tensors (a one-process run that holds the tables)."""

from __future__ import annotations

import mmap
import shutil
import stat
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import pyarrow.fs as pafs
import torch

from recd_core.errors import BadInput
from recd_core.leftovers import write_atomically
from recd_core.stored_files import file_crc32

LAYOUT = "shards"
DTYPE = "float32"  # the only one written or read: little-endian, 4 bytes a value
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


def write_shard(
    fs,
    base: str,
    table: str,
    box,
    weights: torch.Tensor,
    accumulators: torch.Tensor | None,
    folder: str = "tables",
) -> dict:
    """One shard of one table (its weights, its rows' accumulators) in `base`/`folder`; its
    model.json entry (its files named relative to `base`)."""
    name = shard_name(table, box, folder)
    entry = {
        "box": list(box),
        "dtype": DTYPE,
        "weights": f"{name}.f32",
        "crc32": write_array(fs, f"{base}/{name}.f32", weights),
    }
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
        problem = tiling_problem([tuple(e["box"]) for e in t["shards"]], t["rows"], dim)
        if problem:
            raise RuntimeError(f"{key}: {problem}")
        with_acc = {"accumulators" in e for e in t["shards"]}
        if len(with_acc) > 1:
            raise RuntimeError(f"{key}: accumulators written for some of its shards only")
        t["accumulators"] = with_acc == {True}
    return {"layout": LAYOUT, "dim": dim, "world": world, "tables": tables}


def tiling_problem(boxes: list[tuple[int, int, int, int]], rows: int, dim: int) -> str | None:
    """Why `boxes` (`r0, c0, nr, nc`) do not tile a rows x dim table exactly (a box outside
    it, two overlapping, a gap), or None."""
    for r0, c0, nr, nc in boxes:
        if min(r0, c0, nr, nc) < 0 or r0 + nr > rows or c0 + nc > dim:
            return f"box {[r0, c0, nr, nc]} lies outside the table ({rows} x {dim})"
    ordered = sorted(boxes)
    for i, (r0, c0, nr, nc) in enumerate(ordered):
        for s0, d0, mr, mc in ordered[i + 1 :]:
            if s0 >= r0 + nr:
                break  # sorted by first row: no later box reaches back into this one
            if d0 < c0 + nc and c0 < d0 + mc and mr and mc and nr and nc:
                return f"boxes {[r0, c0, nr, nc]} and {[s0, d0, mr, mc]} overlap"
    area = sum(nr * nc for _, _, nr, nc in boxes)
    if area != rows * dim:
        return f"its shards cover {area} of {rows * dim} values (a gap)"
    return None


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


def plain(name: object, where: Path, what: str) -> str:
    """model.json's `name` (a file of the model), once it is a plain relative path: no
    `..`, not absolute; refused, naming `where`, otherwise."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or name.startswith("/") or "\\" in name or ".." in parts or "\0" in name:
        raise ShardFileError(
            f"{where}: {what} {repr(name)[:120]} is not a path inside the model's directory: "
            "refused, nothing read"
        )
    return name


def inside(directory: Path, name: object, what: str) -> Path:
    """`directory`/`name`, where `name` is `plain` and no link leads it out of `directory`;
    refused before anything is opened."""
    path = directory / plain(name, directory / "model.json", what)
    if not path.resolve().is_relative_to(directory.resolve()):
        raise ShardFileError(
            f"{path}: {what} is a link out of the model's directory: refused, nothing read"
        )
    return path


def _checked(path: Path, shape: tuple[int, ...], crc: int, copy: Path | None) -> np.memmap:
    """The shard file at `path` mapped, once it is a regular file of its box's size whose
    bytes have the CRC-32 `crc`; with `copy`, it is copied there first (in the kernel:
    `copy_file_range`, a reflink where the filesystem has them) and the copy is checked
    and mapped: what the reader maps is what was checked, and its own."""
    expected = int(np.prod(shape)) * 4
    box = "x".join(map(str, shape))
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ShardFileError(f"{path}: the model's shard file is missing") from None
    if not stat.S_ISREG(info.st_mode):
        raise ShardFileError(f"{path}: not a regular file; refused, nothing read")
    if info.st_size != expected:
        raise ShardFileError(
            f"{path}: not the size of its box ({box} float32, {expected} "
            "bytes): a damaged or partial copy of the model"
        )
    if copy is not None:
        shutil.copyfile(path, copy)
    if file_crc32(pafs.LocalFileSystem(), str(copy or path)) != crc:
        raise ShardFileError(
            f"{path}: its bytes do not match the CRC-32 model.json records "
            "(changed or damaged since it was saved)"
        )
    if not expected:
        return np.zeros(shape, np.float32)  # type: ignore[return-value]
    return np.memmap(copy or path, dtype="<f4", mode="r", shape=shape)


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

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids)]: the accumulators of rows `ids`."""
        u = ids.cpu().numpy()
        out = torch.zeros(len(u))
        dim = self.table.shape[1]
        for s in self.table.shards:
            mine = np.nonzero((u >= s.r0) & (u < s.r0 + s.nr))[0]
            if len(mine) and s.accumulators is not None:
                part = torch.from_numpy(np.array(s.accumulators[u[mine] - s.r0]))
                out[mine] += part * (s.nc / dim)
        return out

    def materialize(self) -> torch.Tensor:
        return self[:]

    def release(self) -> None:
        self.table.release()


def open_tables(directory: Path, meta: dict, private: Path | None = None) -> dict[str, LazyTable]:
    """The tables of the sharded model in `directory` (model.json parsed as `meta`), by
    their key in the single-process state dict, verified (the module's docstring); with
    `private` (a directory the caller owns), mapped from copies made there."""
    where = directory / "model.json"
    spec = meta["tables"]
    dim = spec["dim"]
    if not _count(dim) or not dim or not isinstance(spec["tables"], dict):
        raise ShardFileError(f"{where}: its tables' layout is not a recd layout")
    out = {}
    for key, t in spec["tables"].items():
        rows, name, entries = t["rows"], t["name"], t["shards"]
        if not (_count(rows) and isinstance(name, str) and isinstance(entries, list)):
            raise ShardFileError(f"{where}: table {key!r}: not a recd table's layout")
        boxes = [_box(where, key, e) for e in entries]
        if problem := tiling_problem(boxes, rows, dim):
            raise ShardFileError(f"{where}: table {key!r}: {problem}")
        with_acc = {"accumulators" in e for e in entries}
        declared = t.get("accumulators", with_acc == {True})
        if with_acc not in ({declared}, set()):
            raise ShardFileError(
                f"{where}: table {key!r}: accumulators {'missing' if declared else 'unexpected'} "
                "on some of its shards (the optimizer's state would not match its table)"
            )
        shards = []
        for e, (r0, c0, nr, nc) in zip(entries, boxes, strict=True):
            stem = shard_name(name, (r0, c0, nr, nc), "").lstrip("/")
            files = [("weights", "crc32", f"{stem}.f32", (nr, nc))]
            if "accumulators" in e:
                files.append(("accumulators", "accumulators_crc32", f"{stem}.acc.f32", (nr,)))
            maps = []
            for field, crc_field, expected, shape in files:
                path = inside(directory, e[field], f"table {key!r}'s shard file")
                if path.name != expected:
                    raise ShardFileError(
                        f"{path}: named for another box than {[r0, c0, nr, nc]} "
                        f"(expected {expected}): refused"
                    )
                crc = e.get(crc_field)
                if not _count(crc):
                    raise ShardFileError(f"{path}: model.json records no CRC-32 for it")
                copy = None
                if private is not None:
                    copy = private / Path(e[field]).parent.name / expected
                    copy.parent.mkdir(parents=True, exist_ok=True)
                maps.append(_checked(path, shape, crc, copy))
            shards.append(_Shard(r0, c0, nr, nc, maps[0], maps[1] if len(maps) > 1 else None))
        out[key] = LazyTable(key, rows, dim, shards)
    return out


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _box(where: Path, key: str, entry) -> tuple[int, int, int, int]:
    """A shard entry's box, once the entry is one recd writes (float32, four counts)."""
    box = entry.get("box") if isinstance(entry, dict) else None
    if not (isinstance(box, list) and len(box) == 4 and all(_count(v) for v in box)):
        raise ShardFileError(f"{where}: table {key!r}: a shard without a box of four counts")
    if entry.get("dtype", DTYPE) != DTYPE:
        raise ShardFileError(
            f"{where}: table {key!r}: shard {box} is {str(entry['dtype'])[:20]!r}; "
            f"recd reads {DTYPE} shard files only"
        )
    return tuple(box)


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
    names = [
        e[k]
        for t in meta["tables"]["tables"].values()
        for e in t["shards"]
        for k in ("weights", "accumulators")
        if k in e
    ]
    # copied from a store by these names: none may lead out of the model
    return [plain(name, Path("model.json"), "a shard file") for name in names]
