"""One scorer of a saved model: what `recd serve` (serving/app.py) and the registered
pyfunc (mlops/pyfunc.py) both wrap, so a request scores the same way through either.

    Scorer(model, meta)
      .features .schema .prep     read once from the model's metadata: the raw features a
                                  request carries, their warehouse types, the transforms,
                                  statistics and dedup groups of the training run
      .score(columns, n, ...)     a request body's columns (scoring/request.py), either
                                  format: sample rows, or ranking requests (a `candidates`
                                  column: scoring/ranking.py) -> one probability per row or
                                  per candidate, float64
      .score_rows(table, ...)     a checked samples table -> probabilities
      .rank(requests, ...)        checked ranking requests -> probabilities
      .probe                      the smallest valid ranking request (the readiness check)

A refusal is a `RequestError` (400, 413 past a limit), a score that is not a number a
`NonFinite`; the wrappers only translate them (HTTP answers, MLflow error codes). Scoring
holds a lock: one request at a time per scorer, since torch already uses every core.
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
from recd_core.scoring.ranking import CANDIDATES, Ranking, probe_request, ranking_requests
from recd_core.scoring.ranking import score_rankings as _score_rankings
from recd_core.scoring.request import request_table


class NonFinite(RecdError):
    """The model scored NaN or infinity: a broken model, never answered as a score."""


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
        if CANDIDATES in columns:
            requests = ranking_requests(columns, n, self.schema, self.features, max_rows)
            del columns
            probs = self.rank(requests, batch_rows, dedup, deadline)
        else:
            table = request_table(columns, n, self.schema, self.features)
            del columns
            probs = self.score_rows(table, batch_rows, deadline)
        bad = int((~np.isfinite(probs)).sum())
        if bad:
            raise NonFinite(f"scored {bad} value(s) that are not numbers")
        return probs

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
