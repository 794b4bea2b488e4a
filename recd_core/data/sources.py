"""Readers for raw event files: JSON lines (plain or gzipped) and Parquet.

Readers only parse. They return the rows they could type, each tagged with its source file
and line, and a `Rejects` of everything they could not read, with the reason. Semantic
checks (ranges, lengths, finiteness) are `ingest`'s job and run on whole columns.

JSON lines are parsed by Arrow in large chunks. A chunk that fails is split in halves until
the bad line is isolated, so clean files pay one vectorized parse and a damaged one pays
about log2(chunk) extra parses per bad line. Two Arrow quirks are guarded against: a line
that is not a JSON object (a bare `null` crashes pyarrow 25's reader) is rejected before
Arrow sees it, and a line holding two objects (`{..}{..}`, which Arrow reads as two rows)
is caught by counting rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq
from zlib_ng import zlib_ng as zlib  # zlib's API, ~2x its gunzip speed (zlib-ng)

from recd_core.data.shared_parse import byte_positions, parse_shared
from recd_core.errors import BadInput, first_line

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string()),
        pa.field("line", pa.int64()),  # 1-based line (text files) or row (Parquet)
        pa.field("field", pa.string()),  # the offending field, where one is to blame
        pa.field("reason", pa.string()),
        pa.field("raw", pa.binary()),  # the rejected line's exact bytes / the row as JSON
    ]
)
CHUNK_LINES = 16384


class SourceError(BadInput):
    """A source that cannot be read at all (missing, unreadable, not the expected format)."""


def path_text(path: Path | str) -> str:
    """A file name as text the quarantine (UTF-8 Parquet) can hold: bytes that are not UTF-8
    (e.g. a Latin-1 `ev\\xe9.jsonl`) escaped as `\\xe9`, so the name is kept, not refused."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


@dataclass
class Rejects:
    """Rejected rows accumulated column by column (cheap to append arrays to)."""

    parts: list[pa.Table] = field(default_factory=list)

    def add(self, source: str, lines, fields, reasons, raws) -> None:
        n = len(lines)
        if n == 0:
            return
        cols = [
            pa.array([source] * n, pa.string()) if isinstance(source, str) else source,
            pa.array(lines, pa.int64()),
            fields
            if isinstance(fields, pa.Array | pa.ChunkedArray)
            else pa.array(fields, pa.string()),
            reasons
            if isinstance(reasons, pa.Array | pa.ChunkedArray)
            else pa.array(reasons, pa.string()),
            raws if isinstance(raws, pa.Array | pa.ChunkedArray) else pa.array(raws, pa.binary()),
        ]
        self.parts.append(pa.Table.from_arrays(cols, schema=QUARANTINE_SCHEMA))

    def extend(self, other: Rejects) -> None:
        self.parts.extend(other.parts)

    def table(self) -> pa.Table:
        if not self.parts:
            return QUARANTINE_SCHEMA.empty_table()
        return pa.concat_tables(self.parts).combine_chunks()

    def __len__(self) -> int:
        return sum(p.num_rows for p in self.parts)


@dataclass(frozen=True)
class Origin:
    """Where the lines of one parsed text came from when it is several small files read as
    one (ingest's parse unit): file k's lines begin at line `starts[k]` of the text.

        text   line 1  2  3 | 4 | 5  6      (1-based, as Parsed.lines counts)
        files  a.jsonl      | b | c.jsonl    starts = [0, 3, 4]
    """

    names: tuple[str, ...]
    starts: np.ndarray  # int64, 0-based line of the text where each file begins

    def locate(self, lines: np.ndarray) -> tuple[pa.Array, np.ndarray]:
        """Text line numbers (1-based) as each line's file and its line there (1-based)."""
        lines = np.asarray(lines, np.int64)
        k = np.searchsorted(self.starts, lines - 1, side="right") - 1
        return pa.array(np.asarray(self.names, object)[k], pa.string()), lines - self.starts[k]


