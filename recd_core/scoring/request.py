"""A scoring request as a samples table, typed and checked as ingest types and checks events.

A request is MLflow's scoring protocol (what `mlflow models serve` takes, and the registered
model's `serving_input_example.json`), one object per request:

    {"dataframe_split":   {"columns": ["user_id", …], "data": [[3, …], …]}}
    {"dataframe_records": [{"user_id": 3, …}, …]}

Values are taken as JSON typed them, with no coercion: an id is a JSON integer (not 3.7,
`true` or "58"), a dense value a JSON number, a list a JSON array of those; then ingest's
checks (ids in range, list lengths, finite values, widths) run on the typed columns. A
refusal is a `RequestError`: one line naming the row and the field, and the HTTP status it
answers (400; 413 past a limit). Columns the model does not use are ignored; the envelope
(`event_id`, `ts`, `label`, a session id) is never trusted from a request.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from recd_core.data.checks import first_failure, semantic_checks
from recd_core.data.json_values import type_problem
from recd_core.errors import BadInput
from recd_core.schema import ENVELOPE_COLUMNS

FORMATS = ("dataframe_split", "dataframe_records")


class RequestError(BadInput):
    """A request refused whole: `status` is the HTTP answer, the message one line."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(" ".join(message.split())[:400])
        self.status = status


def request_columns(body: object, max_rows: int) -> tuple[dict[str, list], int]:
    """The request's columns (name -> one value per row) and its row count; a request of
    more than `max_rows` rows is refused (413) before any column is built."""
    if not isinstance(body, dict):
        raise RequestError(f"expected a JSON object with one of {', '.join(FORMATS)}")
    found = [k for k in FORMATS if k in body]
    if len(found) != 1:
        raise RequestError(
            f"expected exactly one of {', '.join(FORMATS)}; got keys {sorted(body)[:8]}"
        )
    if found[0] == "dataframe_split":
        split = body["dataframe_split"]
        if not isinstance(split, dict) or not isinstance(split.get("columns"), list):
            raise RequestError("dataframe_split: expected {'columns': [...], 'data': [[...]]}")
        columns, data = split["columns"], split.get("data")
        if not isinstance(data, list):
            raise RequestError("dataframe_split: 'data' must be a list of rows")
        _check_rows(len(data), max_rows)
        width = len(columns)
        for i, row in enumerate(data):
            if not isinstance(row, list) or len(row) != width:
                raise RequestError(f"row {i}: expected a list of {width} values (the columns)")
        return {str(c): [row[j] for row in data] for j, c in enumerate(columns)}, len(data)
    records = body["dataframe_records"]
    if not isinstance(records, list):
        raise RequestError("dataframe_records: expected a list of objects")
    _check_rows(len(records), max_rows)
    names: dict[str, None] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise RequestError(f"row {i}: expected an object of feature values")
        names.update(dict.fromkeys(rec))
    return {c: [rec.get(c) for rec in records] for c in names}, len(records)


def _check_rows(n: int, max_rows: int) -> None:
    if n > max_rows:
        raise RequestError(
            f"{n:,} rows in one request, more than the server's limit of {max_rows:,} "
            "(serve.max_rows): split the request",
            413,
        )


def typed_column(name: str, values: list, field: pa.Field) -> pa.Array:
    """One column typed as the warehouse types it, refusing what ingest refuses: Arrow
    infers the JSON values' own types first (an integer column stays integer; a float or a
    boolean among ids is seen, never truncated), then casts to the field's width."""
    try:
        seen = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        seen = None  # mixed kinds, or an integer beyond int64: named below
    if seen is not None and compatible_type(seen.type, field.type):
        try:
            return seen.cast(field.type)  # safe: an overflowing value raises
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    for i, v in enumerate(values):
        if v is not None and (problem := type_problem(v, field.type)):
            raise RequestError(f"row {i}, field {name!r}: {problem}")
    raise RequestError(f"field {name!r}: values of the wrong type for {field.type}")


def compatible_type(seen: pa.DataType, want: pa.DataType) -> bool:
    """May a JSON-inferred type stand for the field's? Integers for integers, any number
    for floats, arrays of those for lists; null (all missing, empty lists) for anything."""
    if pa.types.is_null(seen):
        return True
    if pa.types.is_list(want):
        return pa.types.is_list(seen) and compatible_type(seen.value_type, want.value_type)
    if pa.types.is_integer(want):
        return pa.types.is_integer(seen)
    if pa.types.is_floating(want):
        return pa.types.is_integer(seen) or pa.types.is_floating(seen)
    return seen == want


def request_table(columns: dict[str, list], n: int, schema: pa.Schema, features) -> pa.Table:
    """The request as a samples table of `schema` (events_schema of the model's features):
    feature columns typed (`typed_column`), the envelope filled, then ingest's semantic
    checks; the first failing row is named."""
    missing = [f.name for f in schema if f.name not in ENVELOPE_COLUMNS and f.name not in columns]
    if missing:
        raise RequestError(f"the request lacks feature column(s): {', '.join(missing)}")
    cols = {}
    for f in schema:
        if f.name in ENVELOPE_COLUMNS:  # never trusted from a request
            fill = np.zeros(n, np.int8) if f.name == "label" else np.arange(n)
            cols[f.name] = pa.array(fill, type=f.type)
        else:
            cols[f.name] = typed_column(f.name, columns[f.name], f)
    table = pa.table(cols, schema=schema)
    bad, _, reasons = first_failure(n, semantic_checks(table, features))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise RequestError(f"row {row}: {reasons[row].as_py()} ({int(bad.sum())} row(s) refused)")
    return table
