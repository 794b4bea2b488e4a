"""A raw log file's bytes, bounded: plain, gzip or zstd (recognized by their magic bytes,
whatever the file is called), every gzip member or zstd frame of a concatenated file read,
streamed through the decompressor in bounded pieces so a decompression bomb is refused
(`FileRefused`) once it passes `ReadLimits`, before it fills memory. What the readers of
data/sources.py, data/parquet_events.py and data/movielens.py start from."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from zlib_ng import zlib_ng as zlib  # zlib's API, ~2x its gunzip speed (zlib-ng)

from recd_core.errors import BadInput, first_line


class SourceError(BadInput):
    """A source that cannot be read at all (missing, unreadable, not the expected format)."""


def path_text(path: Path | str) -> str:
    """A file name as text the quarantine (UTF-8 Parquet) can hold: bytes that are not UTF-8
    (e.g. a Latin-1 `ev\\xe9.jsonl`) escaped as `\\xe9`, so the name is kept, not refused."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


# -- bytes ------------------------------------------------------------------------------------
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


_FEED = 1 << 20  # compressed bytes handed to the decompressor at a time


_DRAIN = 16 << 20  # decompressed bytes taken out at a time


@dataclass(frozen=True)
class ReadLimits:
    """How far one source file may expand (`IngestConfig.max_file_mb`, `max_expansion_ratio`).
    A file is held whole while it is parsed, by each of `workers` threads, so these bound
    ingest's memory whatever a file holds: a gzip or zstd "bomb" (1 MB of zeros expanding to
    1 GiB) is refused once it passes either limit, not after it has filled memory. The ratio
    is judged only past `ratio_floor` bytes, so a small, very repetitive file still reads."""

    max_bytes: int = 512 << 20
    max_ratio: float = 100.0
    ratio_floor: int = 64 << 20

    def check(self, out: int, consumed: int) -> None:
        if out > self.max_bytes:
            raise FileRefused(
                f"expands past the limit of {self.max_bytes >> 20} MiB "
                "(ingest.max_file_mb): split the file or raise the limit"
            )
        if out > self.ratio_floor and out > self.max_ratio * max(consumed, 1):
            raise FileRefused(
                f"expands more than {self.max_ratio:g}x ({out >> 20} MiB from "
                f"{max(consumed, 1) >> 10} KiB; ingest.max_expansion_ratio): a decompression bomb?"
            )


class FileRefused(SourceError):
    """A source file refused as a whole (too large once expanded, a link out of the source
    directory): ingest quarantines one record for it, names it in the summary and goes on
    with the day's other files."""


def read_bytes(path: Path, limits: ReadLimits = ReadLimits()) -> tuple[bytes, str | None]:
    """The file's decompressed bytes (gzip and zstd are recognized by their magic bytes, every
    member or frame of a concatenated file read), and a problem if the stream was damaged or
    cut short (what came out before it is kept). Raises `FileRefused` past `limits`."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(4)
            if head[:2] != GZIP_MAGIC and head != ZSTD_MAGIC:
                limits.check(size, size)
                return head + f.read(), None
            data = head + f.read()
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    return _gunzip(data, limits) if head[:2] == GZIP_MAGIC else _unzstd(data, limits)


def _gunzip(data: bytes, limits: ReadLimits) -> tuple[bytes, str | None]:
    """Every member of a gzip file (`cat a.gz b.gz`, log rotation), streamed: input handed
    over a MiB at a time, output drained in bounded pieces, the limits checked as it grows."""
    out: list[bytes] = []
    total = pos = 0  # pos: bytes of `data` handed to a decompressor so far
    d = zlib.decompressobj(wbits=31)
    pending = b""  # handed over, not yet consumed

    def more(buf: bytes) -> bytes:
        nonlocal pos
        piece = data[pos : pos + _FEED]
        pos += len(piece)
        return buf + piece

    while True:
        if not pending:
            pending = more(pending)
        try:
            chunk = d.decompress(pending, _DRAIN)
        except zlib.error as e:
            return b"".join(out), f"gzip stream corrupt: {e}"
        out.append(chunk)
        total += len(chunk)
        pending = d.unused_data if d.eof else d.unconsumed_tail
        limits.check(total, pos - len(pending))
        if d.eof:  # a member ends: another may follow (padding of zeros is ignored)
            while len(pending) < 2 and pos < len(data):
                pending = more(pending)
            if not pending.strip(b"\x00") and not data[pos:].strip(b"\x00"):
                return b"".join(out), None
            if pending[:2] != GZIP_MAGIC:
                return b"".join(out), "gzip stream corrupt: bytes after the last member"
            d = zlib.decompressobj(wbits=31)
        elif not chunk and not pending and pos >= len(data):
            return b"".join(out), "gzip stream truncated (file cut short)"


def _unzstd(data: bytes, limits: ReadLimits) -> tuple[bytes, str | None]:
    """A zstd file (every frame), streamed through Arrow's codec in bounded pieces. The
    codec does not say how much input it consumed, so the ratio is judged against the
    whole file: a bomb is refused after at most `max_ratio` x its size."""
    out: list[bytes] = []
    total = 0
    try:
        with pa.CompressedInputStream(pa.BufferReader(data), "zstd") as stream:
            while chunk := stream.read(_DRAIN):
                out.append(chunk)
                total += len(chunk)
                limits.check(total, len(data))
    except (OSError, pa.ArrowException) as e:
        return b"".join(out), f"zstd stream corrupt or truncated: {first_line(e, 120)}"
    return b"".join(out), None


def open_text(path: Path, encoding: str) -> str:
    data, problem = read_bytes(path)
    if problem:
        raise SourceError(f"{path}: {problem}")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not {encoding} text at byte {e.start}") from None
