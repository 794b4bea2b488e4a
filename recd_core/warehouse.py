"""The warehouse: Hive-style partitions of Parquet tables on any `pyarrow.fs` filesystem.

    <root>/<table>/[<key>=<value>/]ds=YYYY-MM-DD/part-00000.parquet
                                                 part-00001.parquet
                                                 _manifest.json      files, rows, bytes, write id,
                                                                     each file's size (and CRC-32
                                                                     where the format has none)
    <root>/<table>/_staging/…   partitions being written (ignored by Hive discovery: '_' prefix)
    <root>/<table>/_trash/…     the previous version during a swap
    <root>/<table>/_locks/…     one lock file per partition (local warehouses)
    <root>/<table>/_pins/…      one version of a partition held for a reader (`pinned`)

A partition may be stored **normalized**: columns that repeat over runs of rows (a session's
user-side features) are kept once per run in a side file beside each data file, and the data
file points into it. Readers get the full rows back (`read`, `read_range`, `read_schema`); a
reader that can work on the runs themselves (DPP's dedup) asks for them as stored
(`read_range_normalized`) and never decodes a repeated value:

    part-00000-<id>.parquet        row group k: the per-row columns + `<index>` (int32)
    _side-part-00000-<id>.parquet  row group k: the normalized columns, one row per run of
                                   the data file's row group k; `<index>` is a row of it
    _manifest.json                 "normalized": {"columns", "index", "order", "sides"}

A write goes to a fresh staging directory (files named `part-NNNNN-<write id>.parquet`),
then is committed:

  local / HDFS   the live partition is renamed to the trash, the staging directory renamed
                 into place, the trash deleted. Renames are atomic; a crash between the two
                 is repaired by `recover`, which every read and write of the partition runs.
  object stores  (no directory rename) the new files are copied server-side into the live
                 partition, then `_manifest.json` is put: one atomic PUT, the commit point;
                 then the files the manifest no longer lists are deleted.

Readers go through the manifest, so either protocol shows the old version or the new one,
never a mix. They trust nothing else in it: every name must be a plain file name inside the
partition, every file must be there at the size the manifest records, Parquet pages are read
with their CRC-32 verified, and files of formats without checksums (the Arrow IPC batches)
carry a CRC-32 in the manifest (`verify`). A file that fails any of these is a
`PartitionDamaged` error naming the partition and the file, never a traceback or garbage.
A failure or crash before the commit leaves the live partition as it was; its
leftovers are removed by the next write. Re-writing a partition replaces it: no duplicates,
whatever the number of runs.

A stage that reads a partition in pieces (DPP's splits, generate's spill tasks, in other
processes too) reads one version of it for its whole run: `pinned` reads the manifest once
and, on a local warehouse, hard-links the files it lists into `_pins/<partition>-<id>/`
(held by the reader's `_reader.lock`), so a rewrite committed meanwhile neither mixes into
the read nor deletes what it reads; every read of the partition through that `Warehouse`
(and through `adopt`, in a worker process) goes to the pin. A dead reader's pin is removed
by the next write. On object stores the pinned manifest's files stay through the next
commit (it deletes only the files of the version before the one it replaces).

Concurrent writers of one partition (an operator re-running a day while the scheduler does)
both end cleanly on a local warehouse: each writes its own staging directory, and the short
steps that touch shared state (removing dead writers' staging, recovery, the swap) run under
an advisory `flock` on the partition's lock file, so the last committer wins. A staging
directory is a dead writer's when its `_writer.lock` is not held: the kernel drops the lock
of a killed process, so a live writer's staging is never taken for a crash's leftovers.
Object stores and HDFS have no such lock: there the orchestrator runs one writer per day
(the daily DAG's `max_active_runs=1`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from zlib_ng import zlib_ng as zlib

from recd_core.errors import BadInput, RecdError, first_line, network_failure, unreachable
from recd_core.leftovers import held, hold

MANIFEST = "_manifest.json"
WRITER_LOCK = "_writer.lock"  # inside a staging directory, held (flock) by its live writer
READER_LOCK = "_reader.lock"
READ_ONLY = (
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
)  # a warehouse the user must fix  # inside a pin directory, held (flock) by its live reader


class PartitionNotFound(BadInput, FileNotFoundError):
    """A partition a stage reads does not exist (yet): run the stage that writes it."""


class PartitionDamaged(BadInput):
    """A committed partition whose manifest or files cannot be trusted (damaged, truncated,
    missing, or a name that leads outside it): named, never read. Rerun the stage that
    writes it; a retry of the reader cannot help."""


_PLAIN_NAME = re.compile(r"[^/\\\x00]+")


def _plain(name) -> bool:
    """Whether a manifest entry is a plain file name inside its partition."""
    return (isinstance(name, str) and bool(_PLAIN_NAME.fullmatch(name))
            and name not in (".", "..", MANIFEST))  # fmt: skip


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
class PartitionInfo:
    path: str
    files: list[str]
    rows: int
    bytes: int


@dataclass(frozen=True)
class Normalized:
    """Rows of a normalized partition as stored: `rows` (the per-row columns), `index` (each
    row's position in `side`) and `side` (the normalized columns, one row per run, in row
    order; a run cut by a row-group boundary appears once on each side of it)."""

    rows: pa.Table
    index: np.ndarray
    side: pa.Table


def _expand(rows: pa.Table, index: np.ndarray, side: pa.Table, order: list[str], meta) -> pa.Table:
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


def validate_ds(ds: str) -> str:
    """A partition date, canonical only: `fromisoformat` alone also takes `20261101` and
    `2026-W45-1`, which would name the same day's partition differently."""
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", ds):
            raise ValueError
        dt.date.fromisoformat(ds)
    except ValueError:
        raise ValueError(f"--ds must be a date YYYY-MM-DD, got {ds!r}") from None
    return ds


