"""Ranking requests (scoring/ranking.py): one user's side once and its candidates, built
straight into the model's batch, score as the same samples in the row format do; refusals
name the candidate (or the user side) and the field."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from recd_core.config import ModelConfig, PreprocessConfig, TransformSpec
from recd_core.dpp.preprocess import prepare
from recd_core.modeling.model import build_model, members_of
from recd_core.modeling.saved import predict
from recd_core.schema import events_schema
from recd_core.scoring.ranking import (
    CANDIDATES,
    Ranking,
    candidate_side,
    probe_request,
    ranking_batch,
    ranking_requests,
    rankings_batch,
    score_ranking,
    score_together,
    user_side,
)
from recd_core.scoring.request import RequestError, request_columns, request_table
from recd_core.warehouse import Warehouse

N = 300


@pytest.fixture(scope="module")
def served(samples_warehouse, features):
    """An untrained DLRM (its history encoder, target attention and cross layers on) with
    the run's transforms: standardized dense values, hashed ids, the user side one group."""
    rows = Warehouse(samples_warehouse).read_range(
        "samples", "2026-11-01", 0, 2000, layout="clustered"
    )
    cfg = PreprocessConfig(batch_size=256, default_dense=TransformSpec(standardize=True))
    prep = prepare(rows, features, cfg)
    assert prep.groups, "the user side is a dedup group"
    torch.manual_seed(0)
    model = build_model(prep.model, ModelConfig()).eval()
    meta = {"prepared": json.loads(prep.to_json())}
    return model, meta, prep, rows


def one_request(rows: pa.Table, features, n: int = N) -> tuple[Ranking, pa.Table]:
    """The first row's user side and n rows' candidates; the same samples as rows."""
    user = rows.select(user_side(features)).slice(0, 1)
    cands = rows.select(candidate_side(features)).slice(0, n)
    as_rows = rows.slice(0, n)
    for name in user.column_names:
        repeated = pa.concat_arrays([user[name].combine_chunks()] * n)
        as_rows = as_rows.set_column(as_rows.column_names.index(name), name, repeated)
    return Ranking(user, cands), as_rows


def test_a_ranking_request_scores_as_its_rows_with_and_without_dedup(served, features):
    model, meta, prep, rows = served
    ranking, as_rows = one_request(rows, features)
    by_rows = predict(model, meta, as_rows, batch_size=128, trust_sessions=False)
    by_request = score_ranking(model, prep, ranking, batch_rows=128)
    np.testing.assert_allclose(by_request, by_rows, rtol=0, atol=1e-6)
    per_candidate = score_ranking(model, prep, ranking, batch_rows=128, dedup=False)
    np.testing.assert_allclose(per_candidate, by_rows, rtol=0, atol=1e-6)
    assert by_request.std() > 0  # the candidates differ, and so do their scores


def test_requests_of_several_users_scored_in_one_call_score_as_each_alone(served, features):
    """The server's dynamic batching: three users' requests (their candidates of different
    counts) in one batch score as each scored alone; each user's row is one unique row."""
    model, _, prep, rows = served
    starts, sizes = (0, 40, 130), (40, 90, 7)
    requests = []
    for lo, n in zip(starts, sizes, strict=True):
        part = rows.slice(lo, n)
        requests.append(
            Ranking(
                part.select(user_side(features)).slice(0, 1), part.select(candidate_side(features))
            )
        )
    assert len({r.user["user_id"][0].as_py() for r in requests}) == 3
    together = score_together(model, prep, requests)
    for request, got in zip(requests, together, strict=True):
        alone = score_ranking(model, prep, request, batch_rows=1024)
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-6)
    batch = rankings_batch(requests, prep)
    for ik in batch.groups.values():
        assert ik.num_unique == 3
        assert ik.inverse_indices.tolist() == [0] * 40 + [1] * 90 + [2] * 7
    off = score_together(model, prep, requests, dedup=False)  # the user side per candidate
    np.testing.assert_allclose(np.concatenate(off), np.concatenate(together), rtol=0, atol=1e-6)


def test_the_user_side_is_one_unique_row_every_candidate_points_at(served, features):
    _, _, prep, rows = served
    ranking, _ = one_request(rows, features, n=50)
    batch = ranking_batch(ranking, prep)
    assert batch.size == 50
    for ik in batch.groups.values():
        assert ik.num_unique == 1  # one row, whatever the candidates
        assert torch.equal(ik.inverse_indices, torch.zeros(50, dtype=torch.int64))
    off = ranking_batch(ranking, prep, dedup=False)  # the user side per candidate
    assert not off.groups and off.kjt.batch_size == 50


