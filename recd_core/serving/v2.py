"""KServe's Open Inference Protocol (v2, REST) on `recd serve`, beside MLflow's, so KServe's
clients and tools (its InferenceService probes, `kserve` SDK's InferenceRESTClient, Triton's
perf_analyzer) work with it:

    GET  /v2, /v2/health/live, /v2/health/ready
    GET  /v2/models/{name}            the model's inputs (its features) and output
    GET  /v2/models/{name}/ready
    POST /v2/models/{name}/infer      {"id"?, "inputs": [{"name", "shape", "datatype",
                                        "data"}, ...]}
                                      -> {"model_name", "model_version", "id",
                                          "outputs": [{"name": "predictions", "shape": [n],
                                                       "datatype": "FP64", "data": [...]}]}

An input is a feature, one row a sample: shape [n] (a dense vector [n, k], its data
row-major); a list of varying length (an id list, a history) is BYTES, each element its
row's JSON array, the protocol having no ragged tensors. A ranking request sends the user
side with shape [r] (r requests) and `candidates` as BYTES, each element one request's JSON
array of candidate objects. The inputs become the columns MLflow's protocol gives
(scoring/request.py), so they are typed, checked and scored alike, the same scores and the
same one-line refusals (as `{"error": ...}`, the protocol's error body).
"""

from __future__ import annotations

import math

import orjson
import pyarrow as pa

from recd_core.schema import ENVELOPE_COLUMNS
from recd_core.scoring.ranking import CANDIDATES
from recd_core.scoring.request import RequestError

DATATYPES = {
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
}


def columns_of(body: object, max_rows: int) -> tuple[dict[str, list], int]:
    """A v2 inference request's inputs as columns (name -> one value a row) and its rows;
    more than `max_rows` rows is a 413 before a column is built."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise RequestError("expected a JSON object with 'inputs': a list of tensors")
    inputs = body["inputs"]
    if not inputs:
        raise RequestError("'inputs' is empty: one tensor a feature")
    columns: dict[str, list] = {}
    rows = None
    for i, tensor in enumerate(inputs):
        name, shape, values = _tensor(i, tensor)
        if rows is None:
            rows = shape[0]
            if rows > max_rows:
                raise RequestError(
                    f"{rows:,} rows in one request, more than the server's limit of "
                    f"{max_rows:,} (serve.max_rows): split the request",
                    413,
                )
        elif shape[0] != rows:
            raise RequestError(f"input {name!r}: {shape[0]} rows, the inputs before it {rows}")
        columns[name] = values
    return columns, rows


def _tensor(i: int, tensor: object) -> tuple[str, list[int], list]:
    """(name, shape, one value a row) of input i, refused in one line where malformed."""
    if not isinstance(tensor, dict):
        raise RequestError(f"input {i}: expected an object with name, shape, datatype, data")
    name, shape, kind = tensor.get("name"), tensor.get("shape"), tensor.get("datatype")
    if not isinstance(name, str) or not name:
        raise RequestError(f"input {i}: 'name' must be the feature's name")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise RequestError(f"input {name!r}: 'shape' must be [rows] or [rows, width]")
    if kind not in DATATYPES:
        raise RequestError(f"input {name!r}: datatype {kind!r} is not one of the protocol's")
    data = _flat(tensor.get("data"), name)
    if len(data) != math.prod(shape):
        raise RequestError(f"input {name!r}: {len(data)} values for shape {shape}")
    if kind == "BYTES":
        if len(shape) != 1:
            raise RequestError(f"input {name!r}: BYTES takes shape [rows], a JSON text a row")
        return name, shape, [_json_text(v, name, r) for r, v in enumerate(data)]
    if len(shape) == 2:
        width = shape[1]
        return name, shape, [data[r * width : (r + 1) * width] for r in range(shape[0])]
    return name, shape, data


def _flat(data: object, name: str) -> list:
    """The tensor's data, row-major (the protocol allows it nested or flat)."""
    if not isinstance(data, list):
        raise RequestError(f"input {name!r}: 'data' must be a list")
    if not any(isinstance(v, list) for v in data):
        return data
    out: list = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def _json_text(value: object, name: str, row: int):
    if not isinstance(value, str):
        raise RequestError(f"row {row}, field {name!r}: a BYTES element is the row's JSON text")
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        raise RequestError(f"row {row}, field {name!r}: not JSON text") from None


def answer_of(name: str, version: str | None, request_id, probs) -> bytes:
    """The inference response: one FP64 output, a probability a row or candidate."""
    out = {
        "model_name": name,
        "model_version": version,
        "outputs": [
            {"name": "predictions", "shape": [len(probs)], "datatype": "FP64", "data": probs}
        ],
    }
    if request_id is not None:
        out["id"] = request_id
    return orjson.dumps(out)


def metadata(name: str, version: str | None, schema: pa.Schema, features) -> dict:
    """The model's metadata: an input a feature (and `candidates`, for ranking requests),
    the one output."""
    inputs = []
    for f in schema:
        if f.name in ENVELOPE_COLUMNS:
            continue
        spec = features[f.name]
        if spec.kind == "dense" and pa.types.is_list(f.type):  # a vector of `dim` values
            inputs.append({"name": f.name, "datatype": "FP32", "shape": [-1, spec.dim]})
        else:
            inputs.append({"name": f.name, **_tensor_type(f.type)})
    inputs.append({"name": CANDIDATES, "datatype": "BYTES", "shape": [-1]})
    return {
        "name": name,
        "versions": [version] if version else [],
        "platform": "pytorch_recd",
        "inputs": inputs,
        "outputs": [{"name": "predictions", "datatype": "FP64", "shape": [-1]}],
    }


def _tensor_type(t: pa.DataType) -> dict:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return {"datatype": "BYTES", "shape": [-1]}
    return {"datatype": _datatype(t), "shape": [-1]}


def _datatype(t: pa.DataType) -> str:
    if pa.types.is_boolean(t):
        return "BOOL"
    if pa.types.is_floating(t):
        return f"FP{t.bit_width}"
    if pa.types.is_integer(t):
        return f"{'INT' if pa.types.is_signed_integer(t) else 'UINT'}{t.bit_width}"
    return "BYTES"
