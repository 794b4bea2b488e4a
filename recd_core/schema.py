"""Arrow schemas derived from a `FeatureSet`: the one place that maps feature kinds to types.

An events/samples row:

    event_id int64 | ts int64 (ms since epoch, UTC) | session_id int64 | label int8 (0/1)
    | one column per feature:
        sparse   -> int64             id_list, sequence -> list<int64>
        dense    -> float32 (dim 1)   dense, dim > 1    -> list<float32> of exactly `dim`

The feature set travels in the schema metadata (`recd.features`), so a partition describes
itself and a later stage never needs the config that wrote it.
"""

from __future__ import annotations

import pyarrow as pa

from recd_core.config import ENVELOPE_COLUMNS, FeatureSet, FeatureSpec

FEATURES_METADATA_KEY = b"recd.features"

ENVELOPE_FIELDS = tuple(pa.field(name, getattr(pa, t)()) for name, t in ENVELOPE_COLUMNS.items())


def feature_type(spec: FeatureSpec) -> pa.DataType:
    if spec.kind == "sparse":
        return pa.int64()
    if spec.kind in ("id_list", "sequence"):
        return pa.list_(pa.int64())
    return pa.float32() if spec.dim == 1 else pa.list_(pa.float32())


def events_schema(features: FeatureSet) -> pa.Schema:
    fields = [*ENVELOPE_FIELDS, *(pa.field(f.name, feature_type(f)) for f in features.features)]
    return pa.schema(fields, metadata={FEATURES_METADATA_KEY: features.model_dump_json().encode()})


def feature_set_of(schema: pa.Schema) -> FeatureSet:
    """The feature set a partition was written with (from its schema metadata)."""
    raw = (schema.metadata or {}).get(FEATURES_METADATA_KEY)
    if raw is None:
        raise ValueError("table has no recd.features metadata: not written by recd")
    return FeatureSet.model_validate_json(raw)


SESSIONS_CHECKED_KEY = b"recd.sessions_checked"


# A session-normalized samples file's index into its side file's row group (warehouse.py)
SIDE_ROW = "_side_row"


def sessions_checked(schema: pa.Schema) -> bool:
    """Did ingest verify that user-side values are constant within every session?"""
    return (schema.metadata or {}).get(SESSIONS_CHECKED_KEY) == b"true"


def mark_sessions_checked(schema: pa.Schema) -> pa.Schema:
    return schema.with_metadata({**(schema.metadata or {}), SESSIONS_CHECKED_KEY: b"true"})