class Warehouse:
    """A warehouse root: a local directory or a filesystem URI (`s3://bucket/prefix`, …)."""

    def __init__(self, uri: str | Path):
        uri = str(uri)
        if "://" not in uri:
            uri = str(Path(uri).resolve())
        self.uri = uri
        self.fs, self.root = pafs.FileSystem.from_uri(uri)
        self.root = self.root.rstrip("/")
        self.renames_atomically = self.fs.type_name in ("local", "hdfs")
        self.locks = self.fs.type_name == "local"  # flock works on local files only
        # partitions read at one version (`pinned`, `adopt`): name -> (directory, manifest)
        self._pins: dict[str, tuple[str, dict]] = {}
        try:
            self.fs.create_dir(self.root, recursive=True)
        except OSError as e:  # a file in the way, no permission: the user's to fix
            if network_failure(e):  # no answer (after Arrow's own retries): a retry's to fix
                raise unreachable(e, f"warehouse {uri}") from None
            raise BadInput(f"warehouse {uri} cannot be used as a directory: {_reason(e)}") from None

    # -- paths ------------------------------------------------------------------------------
    def _rel(self, table: str, ds: str, keys: dict[str, str]) -> str:
        parts = [table, *(f"{k}={v}" for k, v in keys.items()), f"ds={validate_ds(ds)}"]
        return "/".join(parts)

    def partition_path(self, table: str, ds: str, **keys: str) -> str:
        return f"{self.root}/{self._rel(table, ds, keys)}"

    def partition_name(self, table: str, ds: str, **keys: str) -> str:
        """A partition's path within the warehouse (`samples/layout=clustered/ds=D`)."""
        return self._rel(table, ds, keys)

    def _side_dir(self, table: str, kind: str, ds: str, keys: dict[str, str]) -> str:
        flat = "__".join([*(f"{k}={v}" for k, v in keys.items()), f"ds={ds}"])
        return f"{self.root}/{table}/{kind}/{flat}"

    def _is_dir(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.Directory

    def exists_file(self, path: str) -> bool:
        """Whether `path` (on this warehouse's filesystem) is a file."""
        return self.fs.get_file_info(path).type == pafs.FileType.File

    def _children(self, path: str) -> list[pafs.FileInfo]:
        if not self._is_dir(path):
            return []
        return self.fs.get_file_info(pafs.FileSelector(path, recursive=False))

    # -- recovery ---------------------------------------------------------------------------
    def recover(self, table: str, ds: str, **keys: str) -> bool:
        """Restore a partition whose swap was interrupted; True if something was restored."""
        with self._partition_lock(table, ds, keys):
            return self._recover(table, ds, keys)

    def _recover(self, table: str, ds: str, keys: dict[str, str]) -> bool:
        live = self.partition_path(table, ds, **keys)
        prefix = self._side_dir(table, "_trash", ds, keys)
        trash = sorted(
            (
                i
                for i in self._children(f"{self.root}/{table}/_trash")
                if i.path.startswith(prefix + "-")
            ),
            key=lambda i: i.mtime_ns or 0,
        )
        if self._is_dir(live) or not trash:
            for t in trash:
                self.fs.delete_dir(t.path)
            return False
        self.fs.move(trash[-1].path, live)
        for t in trash[:-1]:
            self.fs.delete_dir(t.path)
        return True

    # -- writing ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self, table: str, ds: str, **keys: str) -> Iterator[PartitionWriter]:
        """Write a partition atomically: `with wh.writing("events", ds) as w: w.write(t)`."""
        prefix = self._side_dir(table, "_staging", ds, keys)
        write_id = uuid.uuid4().hex[:12]
        staging = f"{prefix}-{write_id}"
        try:
            with self._partition_lock(table, ds, keys):
                self._recover(table, ds, keys)
                for old in self._children(f"{self.root}/{table}/_staging"):
                    if old.path.startswith(prefix + "-") and not self._writer_alive(old.path):
                        self.fs.delete_dir(old.path)
                self._sweep_pins(table, ds, keys)
                self.fs.create_dir(staging, recursive=True)
                owner = self._hold_writer_lock(staging)
        except OSError as e:  # a read-only warehouse: the user's to fix, not retried
            if not isinstance(e, PermissionError) and e.errno not in READ_ONLY:
                raise
            raise BadInput(f"warehouse {self.uri} cannot be written: {_reason(e)}") from None
        writer = PartitionWriter(self.fs, staging, write_id)
        try:
            try:
                yield writer
                writer.close()
            except BaseException:
                writer.abort()
                with contextlib.suppress(OSError):
                    self.fs.delete_dir(staging)
                raise
            files, rows, nbytes = writer.totals()
            with self._partition_lock(table, ds, keys):
                self._release_writer_lock(staging, owner)
                owner = None
                self._recover(table, ds, keys)
                self._swap(staging, table, ds, keys, write_id)
        finally:
            if owner is not None:
                os.close(owner)
        writer.info = PartitionInfo(self.partition_path(table, ds, **keys), files, rows, nbytes)

    # -- locks (local warehouses) -----------------------------------------------------------
    @contextlib.contextmanager
    def _partition_lock(
        self, table: str, ds: str, keys: dict[str, str], shared: bool = False
    ) -> Iterator[None]:
        """Hold the partition's lock file (`flock`, blocking) for the steps that touch shared
        state; `shared` for readers. None on filesystems without one, or where the lock cannot
        be created: a read-only warehouse has no writer to race with."""
        if not self.locks:
            yield
            return
        path = f"{self._side_dir(table, '_locks', ds, keys)}.lock"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _hold_writer_lock(self, staging: str) -> int | None:
        """Mark a staging directory as a live writer's: its lock file, held until commit."""
        return hold(f"{staging}/{WRITER_LOCK}") if self.locks else None

    def _release_writer_lock(self, staging: str, fd: int | None) -> None:
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{staging}/{WRITER_LOCK}")  # not part of the partition
        os.close(fd)

    def _writer_alive(self, staging: str) -> bool:
        """Whether another writer still holds this staging directory (local: its lock)."""
        # no lock to ask: the orchestrator runs one writer per day; no lock file: a writer
        # that died before taking it
        return self.locks and held(f"{staging}/{WRITER_LOCK}")

    def _swap(self, staging: str, table: str, ds: str, keys: dict[str, str], write_id: str) -> None:
        live = self.partition_path(table, ds, **keys)
        if not self.renames_atomically:
            self._commit_by_manifest(staging, live)
            return
        self.fs.create_dir(live.rsplit("/", 1)[0], recursive=True)
        trash = None
        if self._is_dir(live):
            trash = f"{self._side_dir(table, '_trash', ds, keys)}-{write_id}"
            self.fs.create_dir(trash.rsplit("/", 1)[0], recursive=True)
            self.fs.move(live, trash)
        self.fs.move(staging, live)
        if trash:
            self.fs.delete_dir(trash)

    def _commit_by_manifest(self, staging: str, live: str) -> None:
        with self.fs.open_input_stream(f"{staging}/{MANIFEST}") as f:
            files = _stored_files(json.loads(f.read()))
        replaced: list[str] = []  # the version a pinned reader may still be reading
        with (
            contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError),
            self.fs.open_input_stream(f"{live}/{MANIFEST}") as f,
        ):
            replaced = _stored_files(json.loads(f.read()))
        for name in files:
            self.fs.copy_file(f"{staging}/{name}", f"{live}/{name}")
        self.fs.copy_file(f"{staging}/{MANIFEST}", f"{live}/{MANIFEST}")  # the commit point
        keep = {*files, *replaced, MANIFEST}
        for old in self._children(live):
            if old.base_name not in keep:
                self.fs.delete_file(old.path)
        self.fs.delete_dir(staging)

    # -- pins: one version for a whole read -------------------------------------------------
    @contextlib.contextmanager
    def pinned(self, table: str, ds: str, **keys: str) -> Iterator[dict]:
        """Read one version of the partition inside the block, however the reading is split
        (module doc); yields its manifest. Nested pins of the same partition share one."""
        name = self._rel(table, ds, keys)
        if name in self._pins:
            yield self._pins[name][1]
            return
        self.recover(table, ds, **keys)
        pin, fd = None, None
        with self._partition_lock(table, ds, keys, shared=True):
            m = self._manifest(table, ds, keys)
            base = self.partition_path(table, ds, **keys)
            if self.locks:
                pin = f"{self._side_dir(table, '_pins', ds, keys)}-{uuid.uuid4().hex[:12]}"
                try:
                    os.makedirs(pin)
                    fd = hold(f"{pin}/{READER_LOCK}")
                    for n in (*_stored_files(m), MANIFEST):
                        os.link(f"{base}/{n}", f"{pin}/{n}")
                    base = pin
                except OSError:  # a read-only warehouse: no writer to pin against
                    fd = self._unpin(pin, fd)
                    pin = None
        self._pins[name] = (base, m)
        try:
            yield m
        finally:
            del self._pins[name]
            self._unpin(pin, fd)

    @staticmethod
    def _unpin(pin: str | None, fd: int | None) -> None:
        if fd is not None:
            os.close(fd)
        if pin is not None:
            shutil.rmtree(pin, ignore_errors=True)

    def pin_token(self, table: str, ds: str, **keys: str) -> tuple[str, str, dict]:
        """A pinned partition as a worker process adopts it (`adopt`)."""
        name = self._rel(table, ds, keys)
        return (name, *self._pins[name])

    def adopt(self, token: tuple[str, str, dict] | None) -> Warehouse:
        """Read a partition pinned by another process (its `pin_token`) at that version."""
        if token is not None:
            self._pins[token[0]] = (token[1], token[2])
        return self

    def _sweep_pins(self, table: str, ds: str, keys: dict[str, str]) -> None:
        """Remove pins of this partition whose reader died (its lock no longer held)."""
        prefix = self._side_dir(table, "_pins", ds, keys)
        for old in self._children(f"{self.root}/{table}/_pins"):
            if old.path.startswith(prefix + "-") and not held(f"{old.path}/{READER_LOCK}"):
                shutil.rmtree(old.path, ignore_errors=True)

    def _base(self, table: str, ds: str, keys: dict[str, str]) -> str:
        """Where the partition's files are read from: its pin, else the live partition."""
        pin = self._pins.get(self._rel(table, ds, keys))
        return pin[0] if pin else self.partition_path(table, ds, **keys)

    # -- reading ----------------------------------------------------------------------------
    def exists(self, table: str, ds: str, **keys: str) -> bool:
        """A partition exists once committed: its manifest is there."""
        if self._rel(table, ds, keys) in self._pins:
            return True
        self.recover(table, ds, **keys)
        manifest = f"{self.partition_path(table, ds, **keys)}/{MANIFEST}"
        return self.fs.get_file_info(manifest).type == pafs.FileType.File

    def manifest(self, table: str, ds: str, **keys: str) -> dict:
        pin = self._pins.get(self._rel(table, ds, keys))
        if pin:
            return pin[1]
        self.recover(table, ds, **keys)
        return self._manifest(table, ds, keys)

    def _manifest(self, table: str, ds: str, keys: dict[str, str]) -> dict:
        """The partition's manifest, checked: readable JSON naming at least one file, every
        name plain (inside the partition), every file present at its recorded size."""
        base = self.partition_path(table, ds, **keys)
        path = f"{base}/{MANIFEST}"
        try:
            with self.fs.open_input_stream(path) as f:
                m = json.loads(f.read())
        except FileNotFoundError:
            raise PartitionNotFound(
                f"no partition {self._rel(table, ds, keys)} in warehouse {self.uri}"
            ) from None
        except (ValueError, OSError) as e:
            raise PartitionDamaged(
                f"{path} is damaged ({e}): rerun the stage that writes it"
            ) from None
        if not (isinstance(m, dict) and isinstance(m.get("files"), list) and m["files"]):
            raise PartitionDamaged(f"{path} lists no files: rerun the stage that writes it")
        try:
            names = _stored_files(m)
        except (AttributeError, KeyError, TypeError):
            names = [None]
        foreign = next((n for n in names if not _plain(n)), "")
        if foreign != "":
            raise PartitionDamaged(f"{path} names {foreign!r}, not a file of the partition: "
                                   "nothing is read outside it")  # fmt: skip
        self._check_files(base, names, m.get("file_bytes") or {})
        return m

    def _check_files(self, base: str, names: list[str], sizes: dict) -> None:
        """Every file the manifest names is there, at the size it records (one listing)."""
        present = {i.base_name: i.size for i in self._children(base)}
        for name in names:
            if name not in present:
                raise PartitionDamaged(f"{base}/{name} is missing (listed in {MANIFEST}): "
                                       "rerun the stage that writes it")  # fmt: skip
            if name in sizes and present[name] != sizes[name]:
                raise PartitionDamaged(
                    f"{base}/{name} is damaged ({present[name]} bytes, written as "
                    f"{sizes[name]}): rerun the stage that writes it"
                )

    def verify(self, path: str, manifest: dict) -> None:
        """A file's bytes against the CRC-32 its manifest records (formats without page
        checksums: the Arrow IPC batches); nothing to check where none is recorded."""
        want = (manifest.get("file_crc32") or {}).get(path.rsplit("/", 1)[-1])
        if want is None:
            return
        with damage_named(path):
            got = file_crc32(self.fs, path)
        if got != want:
            raise PartitionDamaged(f"{path} is damaged (CRC-32 {got:08x}, written as "
                                   f"{want:08x}): rerun the stage that writes it")  # fmt: skip

    def files(self, table: str, ds: str, **keys: str) -> list[str]:
        m = self.manifest(table, ds, **keys)
        base = self._base(table, ds, keys)
        return [f"{base}/{name}" for name in m["files"]]

    def stored_files(self, table: str, ds: str, **keys: str) -> list[str]:
        """Every file of the partition: its data files and, normalized, their side files."""
        self.manifest(table, ds, **keys)
        base = self._base(table, ds, keys)
        return [f"{base}/{name}" for name in _stored_files(self.manifest(table, ds, **keys))]

    def info(self, table: str, ds: str, **keys: str) -> PartitionInfo:
        m = self.manifest(table, ds, **keys)
        return PartitionInfo(
            self.partition_path(table, ds, **keys), m["files"], m["rows"], m["bytes"]
        )

    def read(self, table: str, ds: str, columns: list[str] | None = None, **keys: str) -> pa.Table:
        """The partition's rows in write order (file by file, as listed in the manifest); one
        version, even while another process re-writes the partition (local warehouses).
        A normalized partition's rows come back whole."""
        pin = self._pins.get(self._rel(table, ds, keys))
        if pin:
            parts = [self._file(pin[0], name, pin[1]).read(columns) for name in pin[1]["files"]]
        else:
            self.recover(table, ds, **keys)
            base = self.partition_path(table, ds, **keys)
            with self._partition_lock(table, ds, keys, shared=True):
                m = self._manifest(table, ds, keys)
                parts = [self._file(base, name, m).read(columns) for name in m["files"]]
        if not parts:
            raise PartitionNotFound(f"partition {self._rel(table, ds, keys)} holds no files")
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]

    def _file(self, base: str, name: str, manifest: dict) -> _StoredFile:
        return _StoredFile(self.fs, base, name, manifest.get("normalized"))

    def _files(self, table: str, ds: str, keys: dict[str, str]) -> list[_StoredFile]:
        m = self.manifest(table, ds, **keys)
        base = self._base(table, ds, keys)
        return [self._file(base, name, m) for name in m["files"]]

    def read_schema(self, table: str, ds: str, **keys: str) -> pa.Schema:
        """The partition's schema (with its metadata), from its first file's footer (and its
        side file's, normalized)."""
        files = self._files(table, ds, keys)
        if not files:
            raise PartitionNotFound(f"partition {self._rel(table, ds, keys)} holds no files")
        return files[0].schema()

    def file_schemas(self, table: str, ds: str, **keys: str) -> Iterator[tuple[str, pa.Schema]]:
        """Each file's path and schema (whole rows), for checks that name the file."""
        for f in self._files(table, ds, keys):
            yield f.path, f.schema()

    def row_group_rows(self, table: str, ds: str, **keys: str) -> int | None:
        """The row-group size of a Parquet partition (its first row group), None if empty."""
        files = self._files(table, ds, keys)
        sizes = files[0].row_group_sizes() if files else []
        return sizes[0] if sizes else None

    def read_range(
        self, table: str, ds: str, lo: int, hi: int, columns: list[str] | None = None, **keys: str
    ) -> pa.Table:
        """Rows [lo, hi) of a partition, reading only the row groups that hold them."""
        return pa.concat_tables(
            [
                f.read_row_group(rg, columns, a, b)
                for f, rg, a, b in self._row_groups(table, ds, lo, hi, keys)
            ]  # fmt: skip
        )

    def read_range_normalized(
        self, table: str, ds: str, lo: int, hi: int, columns: list[str] | None = None, **keys: str
    ) -> Normalized:
        """Rows [lo, hi) as stored: the per-row columns of `columns` (all by default), each
        row's index into `side`, and the side rows of the normalized columns asked for,
        never expanded. A partition stored whole comes back with every row its own side row
        and no side columns."""
        rows, index, side, offset = [], [], [], 0
        for f, rg, a, b in self._row_groups(table, ds, lo, hi, keys):
            r, i, sd = f.read_row_group_normalized(rg, columns)
            rows.append(r.slice(a, b - a))
            index.append(i[a:b] + offset)
            side.append(sd)
            offset += int(i[-1]) + 1 if i.size else 0  # every side row starts a run
        side = [t for t in side if t.num_columns]
        return Normalized(
            pa.concat_tables(rows),
            np.concatenate(index),
            pa.concat_tables(side) if side else pa.table({}),
        )

    def normalized_columns(self, table: str, ds: str, **keys: str) -> list[str]:
        """The columns a normalized partition stores once per run ([] if stored whole)."""
        return list((self.manifest(table, ds, **keys).get("normalized") or {}).get("columns", []))

    def _row_groups(self, table: str, ds: str, lo: int, hi: int, keys: dict[str, str]):
        """(file, row group, first, end) of each row group holding rows of [lo, hi); first
        and end relative to the row group."""
        out, start = [], 0
        for f in self._files(table, ds, keys):
            for rg, n in enumerate(f.row_group_sizes()):
                if start < hi and start + n > lo:
                    out.append((f, rg, max(lo - start, 0), min(hi, start + n) - start))
                start += n
        if not out:
            raise ValueError(
                f"rows [{lo}, {hi}) are outside partition {self._rel(table, ds, keys)}"
            )
        return out

    def partition_uri(self, table: str, ds: str, **keys: str) -> str:
        """A partition as a URI (`s3://…/samples/layout=clustered/ds=D`, a local path)."""
        return f"{self.uri.rstrip('/')}/{self._rel(table, ds, keys)}"

    def keys_on(self, table: str, ds: str) -> list[dict[str, str]]:
        """The key values of every partition of `table` on day `ds` (`[{}]` for an unkeyed
        table, `[{"layout": "clustered"}, …]` for samples), in name order."""
        base = f"{self.root}/{table}"
        found = []
        for child in self._children(base):
            name = child.base_name
            if name == f"ds={ds}":
                found.append({})
            elif (
                "=" in name and not name.startswith("ds=") and self._is_dir(f"{child.path}/ds={ds}")
            ):
                key, value = name.split("=", 1)
                found.append({key: value})
        return sorted(found, key=lambda k: sorted(k.items()))

    def partitions(self, table: str, **keys: str) -> list[str]:
        """The `ds` values present for a table (and key values), sorted."""
        base = "/".join([f"{self.root}/{table}", *(f"{k}={v}" for k, v in keys.items())])
        return sorted(
            i.base_name[3:] for i in self._children(base) if i.base_name.startswith("ds=")
        )


