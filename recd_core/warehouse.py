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
whatever the number of runs; one built from exactly the live version's lineage (lineage.py)
keeps that version (`writer.kept`): a day run twice has one version of each partition.

A stage that reads a partition in pieces (DPP's splits, generate's spill tasks, in other
processes too) reads one version of it for its whole run: `pinned` reads the manifest once
and, on a local warehouse, hard-links the files it lists into `_pins/<partition>-<id>/`
(held by the reader's `_reader.lock`), so a rewrite committed meanwhile neither mixes into
the read nor deletes what it reads; every read of the partition through that `Warehouse`
(and through `adopt`, in a worker process) goes to the pin. A dead reader's pin is removed
by the next write. On object stores the pinned manifest's files stay through the next
commit (it deletes only the files of the version before the one it replaces).

Concurrent writers of one partition both end cleanly on a local warehouse: each stages its
own, the steps on shared state run under the partition's `flock` (the last committer wins),
and a staging directory whose `_writer.lock` nobody holds is a dead writer's. Object stores
and HDFS have no such lock: one writer per day is the orchestrator's (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from recd_core.errors import BadInput, network_failure, os_error_words, unreachable
from recd_core.leftovers import flocked, held, hold
from recd_core.partition_writer import MANIFEST, PartitionInfo, PartitionWriter, commit_by_manifest
from recd_core.stored_files import (
    Normalized,
    PartitionDamaged,
    StoredFile,
    damage_named,
    file_crc32,
    stored_files,
)

WRITER_LOCK = "_writer.lock"  # inside a staging directory, held (flock) by its live writer
READER_LOCK = "_reader.lock"
READ_ONLY = (
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
)  # a warehouse the user must fix  # inside a pin directory, held (flock) by its live reader


class PartitionNotFound(BadInput, FileNotFoundError):
    """A partition a stage reads does not exist (yet): run the stage that writes it."""


_PLAIN_NAME = re.compile(r"[^/\\\x00]+")


def _plain(name) -> bool:
    """Whether a manifest entry is a plain file name inside its partition."""
    return (
        isinstance(name, str)
        and bool(_PLAIN_NAME.fullmatch(name))
        and name not in (".", "..", MANIFEST)
    )


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
            raise BadInput(
                f"warehouse {uri} cannot be used as a directory: {os_error_words(e)}"
            ) from None

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
            raise BadInput(f"warehouse {self.uri} cannot be written: {os_error_words(e)}") from None
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
                writer.kept = self._same_version(table, ds, keys, writer.extra.get("lineage"))
                if writer.kept is None:
                    self._swap(staging, table, ds, keys, write_id)
            if writer.kept is not None:  # the live version is this one: kept, readers unmoved
                self.fs.delete_dir(staging)
                m = writer.kept
                files, rows, nbytes = m["files"], m["rows"], m["bytes"]
                writer.write_id = str(m.get("write_id"))
        finally:
            if owner is not None:
                os.close(owner)
        writer.info = PartitionInfo(self.partition_path(table, ds, **keys), files, rows, nbytes)

    def _same_version(
        self, table: str, ds: str, keys: dict[str, str], lineage: dict | None
    ) -> dict | None:
        """The live manifest when it was built from exactly what this write was (the same
        lineage: inputs' write ids, config, features, logs, code) and is whole: kept, what
        was built from it stays current. None without lineage, or when anything differs."""
        if not lineage:
            return None
        try:  # no live version: PartitionNotFound
            m = self._manifest(table, ds, keys)
            if m.get("lineage") != lineage:
                return None
            base = self.partition_path(table, ds, **keys)
            for name in stored_files(m):
                self.verify(f"{base}/{name}", m)
        except (PartitionNotFound, PartitionDamaged):
            return None  # rewritten: the new version replaces a damaged one
        return m

    # -- locks (local warehouses) -----------------------------------------------------------
    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[None]:
        """One holder at a time of `name` among the processes using this warehouse
        (`<root>/_locks/<name>.lock`, blocking), e.g. registering a day's model; nothing
        where the warehouse has no locks (object stores: the orchestrator runs one) or is
        read-only (no writer to wait for)."""
        if not self.locks:
            yield
            return
        with flocked(f"{self.root}/_locks/{name}.lock", optional=True):
            yield

    @contextlib.contextmanager
    def _partition_lock(
        self, table: str, ds: str, keys: dict[str, str], shared: bool = False
    ) -> Iterator[None]:
        """Hold the partition's lock file (`flock`, blocking) for the steps that touch shared
        state; `shared` for readers. None on filesystems without one, or where the lock cannot
        be created: a read-only warehouse has no writer to race with."""
        path = f"{self._side_dir(table, '_locks', ds, keys)}.lock"
        with flocked(path, shared, optional=True) if self.locks else contextlib.nullcontext():
            yield

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
            commit_by_manifest(self.fs, staging, live)
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
                    for n in (*stored_files(m), MANIFEST):
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
            names = stored_files(m)
        except (AttributeError, KeyError, TypeError):
            names = [None]
        foreign = next((n for n in names if not _plain(n)), "")
        if foreign != "":
            raise PartitionDamaged(
                f"{path} names {foreign!r}, not a file of the partition: nothing is read outside it"
            )
        self._check_files(base, names, m.get("file_bytes") or {})
        return m

    def _check_files(self, base: str, names: list[str], sizes: dict) -> None:
        """Every file the manifest names is there, at the size it records (one listing)."""
        present = {i.base_name: i.size for i in self._children(base)}
        for name in names:
            if name not in present:
                raise PartitionDamaged(
                    f"{base}/{name} is missing (listed in {MANIFEST}): "
                    "rerun the stage that writes it"
                )
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
            raise PartitionDamaged(
                f"{path} is damaged (CRC-32 {got:08x}, written as "
                f"{want:08x}): rerun the stage that writes it"
            )

    def files(self, table: str, ds: str, **keys: str) -> list[str]:
        m = self.manifest(table, ds, **keys)
        base = self._base(table, ds, keys)
        return [f"{base}/{name}" for name in m["files"]]

    def stored_files(self, table: str, ds: str, **keys: str) -> list[str]:
        """Every file of the partition: its data files and, normalized, their side files."""
        self.manifest(table, ds, **keys)
        base = self._base(table, ds, keys)
        return [f"{base}/{name}" for name in stored_files(self.manifest(table, ds, **keys))]

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

    def _file(self, base: str, name: str, manifest: dict) -> StoredFile:
        return StoredFile(self.fs, base, name, manifest.get("normalized"))

    def _files(self, table: str, ds: str, keys: dict[str, str]) -> list[StoredFile]:
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
            ]
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