@dataclass
class Parsed:
    """Rows a reader could type: `table` plus, per row, where it came from.

    `raw` maps 1-based line numbers to the lines' original bytes (only rejected rows are
    ever looked up); None for columnar sources, whose rows are quarantined as JSON.
    `origin`: the files behind the lines when the text is several small files
    (`read_json_files`); then `source` names the first and how many more.
    """

    table: pa.Table
    source: str
    lines: np.ndarray  # int64, 1-based, one per table row
    raw: Callable[[np.ndarray], pa.Array] | None
    shared_lines: int = 0  # lines whose shared columns were parsed once per distinct text
    out_of_day: int = 0  # rows stamped off the partition's day (ingest's day check)
    refused: str | None = None  # why the whole file was refused (then no rows)
    origin: Origin | None = None

    def where(self, lines: np.ndarray) -> tuple[str | pa.Array, np.ndarray]:
        """Lines of this text as (file name or names, line numbers in those files)."""
        return (self.source, lines) if self.origin is None else self.origin.locate(lines)

    def subset(self, keep: np.ndarray) -> Parsed:
        return dataclasses.replace(
            self, table=self.table.take(pa.array(keep)), lines=self.lines[keep]
        )

    def raw_rows(self, rows: np.ndarray) -> pa.Array:
        """The original bytes of table rows `rows`."""
        if self.raw is not None:
            return self.raw(self.lines[rows])
        return rows_as_json(self.table, rows)


@dataclass(frozen=True)
class Lines:
    """The lines of a decompressed buffer, located by numpy (no per-line Python objects)."""

    data: bytes
    starts: np.ndarray
    ends: np.ndarray  # exclusive, without the '\n' (and a trailing '\r')

    @classmethod
    def of(cls, data: bytes) -> Lines:
        buf = np.frombuffer(data, np.uint8)
        nl = byte_positions(buf, 10)  # no temporary the size of the file (~0.3 s of 138 MB)
        ends = nl if (len(data) == 0 or data.endswith(b"\n")) else np.append(nl, len(data))
        starts = np.concatenate([[0], nl + 1])[: ends.size]
        cr = (
            (ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13)
            if ends.size
            else ends.astype(bool)
        )
        return cls(data, starts, ends - cr)

    def __len__(self) -> int:
        return int(self.starts.size)

    def get(self, i: int) -> bytes:
        return self.data[self.starts[i] : self.ends[i]]

    def take(self, idx: np.ndarray) -> pa.Array:
        return pa.array([self.get(int(i)) for i in idx], pa.binary())

    def run(self, idx: np.ndarray, clean: np.ndarray) -> slice | None:
        """The lines `idx` as a slice of all lines where they are consecutive clean lines
        (one stretch of the buffer); None otherwise."""
        a, b = int(idx[0]), int(idx[-1])
        return slice(a, b + 1) if b - a + 1 == idx.size and clean[a : b + 1].all() else None

    def blob(self, idx: np.ndarray, clean: np.ndarray):
        """The lines `idx` as one newline-separated buffer: a zero-copy slice when they are
        consecutive clean lines, a join otherwise (only around damaged lines)."""
        run = self.run(idx, clean)
        if run is not None:
            return pa.py_buffer(memoryview(self.data)[self.starts[run][0] : self.ends[run][-1]])
        return b"\n".join(self.get(int(i)) for i in idx)


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


SNIFF_BYTES = 64 << 10  # the head of a file (decompressed) that decides how it is read


JSON_NAME = re.compile(r"\.(jsonl|json|ndjson)(\.(gz|zst))?(\.\d+)?$", re.IGNORECASE)


