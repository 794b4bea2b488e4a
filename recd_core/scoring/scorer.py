"""One scorer of a saved model: what `recd serve` (serving/app.py) and the registered
pyfunc (mlops/pyfunc.py) both wrap, so a request scores the same way through either.

    Scorer(model, meta)
      .features .schema .prep     read once from the model's metadata: the raw features a
                                  request carries, their warehouse types, the transforms,
                                  statistics and dedup groups of the training run
      .score(columns, n, ...)     a request body's columns (scoring/request.py), either
                                  format: sample rows, or ranking requests (a `candidates`
                                  column: scoring/ranking.py) -> one probability per row or
                                  per candidate, float64: `checked` then `score_checked`
      .score_together(checked)    several checked bodies of ranking requests in one model
                                  call (the server's dynamic batching)
      .score_rows(table, ...)     a checked samples table -> probabilities
      .rank(requests, ...)        checked ranking requests -> probabilities
      .probe                      the smallest valid ranking request (the readiness check)

A refusal is a `RequestError` (400, 413 past a limit), a score that is not a number a
`NonFinite`; the wrappers only translate them (HTTP answers, MLflow error codes). Scoring
holds a lock: one request at a time per scorer (torch's own threads split a model call).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from recd_core.config import FeatureSet
from recd_core.dpp.encode import Prepared
from recd_core.errors import RecdError
from recd_core.modeling.saved import predict
from recd_core.schema import events_schema
from recd_core.scoring.ranking import (
    CANDIDATES,
    Ranking,
    probe_request,
    ranking_requests,
    score_together,
)
from recd_core.scoring.ranking import score_rankings as _score_rankings
from recd_core.scoring.request import request_table


class NonFinite(RecdError):
    """The model scored NaN or infinity: a broken model, never answered as a score."""


def finite(probs: np.ndarray) -> np.ndarray:
    bad = int((~np.isfinite(probs)).sum())
    if bad:
        raise NonFinite(f"scored {bad} value(s) that are not numbers")
    return probs


@dataclass
class Checked:
    """A request body typed and checked: its ranking requests or its sample rows, and its
    rows (candidates, or sample rows)."""

    rankings: list[Ranking] | None
    table: pa.Table | None
    rows: int


def features_of(meta: dict) -> FeatureSet:
    """The raw feature set a saved model's rows carry (what a scoring request must hold)."""
    return FeatureSet.model_validate(meta["prepared"]["raw"])


def prepared_of(meta: dict) -> Prepared:
    """A saved model's transforms, statistics and dedup groups."""
    return Prepared.from_json(json.dumps(meta["prepared"]))


@dataclass
class Scorer:
    """A loaded model (`modeling.saved.load_model`) and what scoring it needs."""

    model: object
    meta: dict
    features: FeatureSet = field(init=False)
    schema: pa.Schema = field(init=False)
    prep: Prepared = field(init=False)
    probe: bytes = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.features = features_of(self.meta)
        self.schema = events_schema(self.features)
        self.prep = prepared_of(self.meta)
        self.probe = json.dumps(probe_request(self.schema, self.features)).encode()

    def score(
        self,
        columns: dict[str, list],
        n: int,
        max_rows: int,
        batch_rows: int = 4096,
        dedup: bool = True,
        deadline: float | None = None,
    ) -> np.ndarray:
        """A body's columns scored: ranking requests where it has a `candidates` column,
        sample rows otherwise; refused whole (`RequestError`) on the first bad value, and
        `NonFinite` where the model scores a value that is not a number."""
        return self.score_checked(self.checked(columns, n, max_rows), batch_rows, dedup, deadline)

    def checked(self, columns: dict[str, list], n: int, max_rows: int) -> Checked:
        """A body's columns typed and checked (`RequestError` on the first bad value)."""
        if CANDIDATES in columns:
            requests = ranking_requests(columns, n, self.schema, self.features, max_rows)
            return Checked(requests, None, sum(r.size for r in requests))
        return Checked(None, request_table(columns, n, self.schema, self.features), n)

    def score_checked(
        self,
        checked: Checked,
        batch_rows: int = 4096,
        dedup: bool = True,
        deadline: float | None = None,
    ) -> np.ndarray:
        if checked.rankings is not None:
            probs = self.rank(checked.rankings, batch_rows, dedup, deadline)
        else:
            probs = self.score_rows(checked.table, batch_rows, deadline)
        return finite(probs)

    def score_together(self, bodies: list[Checked], dedup: bool = True) -> list[np.ndarray]:
        """Bodies of ranking requests (their candidates within one model call's rows) scored
        in one call: each body's probabilities, float64 (`finite` is the caller's: one
        body's NaN refuses that body alone)."""
        requests = [r for b in bodies for r in b.rankings]
        with self.lock:
            probs = score_together(self.model, self.prep, requests, dedup)
        per_request = iter(probs)
        return [
            np.concatenate([next(per_request) for _ in b.rankings]).astype(np.float64)
            for b in bodies
        ]

    def score_rows(
        self, table: pa.Table, batch_rows: int = 4096, deadline: float | None = None
    ) -> np.ndarray:
        """Click probabilities of checked sample rows, `batch_rows` at a time; past
        `deadline` (monotonic) it stops between batches (TimeoutError). A request's session
        ids are never trusted: rows are grouped by their values."""
        with self.lock:
            out = predict(
                self.model, self.meta, table, batch_rows, trust_sessions=False, deadline=deadline
            )
        return out.astype(np.float64)

    def rank(
        self,
        requests: list[Ranking],
        batch_rows: int = 1024,
        dedup: bool = True,
        deadline: float | None = None,
    ) -> np.ndarray:
        """Each ranking request's candidates scored (the user side once a request, or once
        a candidate with `dedup` off), one request after the other."""
        with self.lock:
            return _score_rankings(self.model, self.prep, requests, batch_rows, dedup, deadline)
