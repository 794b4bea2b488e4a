"""`PartitionWriter`: a partition's files written into a staging directory, with what its
manifest records (files, rows, bytes, CRC-32s, the session-normalized layout); the
warehouse commits them (warehouse.py)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from recd_core.stored_files import file_crc32, open_parquet, stored_files

MANIFEST = "_manifest.json"  # a partition's, written last: its files are then complete


@dataclass(frozen=True)
class PartitionInfo:
    """A written partition: where, its files, rows and bytes."""

    path: str
    files: list[str]
    rows: int
    bytes: int


class PartitionWriter:
    """Writes Parquet files into a staging directory; the warehouse commits them."""

    def __init__(self, fs: pafs.FileSystem, staging: str, write_id: str):
        self.fs, self.staging, self.write_id = fs, staging, write_id
        self._files: list[str] = []
        self._rows: list[int] = []
        self._writer: pq.ParquetWriter | None = None
        self.info: PartitionInfo | None = None
        self.kept: dict | None = None  # the live version's manifest, kept (warehouse.py)
        self._totals: tuple[list[str], int, int] | None = None
        self.extra: dict = {}  # more manifest fields
        self.rows: int | None = None  # the row count, for files written through add_file
        self._normalized: dict | None = None  # columns, index, order, sides (module doc)

    def path(self, name: str) -> str:
        """Where a file named `name` of this write goes (registered later with `add_file`)."""
        return f"{self.staging}/{name}"

    def add_file(self, name: str, rows: int = 0) -> str:
        """Register a file that someone else writes into the staging directory (`rows`: its
        row count, where known); its path."""
        self._close_file()
        self._files.append(name)
        self._rows.append(rows)
        return f"{self.staging}/{name}"

    def normalize(self, columns: list[str], index: str, order: list[str]) -> None:
        """Store the partition normalized (module doc): `columns` once per run in side files,
        the data files' `index` column pointing into them; `order` is the whole rows'."""
        self._normalized = {"columns": columns, "index": index, "order": order, "sides": {}}

    def add_side_file(self, name: str) -> str:
        """Register the side file of data file `name` (normalized partitions); its path."""
        assert self._normalized is not None, "normalize() first"
        side = f"_side-{name}"  # '_': not a data file to Hive-style readers
        self._normalized["sides"][name] = side
        return f"{self.staging}/{side}"

    def write(
        self, table: pa.Table, *, max_rows_per_file: int = 1 << 40, **parquet_options
    ) -> None:
        """Append rows, starting a new file every `max_rows_per_file` rows."""
        start = 0
        while start < table.num_rows:
            if self._writer is None or self._rows[-1] >= max_rows_per_file:
                self._start_file(table.schema, parquet_options)
            room = max_rows_per_file - self._rows[-1]
            chunk = table.slice(start, room)
            self._writer.write_table(chunk, row_group_size=parquet_options.get("row_group_size"))
            self._rows[-1] += chunk.num_rows
            start += chunk.num_rows
        if table.num_rows == 0 and self._writer is None:
            self._start_file(table.schema, parquet_options)
            self._writer.write_table(table)

    def end_file(self) -> str | None:
        """Close the file being written (the next `write` starts another); its name."""
        if self._writer is None:
            return None
        self._close_file()
        return self._files[-1]

    def read_file(self, name: str, columns: list[str] | None = None) -> pa.Table:
        """Read back a closed file of this write (a later check looks at its rows)."""
        return open_parquet(self.fs, f"{self.staging}/{name}").read(columns=columns)

    def rewrite(self, name: str, table: pa.Table, **parquet_options) -> None:
        """Replace a closed file of this write (rows dropped after a later check)."""
        i = self._files.index(name)
        pq.write_table(table, f"{self.staging}/{name}", filesystem=self.fs, **parquet_options)
        self._rows[i] = table.num_rows

    def _start_file(self, schema: pa.Schema, options: dict) -> None:
        self._close_file()
        name = f"part-{len(self._files):05d}-{self.write_id}.parquet"
        opts = {k: v for k, v in options.items() if k != "row_group_size"}
        self._writer = pq.ParquetWriter(
            f"{self.staging}/{name}", schema, filesystem=self.fs, **opts
        )
        self._files.append(name)
        self._rows.append(0)

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _sizes(self) -> dict[str, int]:
        stored = stored_files({"files": self._files, "normalized": self._normalized})
        return {n: int(self.fs.get_file_info(f"{self.staging}/{n}").size or 0) for n in stored}

    def totals(self) -> tuple[list[str], int, int]:
        if self._totals is not None:
            return self._totals
        rows = self.rows if self.rows is not None else sum(self._rows)
        return list(self._files), rows, sum(self._sizes().values())

    def close(self) -> None:
        self._close_file()
        files, rows, nbytes = self._totals = self.totals()
        sizes = self._sizes()
        # Parquet carries page checksums; the other formats (Arrow IPC) a CRC-32 here
        crcs = {
            n: file_crc32(self.fs, f"{self.staging}/{n}")
            for n in sizes
            if not n.endswith(".parquet")
        }
        manifest = {
            "write_id": self.write_id,
            "files": files,
            "rows": rows,
            "bytes": nbytes,
            "rows_per_file": self._rows,
            "file_bytes": sizes,
            **({"file_crc32": crcs} if crcs else {}),
            "written_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            **({"normalized": self._normalized} if self._normalized else {}),
            **self.extra,
        }
        with self.fs.open_output_stream(f"{self.staging}/{MANIFEST}") as f:
            f.write(json.dumps(manifest, indent=1).encode())

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._close_file()


def commit_by_manifest(fs: pafs.FileSystem, staging: str, live: str) -> None:
    """Commit a staged write where directories cannot be renamed (object stores): its files
    copied into the live partition, then its manifest (one PUT: the commit point), then the
    files neither it nor the version it replaces lists (a pinned reader may still read
    those) deleted."""
    with fs.open_input_stream(f"{staging}/{MANIFEST}") as f:
        files = stored_files(json.loads(f.read()))
    replaced: list[str] = []
    with (
        contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError),
        fs.open_input_stream(f"{live}/{MANIFEST}") as f,
    ):
        replaced = stored_files(json.loads(f.read()))
    for name in files:
        fs.copy_file(f"{staging}/{name}", f"{live}/{name}")
    fs.copy_file(f"{staging}/{MANIFEST}", f"{live}/{MANIFEST}")  # the commit point
    keep = {*files, *replaced, MANIFEST}
    listed = fs.get_file_info(pafs.FileSelector(live, allow_not_found=True))
    for old in listed:
        if old.base_name not in keep:
            fs.delete_file(old.path)
    fs.delete_dir(staging)
