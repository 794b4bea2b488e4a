"""Reading a committed partition's files: every Parquet page verified against its CRC-32 and
damage turned into a `PartitionDamaged` naming the file; a file's stored form (rows, and a
session-normalized file's side rows, expanded back to whole rows); a file's CRC-32."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from zlib_ng import zlib_ng as zlib

from recd_core.errors import BadInput, RecdError, first_line


class PartitionDamaged(BadInput):
    """A committed partition whose manifest or files cannot be trusted (damaged, truncated,
    missing, or a name that leads outside it): named, never read. Rerun the stage that
    writes it; a retry of the reader cannot help."""


@contextlib.contextmanager
def damage_named(path: str) -> Iterator[None]:
    """Reading `path`, a file of a committed partition: what Arrow or the OS raise about its
    bytes becomes a `PartitionDamaged` naming it (a permission error stays what it is)."""
    try:
        yield
    except (PermissionError, RecdError):
        raise
    except (pa.ArrowException, OSError) as e:
        first = first_line(e, 200, type(e).__name__)
        raise PartitionDamaged(
            f"{path} is damaged ({first}): rerun the stage that writes it"
        ) from None


class _Verified:
    """A `ParquetFile` whose every call (read, read_row_group, metadata, ...) turns damage
    into a `PartitionDamaged` naming the file (iterators: `read_batches`)."""

    def __init__(self, pf: pq.ParquetFile, path: str):
        self._pf, self._path = pf, path

    def __getattr__(self, name: str):
        with damage_named(self._path):
            attr = getattr(self._pf, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with damage_named(self._path):
                return attr(*args, **kwargs)

        return call


def open_parquet(fs: pafs.FileSystem, path: str) -> pq.ParquetFile:
    """A Parquet file of the warehouse, opened so that every page read verifies its CRC-32
    and damage is a `PartitionDamaged` naming it."""
    with damage_named(path):
        return _Verified(
            pq.ParquetFile(fs.open_input_file(path), page_checksum_verification=True), path
        )


def read_batches(fs: pafs.FileSystem, path: str, batch_size: int) -> Iterator[pa.RecordBatch]:
    """A warehouse Parquet file's record batches, verified as read (`open_parquet`): damage
    is a `PartitionDamaged` naming it; what the caller does with a batch is not wrapped."""
    batches = open_parquet(fs, path).iter_batches(batch_size=batch_size)
    while True:
        with damage_named(path):
            batch = next(batches, None)
        if batch is None:
            return
        yield batch


def file_crc32(fs: pafs.FileSystem, path: str) -> int:
    """The CRC-32 of a file's bytes, read in pieces (zlib-ng: several GB/s)."""
    crc = 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


@dataclass(frozen=True)
class Normalized:
    """Rows of a normalized partition as stored: `rows` (the per-row columns), `index` (each
    row's position in `side`) and `side` (the normalized columns, one row per run, in row
    order; a run cut by a row-group boundary appears once on each side of it)."""

    rows: pa.Table
    index: np.ndarray
    side: pa.Table


def expand(rows: pa.Table, index: np.ndarray, side: pa.Table, order: list[str], meta) -> pa.Table:
    """The full rows: each row's normalized columns taken from its side row, in `order`."""
    if side.num_columns:
        taken = side.take(pa.array(index, pa.int32()))
        cols = {
            **{n: rows[n] for n in rows.column_names},
            **{n: taken[n] for n in side.column_names},
        }
    else:
        cols = {n: rows[n] for n in rows.column_names}
    names = [n for n in order if n in cols]
    fields = [
        rows.schema.field(n) if n in rows.column_names else side.schema.field(n) for n in names
    ]
    return pa.Table.from_arrays([cols[n] for n in names], schema=pa.schema(fields, metadata=meta))


def stored_files(manifest: dict) -> list[str]:
    """Every file a manifest names: the data files and, normalized, their side files."""
    sides = (manifest.get("normalized") or {}).get("sides", {})
    return [*manifest["files"], *(sides[n] for n in manifest["files"] if n in sides)]


class StoredFile:
    """One data file of a partition, with its side file where the partition is normalized."""

    def __init__(self, fs: pafs.FileSystem, base: str, name: str, normalized: dict | None):
        self.fs, self.path = fs, f"{base}/{name}"
        self.norm = normalized if normalized and name in normalized.get("sides", {}) else None
        self.side_path = f"{base}/{self.norm['sides'][name]}" if self.norm else None
        self._pf: pq.ParquetFile | None = None
        self._side: pq.ParquetFile | None = None

    def pf(self) -> pq.ParquetFile:
        if self._pf is None:
            self._pf = open_parquet(self.fs, self.path)
        return self._pf

    def side(self) -> pq.ParquetFile:
        if self._side is None:
            self._side = open_parquet(self.fs, self.side_path)
        return self._side

    def schema(self) -> pa.Schema:
        main = self.pf().schema_arrow
        if not self.norm:
            return main
        side = self.side().schema_arrow
        fields = [main.field(n) if n in main.names else side.field(n) for n in self.norm["order"]]
        return pa.schema(fields, metadata=main.metadata)

    def row_group_sizes(self) -> list[int]:
        meta = self.pf().metadata
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]

    def read(self, columns: list[str] | None) -> pa.Table:
        if not self.norm:
            return self.pf().read(columns=columns)
        parts = [self.read_row_group(rg, columns) for rg in range(self.pf().num_row_groups)]
        return pa.concat_tables(parts) if parts else self.schema().empty_table()

    def read_row_group(
        self, rg: int, columns: list[str] | None, lo: int = 0, hi: int | None = None
    ) -> pa.Table:
        """Rows [lo, hi) of row group `rg`, whole (normalized: only those rows expanded)."""
        if not self.norm:
            t = self.pf().read_row_group(rg, columns=columns)
            return t.slice(lo, (t.num_rows if hi is None else hi) - lo)
        rows, index, side = self.read_row_group_normalized(rg, columns)
        hi = rows.num_rows if hi is None else hi
        order = columns if columns is not None else self.norm["order"]
        meta = self.pf().schema_arrow.metadata
        return expand(rows.slice(lo, hi - lo), index[lo:hi], side, order, meta)

    def read_row_group_normalized(
        self, rg: int, columns: list[str] | None
    ) -> tuple[pa.Table, np.ndarray, pa.Table]:
        if not self.norm:
            rows = self.pf().read_row_group(rg, columns=columns)
            return rows, np.arange(rows.num_rows), pa.table({})  # every row its own run
        wanted = self.norm["order"] if columns is None else columns
        side_cols = [c for c in wanted if c in self.norm["columns"]]
        row_cols = [c for c in wanted if c not in self.norm["columns"]]
        key = self.norm["index"]
        rows = self.pf().read_row_group(rg, columns=[*row_cols, key])
        index = np.asarray(rows[key], np.int64)
        side = self.side().read_row_group(rg, columns=side_cols) if side_cols else pa.table({})
        if index.size and (index.min() < 0 or index.max() >= side.num_rows > 0):
            raise PartitionDamaged(
                f"{self.path}: row group {rg} points past its side file's "
                f"{side.num_rows} rows: rerun the stage that writes it"
            )
        return rows.drop_columns([key]), index, side
