"""A ranking request: one user, many candidates, the user side said once and computed once.

A recommender ranks N candidates for one user at a time. As sample rows that request repeats
the user's features, id lists and history N times, and the model encodes the history N
times: the duplication RecD removes from training, back at inference. A ranking request
says the user side once and lists the candidates (item- and context-side features each):

    {"dataframe_records": [{
        "user_id": 3, "user_age": 2, ..., "user_history": [17, 4, ...],   user side, once
        "candidates": [{"item_id": 7, "item_tags": [1, 5], "position": 0, "hour": 13},
                       {"item_id": 9, ...}, ...]}]}                        per candidate

(one object per request: `dataframe_split` with a `candidates` column says the same). The
answer is one score per candidate, in order; several requests in one body answer their
candidates' scores one request after the other. The row format (one row per sample) stays
for batch scoring; both go through the same MLflow pyfunc and `recd serve`.

In the model the request is what a training batch of one session is, built straight from
the request's values (no on-disk batch format on the way): each dedup group's features as
an InverseKeyedJaggedTensor of one unique row, every candidate pointing at it,

    group "user":  unique  = [ user row ]            inverse = [0, 0, ..., 0]   (N)
    kjt (items):   item_id, item_tags, position, ... one row per candidate     (N)
    dense:         [user_dense (once, broadcast) | item_dense]                 [N, D]

so the embedding bags and the history encoder run on the one user row, and its vectors are
expanded by the inverse indices. Candidates are scored `batch_rows` at a time; the user
row's results are computed for the first batch and reused by the others (`Batch.shared`),
so the user side is computed once a request, whatever its size.
`dedup=False` expands the user row to every candidate first (the same model computing the
user side per candidate), which is what the benchmark compares against.
"""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pyarrow as pa
import torch

from recd_core.config import FeatureSet
from recd_core.data.checks import first_failure, semantic_checks
from recd_core.dedup.sparse import InverseKeyedJaggedTensor, KeyedJaggedTensor
from recd_core.dpp.batch_store import Batch, expand
from recd_core.dpp.encode import Prepared, feature_ids, transformed_dense
from recd_core.scoring.request import RequestError, compatible_type, typed_column

CANDIDATES = "candidates"


def user_side(features: FeatureSet) -> list[str]:
    """The features a request says once: the user's (snapshotted per session)."""
    return [f.name for f in features.features if f.side == "user"]


def candidate_side(features: FeatureSet) -> list[str]:
    """The features each candidate says: the item's and the context's."""
    return [f.name for f in features.features if f.side != "user"]


@dataclasses.dataclass
class Ranking:
    """One checked request: the user side as a one-row table, the candidates as N rows."""

    user: pa.Table
    candidates: pa.Table

    @property
    def size(self) -> int:
        return self.candidates.num_rows


def ranking_requests(
    columns: dict[str, list], n: int, schema: pa.Schema, features: FeatureSet, max_rows: int
) -> list[Ranking]:
    """The requests of a body's columns (one per row; `candidates` a list of objects per
    row), typed as the warehouse types them and checked as ingest checks events; more than
    `max_rows` candidates in all is a 413. A refusal names the request, the candidate and
    the field."""
    users, cands = user_side(features), candidate_side(features)
    missing = [c for c in users if c not in columns and features[c].required]
    if missing:
        raise RequestError(f"the ranking request lacks user feature(s): {', '.join(missing)}")
    lists = columns[CANDIDATES]
    total = 0
    for r, cl in enumerate(lists):
        if not isinstance(cl, list) or not cl:
            where = f"request {r}: " if n > 1 else ""
            raise RequestError(f"{where}'candidates' must be a non-empty list of objects")
        total += len(cl)
    if total > max_rows:
        raise RequestError(
            f"{total:,} candidates in one body, more than the server's limit of "
            f"{max_rows:,} (serve.max_rows): split the request",
            413,
        )
    fields = {f.name: f for f in schema}
    out = []
    for r in range(n):
        where = f"request {r}: " if n > 1 else ""
        user = _table(
            {c: [columns[c][r] if c in columns else None] for c in users},
            fields,
            features,
            where + "user ",
        )
        table = _candidates_at_once(lists[r], cands, fields, features)
        if table is None:  # a refusal to name, or a request the fast path does not take
            rows: dict[str, list] = {c: [] for c in cands}
            for i, cand in enumerate(lists[r]):
                if not isinstance(cand, dict):
                    raise RequestError(f"{where}candidate {i}: expected an object of item features")
                lacking = [c for c in cands if c not in cand and features[c].required]
                if lacking:
                    raise RequestError(
                        f"{where}candidate {i}: lacks {', '.join(map(repr, lacking))}"
                    )
                for c in cands:  # an optional feature left out is missing (null), as in a log
                    rows[c].append(cand.get(c))
            table = _typed(rows, fields, where + "candidate ")
        out.append(Ranking(user, _checked(table, features, where + "candidate ")))
    return out


