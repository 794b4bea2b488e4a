"""Readers for raw event files: JSON lines here (plain, gzip or zstd: data/raw_bytes.py),
Parquet in data/parquet_events.py; which one a file needs, by its content (`sniff`).

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
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json as pj

from recd_core.data.json_values import diagnose_json_line
from recd_core.data.raw_bytes import (
    GZIP_MAGIC,
    ZSTD_MAGIC,
    FileRefused,
    ReadLimits,
    SourceError,
    path_text,
    read_bytes,
)
from recd_core.data.shared_parse import byte_positions, parse_shared

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


def rows_as_json(table: pa.Table, idx: np.ndarray) -> pa.Array:
    """Rows as JSON bytes (for quarantining rows that came from a columnar file)."""
    rows = table.take(pa.array(idx, pa.int64())).to_pylist() if idx.size else []
    return pa.array([json.dumps(r, default=str).encode() for r in rows], pa.binary())
