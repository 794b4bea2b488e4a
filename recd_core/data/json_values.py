"""What is wrong with a JSON value, in words: the field and the problem of a line Arrow's
reader refused (`diagnose_json_line`, run on bad lines only), and whether a JSON value fits
a warehouse type under JSON's type rule (`type_problem`: an id is an integer, never 3.7,
`true` or "58"). Ingest's quarantine reasons and the scoring server's 400s both say it so."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pyarrow as pa

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
        problem = type_problem(obj[f.name], f.type)
        if problem:
            return f.name, f"field {f.name!r}: {problem}"
    # Arrow's own words, less its position in the one-line chunk it was given ("in row 0")
    message = re.sub(r"^JSON parse error: |\.? in row \d+$", "", arrow_msg)
    return None, f"invalid JSON: {message}"


def type_problem(value, typ: pa.DataType) -> str | None:
    if pa.types.is_list(typ):
        if not isinstance(value, list):
            return f"expected a list, got {type(value).__name__}"
        for v in value:
            if v is not None and (p := type_problem(v, typ.value_type)):
                return f"list element {p}"
        return None
    if pa.types.is_integer(typ):
        if isinstance(value, float) and value.is_integer() and abs(value) >= 2**64:
            # a JSON integer past 64 bits, which a fast parser reads as a float
            return f"integer {value:.0f} out of range for {typ}"[:120]
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
