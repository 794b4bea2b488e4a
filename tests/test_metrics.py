"""Metrics against scikit-learn (the independent reference), on the same predictions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss, roc_auc_score

from recd_core import metrics
from recd_core.modeling.evaluate import StreamingMetrics


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.floats(0.0, 1.0)), min_size=2, max_size=300),
    st.integers(1, 50),
)
def test_streaming_metrics_match_scikit_learn(pairs, batch):
    y = np.array([p[0] for p in pairs], float)
    s = np.round(np.array([p[1] for p in pairs]), 2)  # rounding makes ties common
    if y.min() == y.max():
        return
    acc = StreamingMetrics()
    for lo in range(0, y.size, batch):
        acc.update(y[lo : lo + batch], s[lo : lo + batch])
    r = acc.result()
    clipped = np.clip(s, metrics.EPS, 1 - metrics.EPS)
    assert r["eval.auc"] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert r["eval.logloss"] == pytest.approx(log_loss(y, clipped), rel=1e-9)
    ctr = y.mean()
    entropy = -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))
    assert r["eval.ne"] == pytest.approx(log_loss(y, clipped) / entropy, rel=1e-9)
    assert r["eval.calibration"] == pytest.approx(clipped.sum() / y.sum(), rel=1e-9)
    assert metrics.auc(y, s) == pytest.approx(r["eval.auc"])


def test_ne_is_one_for_the_base_rate_and_below_for_skill():
    rng = np.random.default_rng(0)
    p = rng.random(20_000)
    y = (rng.random(20_000) < p).astype(float)
    assert metrics.normalized_entropy(y, np.full_like(p, y.mean())) == pytest.approx(1.0, abs=1e-9)
    assert metrics.normalized_entropy(y, p) < 0.9
    assert metrics.calibration(y, p) == pytest.approx(1.0, abs=0.03)