def _candidates_at_once(
    cl: list, cands: list[str], fields: dict[str, pa.Field], features: FeatureSet
) -> pa.Table | None:
    """The candidates typed as whole columns (Arrow reads the objects in one pass, no Python
    per candidate), or None where that is not plainly right: a value of another type, a
    required feature missing or null, anything but objects: the per-candidate path then
    names the candidate and the field, as it always did."""
    try:
        objects = pa.array(cl)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        return None
    if not pa.types.is_struct(objects.type) or objects.null_count:
        return None
    found = {objects.type.field(i).name: i for i in range(objects.type.num_fields)}
    columns = {}
    for c in cands:
        f = fields[c]
        if c not in found:
            if features[c].required:
                return None
            columns[c] = pa.nulls(len(cl), f.type)
            continue
        seen = objects.field(found[c])
        if (seen.null_count and features[c].required) or not compatible_type(seen.type, f.type):
            return None
        try:
            columns[c] = seen.cast(f.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
    return pa.table(columns, schema=pa.schema([fields[c] for c in cands]))


def _table(
    columns: dict[str, list], fields: dict[str, pa.Field], features: FeatureSet, where: str
) -> pa.Table:
    """Typed columns, checked: the first failing row named (`where` + its index; the user
    side has one row, so it is named by the field alone)."""
    return _checked(_typed(columns, fields, where), features, where)


def _typed(columns: dict[str, list], fields: dict[str, pa.Field], where: str) -> pa.Table:
    typed = {}
    for name, values in columns.items():
        try:
            typed[name] = typed_column(name, values, fields[name])
        except RequestError as e:
            raise RequestError(_where(str(e), where)) from None
    return pa.table(typed, schema=pa.schema([fields[c] for c in columns]))


def _checked(table: pa.Table, features: FeatureSet, where: str) -> pa.Table:
    """Ingest's checks on typed columns; the first failing row named."""
    bad, _, reasons = first_failure(table.num_rows, semantic_checks(table, features))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise RequestError(_where(f"row {row}: {reasons[row].as_py()}", where))
    return table


def _where(message: str, where: str) -> str:
    """'row 3: field ...' (or 'row 3, field ...') as 'candidate 3: field ...'; the user
    side has one row: 'user field ...'."""
    found = re.match(r"row (\d+)(: |, )(.*)", message)
    if found is None:
        return where + message
    row, sep, rest = found.groups()
    return f"{where}{row}{sep}{rest}" if where.endswith("candidate ") else where + rest


def ranking_batch(ranking: Ranking, prep: Prepared, dedup: bool = True) -> Batch:
    """The request as the model's batch (module doc): each group's features as one unique
    row that every candidate points at; the user side's other features (a user id outside
    the groups, user dense values) transformed once and repeated."""
    return rankings_batch([ranking], prep, dedup)


def rankings_batch(rankings: list[Ranking], prep: Prepared, dedup: bool = True) -> Batch:
    """Requests of several users as one batch (the server's dynamic batching): their
    candidates one after the other, each group's unique rows one a request, every candidate
    pointing at its own request's (as a training batch of several sessions):

        group "user":  unique  = [ user 0 | user 1 | ... ]        inverse = [0 0 0 1 1 ...]
        kjt, dense:    candidates of request 0, then of request 1, ...
    """
    users = pa.concat_tables([r.user for r in rankings])
    cands = pa.concat_tables([r.candidates for r in rankings])
    owner = np.repeat(np.arange(len(rankings)), [r.size for r in rankings])  # candidate -> request
    n = len(owner)
    grouped = {k for ks in prep.groups.values() for k in ks}
    dense_parts, extra_ids = [], {}
    for f in prep.raw.features:
        if f.kind != "dense":
            continue
        once = f.name in users.column_names  # the user's: transformed once, then repeated
        out = transformed_dense((users if once else cands)[f.name], f, prep)
        if isinstance(out, tuple):  # bucketized: an id list
            extra_ids[f.name] = _rows_of(out, owner) if once else out
        else:
            dense_parts.append(out[owner] if once else out)
    dense = np.concatenate(dense_parts, axis=1) if dense_parts else np.zeros((n, 0), np.float32)
    keys, values, lengths = [], [], []
    for f in prep.model.features:
        if f.kind == "dense" or f.name in grouped:
            continue
        if f.name in extra_ids:
            v, ln = extra_ids[f.name]
        elif f.name in users.column_names:
            v, ln = _rows_of(feature_ids(users[f.name], prep, f.name), owner)
        else:
            v, ln = feature_ids(cands[f.name], prep, f.name)
        keys.append(f.name)
        values.append(_int64(v))
        lengths.append(_int64(ln))
    kjt = KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths)) if keys else None
    groups = {}
    for g, gkeys in prep.groups.items():
        parts = [feature_ids(users[k], prep, k) for k in gkeys]
        unique = KeyedJaggedTensor(
            gkeys,
            torch.cat([_int64(v) for v, _ in parts]),
            torch.cat([_int64(ln) for _, ln in parts]),
        )
        groups[g] = InverseKeyedJaggedTensor(unique, _int64(owner), validate=False)
    batch = Batch(
        torch.from_numpy(np.ascontiguousarray(dense, np.float32)),
        kjt,
        torch.zeros(n, dtype=torch.float32),
        groups,
    )
    return batch if dedup else expand(batch)