def sniff(path: Path) -> tuple[str | None, str]:
    """How a source file is read, from its content first (`EVENTS.JSONL.GZ`, a rotated
    `events.jsonl.gz.1`, a `.log` of JSON lines are all read): ("parquet", "") for a file
    that starts with `PAR1`; ("jsonl", "") for a gzip or zstd stream (their magic bytes: the
    reader quarantines whatever is not a JSON line, and its limits refuse a bomb) and for
    text whose first 64 KiB hold a JSON object line, or nothing; else by its name
    (`*.parquet`, `*.jsonl|json|ndjson[.gz|.zst][.N]`, any case), whose reader then says
    what is wrong; (None, why) for anything else, which ingest refuses and names."""
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    if head[:4] == b"PAR1":
        return "parquet", ""
    if head[:2] == GZIP_MAGIC or head[:4] == ZSTD_MAGIC:
        return "jsonl", ""
    text = head.removeprefix(b"\xef\xbb\xbf")
    if not text.strip() or any(x.lstrip().startswith(b"{") for x in text.split(b"\n")[:64]):
        return "jsonl", ""
    if path.name.lower().endswith(".parquet"):
        return "parquet", ""
    if JSON_NAME.search(path.name):
        return "jsonl", ""
    return None, (
        f"not a recognized format (neither JSON lines, gzip, zstd nor Parquet: "
        f"starts with {text[:16]!r})"
    )


def _bad_utf8_lines(lines: Lines) -> np.ndarray:
    """0-based indices of lines that are not valid UTF-8 (a loop over bad spots only)."""
    data = lines.data
    try:
        data.decode("utf-8")
        return np.zeros(0, np.int64)
    except UnicodeDecodeError:
        pass
    bad, pos = [], 0
    while pos < len(data):
        try:
            data[pos:].decode("utf-8")
            break
        except UnicodeDecodeError as e:
            i = int(np.searchsorted(lines.starts, pos + e.start, side="right")) - 1
            bad.append(i)
            pos = int(lines.ends[i]) + 1
    return np.array(sorted(set(bad)), np.int64)


# -- JSON lines -------------------------------------------------------------------------------
def _text_bytes(path: Path, limits: ReadLimits = ReadLimits()) -> tuple[bytes, str | None]:
    data, problem = read_bytes(path, limits)
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM (Windows tools): accepted, as blanks
        data = b"   " + data[3:]
    return data, problem


def raw_lines(path: Path, limits: ReadLimits, line_numbers: np.ndarray) -> pa.Array:
    """Lines of a JSON-lines file by 1-based number, as its reader saw them, read again:
    ingest keeps no file's bytes past its parse; rows rejected later are looked up here."""
    return Lines.of(_text_bytes(path, limits)[0]).take(np.asarray(line_numbers, np.int64) - 1)


def read_json_lines(
    path: Path, schema: pa.Schema, shared: list[str] | tuple = (), limits: ReadLimits = ReadLimits()
) -> tuple[Parsed, Rejects]:
    """Parse a JSON-lines file (plain, gzip or zstd) into `schema`'s columns. `shared`:
    columns whose values repeat across many lines (a session's user-side features), parsed
    once per distinct text where the lines allow it (data/shared_parse.py)."""
    source = path_text(path)
    data, stream_problem = _text_bytes(path, limits)
    problems = [(source, None, stream_problem)] if stream_problem else []
    return parse_json_text(data, source, None, schema, shared, problems)


# Small files are read several to a text (`read_json_files`): a file's fixed costs (a parse,
# the checks, a Parquet file written) were 24 ms, so 4,015 one-line files took 97 s, not 3.
SMALL_FILE = 64 << 10  # bytes on disk: a file this small joins its neighbours' text
SMALL_FILES = 4 << 20  # bytes on disk a run of small files holds at most