def _body(rows: pa.Table, features, n: int = 3) -> dict:
    user = {c: rows[c][0].as_py() for c in user_side(features)}
    return {**user, CANDIDATES: rows.select(candidate_side(features)).slice(0, n).to_pylist()}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            lambda r: r[CANDIDATES][1].__setitem__("item_id", -2),
            ["candidate 1: field 'item_id'", "negative"],
        ),
        (
            lambda r: r[CANDIDATES][2].__setitem__("item_id", 1.5),
            ["candidate 2, field 'item_id'", "integer"],
        ),
        (lambda r: r[CANDIDATES][0].pop("item_dense"), ["candidate 0: lacks 'item_dense'"]),
        (lambda r: r.__setitem__(CANDIDATES, {}), ["'candidates' must be a non-empty list"]),
        (lambda r: r.__setitem__("user_history", [1, "2"]), ["user field 'user_history'"]),
        (lambda r: r.__setitem__("user_dense", [0.0]), ["user field 'user_dense'", "values"]),
        (lambda r: r.pop("user_age"), ["lacks user feature(s): user_age"]),
    ],
)
def test_a_malformed_request_is_refused_naming_where(served, features, change, words):
    *_, rows = served
    body = _body(rows, features)
    change(body)
    columns, n = request_columns({"dataframe_records": [body]}, 100)
    with pytest.raises(RequestError) as refused:
        ranking_requests(columns, n, events_schema(features), features, 100)
    message = str(refused.value)
    assert "\n" not in message and refused.value.status == 400
    for w in words:
        assert w in message, (w, message)


def test_the_readiness_request_is_valid_and_scored(served, features):
    model, meta, prep, _ = served
    schema = events_schema(features)
    columns, n = request_columns(probe_request(schema, features), 10)
    (ranking,) = ranking_requests(columns, n, schema, features, 10)
    assert ranking.size == 1
    (score,) = score_ranking(model, prep, ranking)
    assert 0.0 < score < 1.0
    # its one sample as a row (what the server also scores before its first client)
    columns, n = request_columns(probe_request(schema, features, as_row=True), 10)
    assert CANDIDATES not in columns and n == 1
    table = request_table(columns, n, schema, features)
    (as_row,) = predict(model, meta, table, trust_sessions=False)
    assert as_row == pytest.approx(score, abs=1e-6)


def test_the_user_side_is_encoded_once_a_request_whatever_its_batches(served, features):
    """300 candidates in batches of 64: the history encoder runs once, on the one user row;
    with dedup off it runs on every candidate of every batch."""
    model, meta, prep, rows = served
    ranking, as_rows = one_request(rows, features)
    encoders = [h for m in members_of(model) for h in m.history.values()]
    assert encoders, "the synthetic features have a history"
    calls: list[int] = []
    hooks = [
        h.register_forward_hook(lambda m, i, out: calls.append(out[0].shape[0])) for h in encoders
    ]
    try:
        scores = score_ranking(model, prep, ranking, batch_rows=64)
        once = list(calls)
        calls.clear()
        score_ranking(model, prep, ranking, batch_rows=64, dedup=False)
    finally:
        for h in hooks:
            h.remove()
    assert once == [1] * len(encoders)
    assert sum(calls) == N * len(encoders) and len(calls) == 5 * len(encoders)
    by_rows = predict(model, meta, as_rows, batch_size=64, trust_sessions=False)
    np.testing.assert_allclose(scores, by_rows, rtol=0, atol=1e-6)


def test_an_optional_feature_left_out_is_missing_not_refused(served, features):
    """A feature the config marks `required: false` may be left out of a candidate (and of
    the user side): null, as an event may lack it; a required one left out is refused."""
    *_, rows = served
    loose = features.model_copy(
        update={
            "features": [
                f.model_copy(update={"required": False})
                if f.name in ("item_tags", "user_friends")
                else f
                for f in features.features
            ]
        }
    )
    body = _body(rows, loose)
    body.pop("user_friends")
    body[CANDIDATES][1].pop("item_tags")
    columns, n = request_columns({"dataframe_records": [body]}, 100)
    (ranking,) = ranking_requests(columns, n, events_schema(loose), loose, 100)
    assert ranking.candidates["item_tags"].null_count == 1
    assert ranking.user["user_friends"].null_count == 1
    with pytest.raises(RequestError, match="lacks user feature"):
        ranking_requests(columns, n, events_schema(features), features, 100)
