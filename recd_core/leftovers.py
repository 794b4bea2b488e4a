"""What a killed or failed process leaves behind, and how the next one clears it.

A process that dies (SIGKILL, OOM, a full disk) cannot clean up after itself, so every
temporary thing recd makes is marked as its owner's while the owner lives, and whoever comes
next removes the unmarked ones:

    <dir>/recd-generate-XXXX/          a spill directory (`owned_tempdir`)
          .owner.lock                  flock held by the live owner
    <dir>/step-00000100.pt.tmp-<id>    a file being written atomically (`write_atomically`),
                                       flock held on the file itself while it is written

The kernel drops a dead process's locks, so "nobody holds the lock" means "its owner is
gone" without guessing from ages or pids. Filesystems without flock (object stores) write
their files in one PUT and leave no temporary behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow.fs as pafs

OWNER_LOCK = ".owner.lock"
TMP_MARK = ".tmp-"


def hold(path: str | Path) -> int:
    """Take the exclusive lock of `path` (created if missing); the fd holds it until closed.
    A file it creates appears already locked (an unnamed file, locked, then linked in: Linux's
    O_TMPFILE), so another writer's sweep of the directory never finds it unlocked and takes
    it for a dead writer's (seen with three ranks writing shard files side by side)."""
    if not os.path.exists(path):
        with contextlib.suppress(OSError, AttributeError):  # no O_TMPFILE here: as below
            fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_TMPFILE | os.O_RDWR, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
            fds = os.open("/proc/self/fd", os.O_RDONLY)
            try:  # linkat(AT_SYMLINK_FOLLOW): the unnamed file itself, not /proc's link
                os.link(str(fd), path, src_dir_fd=fds, follow_symlinks=True)
                return fd
            except OSError:  # created meanwhile, or no /proc: lock the file as it is
                os.close(fd)
            finally:
                os.close(fds)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@contextlib.contextmanager
def flocked(path: str, shared: bool = False, optional: bool = False) -> Iterator[None]:
    """Hold the lock of `path` (created, with its folder, if missing; blocking) for the
    block: exclusive, or `shared`. `optional`: where the file cannot be created (a read-only
    place), the block runs unlocked: there is no writer to race with."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        if not optional:
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def held(path: str | Path) -> bool:
    """Whether a live process holds the lock of `path` (False when there is no such file)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def sweep_dirs(parent: str | Path, prefix: str) -> list[str]:
    """Remove `parent`'s directories named `prefix*` whose owner is gone; their names. A
    directory without its lock file yet is being set up (or its owner died in that instant):
    left alone for an hour."""
    gone = []
    with contextlib.suppress(OSError):
        for d in Path(parent).iterdir():
            if not (d.name.startswith(prefix) and d.is_dir() and not d.is_symlink()):
                continue
            lock = d / OWNER_LOCK
            dead = not held(lock) if lock.exists() else time.time() - d.stat().st_mtime > 3600
            if dead:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
    return gone


@contextlib.contextmanager
def owned_tempdir(prefix: str, parent: str | None = None) -> Iterator[str]:
    """A temporary directory marked as this process's, removed on exit; a killed owner's
    directories of the same prefix are removed first."""
    parent = parent or tempfile.gettempdir()
    sweep_dirs(parent, prefix)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    fd = hold(Path(path) / OWNER_LOCK)
    try:
        yield path
    finally:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


def sweep_files(fs: pafs.FileSystem, directory: str) -> list[str]:
    """Remove the temporary files (`*.tmp-*`) in `directory` whose writer is gone (local
    filesystems: nobody holds their lock); their names."""
    if fs.type_name != "local" or fs.get_file_info(directory).type != pafs.FileType.Directory:
        return []
    gone = []
    for info in fs.get_file_info(pafs.FileSelector(directory)):
        if TMP_MARK in info.base_name and not held(info.path):
            with contextlib.suppress(OSError):
                os.unlink(info.path)
                gone.append(info.base_name)
    return gone


def write_atomically(fs: pafs.FileSystem, path: str, data: bytes | Iterable[bytes]) -> None:
    """Write `path` whole or not at all: a temporary name, then a rename (atomic on local
    filesystems); `data` bytes, or blocks of them (a large file streamed). The temporary file is removed on failure (a full disk); while it is
    written it is locked, so a killed writer's is recognized and swept by the next writer
    to the directory."""
    directory = path.rsplit("/", 1)[0]
    fs.create_dir(directory, recursive=True)
    sweep_files(fs, directory)
    tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    local = fs.type_name == "local"
    fd = hold(tmp) if local else None
    try:
        with fs.open_output_stream(tmp) as f:
            for block in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
                f.write(block)
        fs.move(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.delete_file(tmp)
        raise
    finally:
        if fd is not None:
            os.close(fd)