def _int64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, np.int64))


def _rows_of(parts: tuple[np.ndarray, np.ndarray], rows: np.ndarray):
    """A jagged column's rows `rows` (each request's user row once a candidate): (values,
    lengths)."""
    values, lengths = parts
    values, lengths = np.asarray(values), np.asarray(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    picked = lengths[rows]
    first = np.repeat(starts[rows] - np.cumsum(picked) + picked, picked)
    return values[first + np.arange(int(picked.sum()))], picked


def probe_request(schema: pa.Schema, features: FeatureSet, as_row: bool = False) -> dict:
    """The smallest valid ranking request for a model (ids 0, empty lists, zeros; one
    candidate): what the readiness check scores through the whole request path (`as_row`:
    its one sample in the row format)."""

    def value(name: str):
        f = schema.field(name)
        spec = features[name]
        if spec.kind == "dense":
            return [0.0] * spec.dim if pa.types.is_list(f.type) else 0.0
        return [] if pa.types.is_list(f.type) else 0

    candidate = {c: value(c) for c in candidate_side(features)}
    request = {c: value(c) for c in user_side(features)}
    if as_row:
        return {"dataframe_records": [{**request, **candidate}]}
    return {"dataframe_records": [{**request, CANDIDATES: [candidate]}]}


def score_ranking(
    model,
    prep: Prepared,
    ranking: Ranking,
    batch_rows: int = 1024,
    dedup: bool = True,
    deadline: float | None = None,
) -> np.ndarray:
    """Click probabilities of a request's candidates, `batch_rows` candidates at a time, the
    user row's embeddings and history encoded for the first batch and kept for the rest
    (`Batch.shared`); past `deadline` (monotonic) it stops between batches (TimeoutError)."""
    out, shared = [], {}  # the user row's results: computed for the first batch, reused
    with torch.inference_mode():
        for lo in range(0, ranking.size, batch_rows):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            part = Ranking(ranking.user, ranking.candidates.slice(lo, batch_rows))
            batch = ranking_batch(part, prep, dedup)
            batch.shared = shared if dedup else None
            out.append(torch.sigmoid(model(batch)).numpy())
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def score_together(
    model, prep: Prepared, requests: list[Ranking], dedup: bool = True
) -> list[np.ndarray]:
    """Several requests' candidates in one model call (`rankings_batch`; their candidates
    within the server's batch rows): each request's probabilities."""
    with torch.inference_mode():
        probs = torch.sigmoid(model(rankings_batch(requests, prep, dedup))).numpy()
    return np.split(probs, np.cumsum([r.size for r in requests])[:-1])


def score_rankings(
    model,
    prep: Prepared,
    requests: list[Ranking],
    batch_rows: int = 1024,
    dedup: bool = True,
    deadline: float | None = None,
) -> np.ndarray:
    """Every request's candidates scored (`score_ranking`), one request after the other: the
    answer of a body of ranking requests, float64 as the servers send it."""
    scores = [score_ranking(model, prep, r, batch_rows, dedup, deadline) for r in requests]
    return np.concatenate(scores).astype(np.float64)
