"""Raw events from a Parquet file, read under JSON's type rule (`read_parquet_events`): a
column of another kind rejects the file's rows, a value out of range its row, and a file
that would decode past the limits is refused from its footer alone (`decoded_bound`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recd_core.data.raw_bytes import ReadLimits, SourceError, path_text
from recd_core.data.sources import Parsed, Rejects, rows_as_json


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