def _files_text(paths: list[Path], limits: ReadLimits) -> tuple[bytes, np.ndarray, list, list]:
    """The files' texts one after another (each ending in a newline), where each begins (in
    lines), their stream problems, and the files left out to be read alone: each file may
    fill its share of one file's limit (`max_bytes` / the files), so the text is one file's
    worth at most; one that expands past its share (or is refused) is read on its own."""
    share = ReadLimits(limits.max_bytes // max(len(paths), 1), limits.max_ratio, limits.ratio_floor)
    texts, starts, problems, alone, line = [], [], [], [], 0
    for path in paths:
        try:
            data, problem = _text_bytes(path, share)
        except FileRefused:
            alone.append(path)
            continue
        if data and not data.endswith(b"\n"):
            data += b"\n"
        starts.append(line)
        n = data.count(b"\n")
        if problem:
            problems.append((path_text(path), n + 1, problem))
        texts.append(data)
        line += n
    return b"".join(texts), np.asarray(starts, np.int64), problems, alone


def read_json_files(
    paths: list[Path],
    schema: pa.Schema,
    shared: list[str] | tuple = (),
    limits: ReadLimits = ReadLimits(),
) -> tuple[Parsed, Rejects, list[Path], list[Path]]:
    """Several small JSON-lines files parsed as one text (`Origin` maps its lines back to
    the files: quarantine records name each file and line), the files in it, and the files
    left to be read alone (`_files_text`)."""
    data, starts, problems, alone = _files_text(paths, limits)
    kept = [p for p in paths if p not in alone]
    origin = Origin(tuple(path_text(p) for p in kept), starts)
    name = f"{path_text(kept[0])} (+{len(kept) - 1} small files)" if kept else ""
    parsed, rejects = parse_json_text(data, name, origin, schema, shared, problems)
    return parsed, rejects, kept, alone


def raw_files_lines(paths: list[Path], limits: ReadLimits, line_numbers: np.ndarray) -> pa.Array:
    """`raw_lines` of a text of several small files (`read_json_files`), read again."""
    return Lines.of(_files_text(paths, limits)[0]).take(np.asarray(line_numbers, np.int64) - 1)


def parse_json_text(
    data: bytes, source: str, origin: Origin | None, schema: pa.Schema, shared, problems: list
) -> tuple[Parsed, Rejects]:
    """A JSON-lines text into `schema`'s columns (`read_json_lines`): damaged lines to the
    rejects with why, by file and line (`origin`); `problems`: the files' stream problems,
    (file, line or None for after the last, why)."""
    lines = Lines.of(data)
    n = len(lines)
    rejects = Rejects()
    locate = (lambda ln: (source, ln)) if origin is None else origin.locate  # noqa: E731

    def reject(idx, fields, reasons):
        idx = np.asarray(idx, np.int64)
        where, at = locate(idx + 1)
        rejects.add(where, at, fields, reasons, lines.take(idx))

    buf = np.frombuffer(data, np.uint8)
    nonempty = lines.ends > lines.starts
    first = (
        np.where(nonempty, buf[np.minimum(lines.starts, max(len(data) - 1, 0))], 0)
        if n
        else nonempty
    )
    last = np.where(nonempty, buf[np.maximum(lines.ends - 1, 0)], 0) if n else nonempty
    clean = nonempty & (first == ord("{")) & (last == ord("}"))
    candidate = clean.copy()
    bad_utf8 = _bad_utf8_lines(lines)
    clean[bad_utf8] = candidate[bad_utf8] = False
    reject(bad_utf8, [None] * bad_utf8.size, ["invalid UTF-8"] * bad_utf8.size)
    # Lines that are not plainly `{...}`: look closer, one by one (damaged or padded lines only).
    odd = np.flatnonzero(~clean)
    odd = odd[~np.isin(odd, bad_utf8)]
    for i in odd:
        text = lines.get(int(i)).strip()
        if not text:
            reject([i], [None], ["empty line"])
        elif text.startswith(b"{") and text.endswith(b"}"):
            candidate[i] = True
        else:
            fld, reason = diagnose_json_line(text, schema, "not a JSON object")
            reject([i], [fld], [reason])

    parse_opts = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    # a block must hold the longest line, or Arrow calls the line a "straddling object"
    longest = int((lines.ends - lines.starts).max()) if n else 0
    # one thread: files are parsed in parallel already (ingest.workers); Arrow's own pool on
    # top oversubscribes the cores (standard day, 2 cores: 8.67 -> 8.23 s, medians of 3)
    read_opts = pj.ReadOptions(block_size=max(4 << 20, longest + 64), use_threads=False)
    cand = np.flatnonzero(candidate)
    good: list[tuple[int, pa.Table, np.ndarray]] = []
    shared_lines, stack = 0, []
    # each chunk tries the shared parse once; what it declines, the plain parse (bisected
    # down to the damaged lines, which never retry the shared parse)
    for chunk in (cand[i : i + CHUNK_LINES] for i in range(0, cand.size, CHUNK_LINES)):
        run = lines.run(chunk, clean) if shared else None
        t = (
            None
            if run is None
            else parse_shared(
                data, lines.starts[run], lines.ends[run], schema, list(shared), read_opts
            )
        )
        if t is None:
            stack.append(chunk)
        else:
            good.append((int(chunk[0]), t, chunk))
            shared_lines += chunk.size
    stack.reverse()
    while stack:
        idx = stack.pop()
        try:
            t = pj.read_json(
                pa.BufferReader(lines.blob(idx, clean)),
                read_options=read_opts,
                parse_options=parse_opts,
            )
            if t.num_rows != idx.size:
                raise pa.ArrowInvalid("more than one JSON value on one line")
            good.append((int(idx[0]), t, idx))
        except pa.ArrowInvalid as e:
            if idx.size == 1:
                fld, reason = diagnose_json_line(lines.get(int(idx[0])), schema, str(e))
                reject(idx, [fld], [reason])
            else:
                half = idx.size // 2
                stack.extend([idx[half:], idx[:half]])
    for name, line, problem in problems:  # a stream cut short: after its last line
        rejects.add(name, [n + 1 if line is None else line], [None], [problem], [b""])

    good.sort(key=lambda g: g[0])
    if good:
        table = pa.concat_tables([g[1] for g in good])
        rows = np.concatenate([g[2] for g in good])
    else:
        table, rows = schema.empty_table(), np.zeros(0, np.int64)
    raw = lambda line_numbers: lines.take(line_numbers - 1)  # noqa: E731
    return Parsed(table, source, rows + 1, raw, shared_lines, origin=origin), rejects


_JSON_NAMES = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def diagnose_json_line(line: bytes, schema: pa.Schema, arrow_msg: str) -> tuple[str | None, str]:
    """Name the field and the problem of one line Arrow refused (runs on bad lines only)."""

    class Twice(ValueError):
        def __init__(self, key: str):
            super().__init__(f"field {key!r} appears twice")
            self.key = key

    def pairs_hook(pairs):
        keys = [k for k, _ in pairs]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup is not None:
            raise Twice(dup)
        return dict(pairs)

    try:
        obj = json.loads(line, object_pairs_hook=pairs_hook)
    except json.JSONDecodeError as e:
        what = "more than one JSON value on one line" if e.msg == "Extra data" else e.msg
        return None, f"invalid JSON: {what} (column {e.colno})"
    except Twice as e:
        return e.key, f"invalid JSON: {e}"
    except ValueError:  # an integer of more digits than Python converts (4,300)
        m = re.search(rb'"([^"\\]{1,64})"\s*:\s*\[?[^"]*?(-?\d{4000,})', line)
        field = m.group(1).decode("utf-8", "replace") if m else None
        digits = len(m.group(2).lstrip(b"-")) if m else sys.get_int_max_str_digits() + 1
        where = f"field {field!r}: " if field else ""
        return field, f"{where}an integer of {digits} digits, out of range for int64"
    except RecursionError:  # e.g. [[[[...]]]] thousands deep: a bad line, not a crash
        return None, "invalid JSON: nested too deeply"
    if arrow_msg.startswith("more than one JSON value"):
        return None, "invalid JSON: more than one JSON value on one line"
    if not isinstance(obj, dict):
        return None, f"not a JSON object (got {_JSON_NAMES.get(type(obj), type(obj).__name__)})"
    for f in schema:
        if f.name not in obj or obj[f.name] is None:
            continue
        problem = _type_problem(obj[f.name], f.type)
        if problem:
            return f.name, f"field {f.name!r}: {problem}"
    # Arrow's own words, less its position in the one-line chunk it was given ("in row 0")
    message = re.sub(r"^JSON parse error: |\.? in row \d+$", "", arrow_msg)
    return None, f"invalid JSON: {message}"


def _type_problem(value, typ: pa.DataType) -> str | None:
    if pa.types.is_list(typ):
        if not isinstance(value, list):
            return f"expected a list, got {type(value).__name__}"
        for v in value:
            if v is not None and (p := _type_problem(v, typ.value_type)):
                return f"list element {p}"
        return None
    if pa.types.is_integer(typ):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"expected an integer, got {type(value).__name__} {value!r}"[:120]
        info = np.iinfo(typ.to_pandas_dtype())
        if not info.min <= value <= info.max:
            return f"integer {value} out of range for {typ}"[:120]
        return None
    if pa.types.is_floating(typ):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"expected a number, got {type(value).__name__} {value!r}"[:120]
        if isinstance(value, float) and math.isinf(value):
            return "number too large"
        return None
    return None


# -- Parquet ----------------------------------------------------------------------------------
def read_parquet_events(
    path: Path, schema: pa.Schema, limits: ReadLimits = ReadLimits()
) -> tuple[Parsed, Rejects]:
    """Read a Parquet file into `schema`'s columns under JSON's type rule: an integer field
    takes integers, a number field integers or floats, a list field lists of those; never
    strings, booleans or dates (JSON rejects `"12"` and `true` for an id: so does this).

    A column of another kind rejects every row of the file (the type is per file); a value
    out of range for the field's type (a label of 300 in an int64 column) rejects its row,
    as it would its line in JSON. A missing column is a null column (the required-field
    check names it). A file that would decode past `limits` is refused before any page is
    read (`FileRefused`): judged by `decoded_bound`, what its columns hold once decoded,
    not the encoded sizes its footer declares (a dictionary- or run-length-encoded column
    decodes hundreds of times larger)."""
    source = path_text(path)
    try:
        pf = pq.ParquetFile(path)
        limits.check(decoded_bound(pf.metadata), path.stat().st_size)
        table = pf.read()
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    except pa.ArrowException as e:
        raise SourceError(f"{path} is not a readable Parquet file: {e}") from None
    n = table.num_rows
    problems: list[tuple[str, str]] = []
    row_reason: list[tuple[str, str] | None] = [None] * n  # (field, reason), first one wins
    cols = []
    for f in schema:
        if f.name not in table.column_names:
            cols.append(pa.nulls(n, f.type))
            continue
        col = table[f.name]
        if col.type == f.type:
            cols.append(col)
            continue
        if not _same_kind(col.type, f.type):
            problems.append(
                (
                    f.name,
                    f"field {f.name!r}: column type {col.type} cannot be read "
                    f"as {f.type} (the JSON rule: {_kind_words(f.type)})",
                )
            )
            cols.append(pa.nulls(n, f.type))
            continue
        for row, value in _out_of_range(col, f.type):
            if row_reason[row] is None:
                row_reason[row] = (
                    f.name,
                    f"field {f.name!r}: integer {value} out of range for {f.type}",
                )
        cols.append(col.cast(f.type, safe=False))  # rows out of range are rejected above
    lines = np.arange(1, n + 1, dtype=np.int64)
    rejects = Rejects()
    if problems:
        fld, reason = problems[0]
        if len(problems) > 1:
            reason += f" (and {len(problems) - 1} more column problems)"
        rejects.add(source, lines, [fld] * n, [reason] * n, rows_as_json(table, np.arange(n)))
        return Parsed(schema.empty_table(), source, np.zeros(0, np.int64), None), rejects
    typed = pa.Table.from_arrays(cols, schema=schema)
    bad = np.array([r is not None for r in row_reason], dtype=bool)
    if bad.any():
        idx = np.flatnonzero(bad)
        reasons = [row_reason[i] for i in idx]
        rejects.add(
            source,
            lines[idx],
            [r[0] for r in reasons],
            [r[1] for r in reasons],
            rows_as_json(table, idx),
        )
        keep = pa.array(~bad)
        typed, lines = typed.filter(keep), lines[~bad]
    return Parsed(typed, source, lines, None), rejects


_WIDTH = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


def decoded_bound(meta: pq.FileMetaData) -> int:
    """What a Parquet file's columns take once decoded, from its footer alone: each column
    chunk's values times their width (a fixed-width type), plus an offset and a validity
    byte per value of a nested or optional column; a byte array its declared uncompressed
    size at least. The footer's `total_byte_size` is the *encoded* size: a 0.6 MB export of
    long repeated lists, dictionary- and run-length-encoded, decodes to over a gigabyte."""
    total = 0
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        for j in range(rg.num_columns):
            col = rg.column(j)
            width = _WIDTH.get(col.physical_type)
            if col.physical_type == "FIXED_LEN_BYTE_ARRAY":
                width = meta.schema.column(j).length or 1
            values = col.num_values
            if width is None:  # BYTE_ARRAY: no width to multiply by
                total += max(col.total_uncompressed_size, values * 4)
            else:
                total += values * width
            if (
                meta.schema.column(j).max_definition_level
                or meta.schema.column(j).max_repetition_level
            ):
                total += values * 5  # an int32 offset and a validity byte per value
    return total


def _base(typ: pa.DataType) -> pa.DataType:
    return typ.value_type if pa.types.is_dictionary(typ) else typ


def _same_kind(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a column of type `src` holds what JSON would accept for a field of `dst`."""
    src = _base(src)
    if pa.types.is_null(src):
        return True
    if pa.types.is_list(dst):
        listy = (
            pa.types.is_list(src) or pa.types.is_large_list(src) or pa.types.is_fixed_size_list(src)
        )
        return listy and _same_kind(src.value_type, dst.value_type)
    if pa.types.is_integer(dst):
        return pa.types.is_integer(src)
    if pa.types.is_floating(dst):
        return pa.types.is_integer(src) or pa.types.is_floating(src)
    return src == dst


def _kind_words(dst: pa.DataType) -> str:
    if pa.types.is_list(dst):
        return f"lists of {_kind_words(dst.value_type).removesuffix(' only')}"
    if pa.types.is_integer(dst):
        return "integers only"
    if pa.types.is_floating(dst):
        return "integers or floats only"
    return f"{dst} only"


def _out_of_range(col: pa.ChunkedArray, dst: pa.DataType) -> list[tuple[int, int]]:
    """(row, value) of integers that do not fit `dst`'s integer type (lists: any element)."""
    inner = dst.value_type if pa.types.is_list(dst) else dst
    if not pa.types.is_integer(inner):
        return []
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    rows = np.arange(len(arr))
    if pa.types.is_list(dst):
        rows = np.asarray(pc.list_parent_indices(arr))
        arr = pc.list_flatten(arr)
    if not pa.types.is_integer(arr.type):
        return []
    info = np.iinfo(inner.to_pandas_dtype())
    values = arr.fill_null(0).to_numpy(zero_copy_only=False)
    if values.dtype.kind == "u":
        bad = values > info.max
    else:
        bad = (values < info.min) | (values > info.max)
    return [(int(rows[i]), int(values[i])) for i in np.flatnonzero(bad)]


def rows_as_json(table: pa.Table, idx: np.ndarray) -> pa.Array:
    """Rows as JSON bytes (for quarantining rows that came from a columnar file)."""
    rows = table.take(pa.array(idx, pa.int64())).to_pylist() if idx.size else []
    return pa.array([json.dumps(r, default=str).encode() for r in rows], pa.binary())


def open_text(path: Path, encoding: str) -> str:
    data, problem = read_bytes(path)
    if problem:
        raise SourceError(f"{path}: {problem}")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not {encoding} text at byte {e.start}") from None