def _stored_files(manifest: dict) -> list[str]:
    """Every file a manifest names: the data files and, normalized, their side files."""
    sides = (manifest.get("normalized") or {}).get("sides", {})
    return [*manifest["files"], *(sides[n] for n in manifest["files"] if n in sides)]


class _StoredFile:
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
        return _expand(rows.slice(lo, hi - lo), index[lo:hi], side, order, meta)

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
            raise PartitionDamaged(f"{self.path}: row group {rg} points past its side file's "
                                   f"{side.num_rows} rows: rerun the stage that writes it")  # fmt: skip
        return rows.drop_columns([key]), index, side


def _reason(e: OSError) -> str:
    """An OS error in a few words: pyarrow's "[Errno 13] Cannot create directory '…'. Detail:
    …" as "Cannot create directory '…' (permission denied)"."""
    text = str(e).split(". Detail")[0].removeprefix(f"[Errno {e.errno}] ")
    return f"{text} ({os.strerror(e.errno).lower()})" if e.errno else text


class PartitionWriter:
    """Writes Parquet files into a staging directory; the warehouse commits them."""

    def __init__(self, fs: pafs.FileSystem, staging: str, write_id: str):
        self.fs, self.staging, self.write_id = fs, staging, write_id
        self._files: list[str] = []
        self._rows: list[int] = []
        self._writer: pq.ParquetWriter | None = None
        self.info: PartitionInfo | None = None
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
        stored = _stored_files({"files": self._files, "normalized": self._normalized})
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
        crcs = {n: file_crc32(self.fs, f"{self.staging}/{n}")
                for n in sizes if not n.endswith(".parquet")}  # fmt: skip
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
