import datetime as dt
import gzip
import json
import math

import numpy as np
import pytest

from recd_core.config import ConfigError
from recd_core.config_files import load_feature_set, synth_config
from recd_core.data.synth import synthesize


def _rows(day_dir):
    rows = []
    for f in sorted(day_dir.glob("*.jsonl.gz")):
        rows += [json.loads(line) for line in gzip.decompress(f.read_bytes()).splitlines()]
    return rows


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, features):
    cfg = synth_config("small", users=50, days=1)
    for name in ("a", "b"):
        synthesize(features, cfg, tmp_path / name)
    synthesize(features, synth_config("small", users=50, days=1, seed=1), tmp_path / "c")
    a, b, c = (sorted((tmp_path / n).rglob("*.gz")) for n in "abc")
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert [p.read_bytes() for p in a] != [p.read_bytes() for p in c]


def test_events_are_well_formed_and_sessions_share_user_features(small_logs, features):
    rows = _rows(small_logs / "ds=2026-11-01")
    assert 3_500 < len(rows) < 4_500
    names = {f.name for f in features.features} | {"event_id", "ts", "session_id", "label"}
    assert all(set(r) == names for r in rows)
    user_cols = [f.name for f in features.by_side("user")]
    by_session: dict[int, dict] = {}
    for r in rows:
        assert r["label"] in (0, 1)
        for f in features.features:
            v = r[f.name]
            if f.kind == "dense":
                vals = v if isinstance(v, list) else [v]
                assert all(isinstance(x, float | int) and math.isfinite(x) for x in vals)
            else:
                vals = v if isinstance(v, list) else [v]
                assert all(isinstance(x, int) and x >= 0 for x in vals)
                if f.is_list:
                    assert len(v) <= f.max_length
        snap = {c: r[c] for c in user_cols}
        assert by_session.setdefault(r["session_id"], snap) == snap  # identical within a session
    day = dt.date(2026, 11, 1)
    lo = dt.datetime.combine(day, dt.time(), dt.UTC).timestamp() * 1000
    assert all(lo <= r["ts"] < lo + 86_400_000 for r in rows)


def test_session_lengths_are_heavy_tailed_with_the_configured_mean(tmp_path, features):
    cfg = synth_config("small", samples_per_day=20_000, mean_session_length=12.0)
    stats = synthesize(features, cfg, tmp_path)
    rows = _rows(tmp_path / "ds=2026-11-01")
    _, lengths = np.unique([r["session_id"] for r in rows], return_counts=True)
    assert abs(lengths.mean() - 12.0) < 1.0
    assert lengths.max() <= 64 and lengths.max() > 3 * lengths.mean()  # a real tail
    assert np.median(lengths) < lengths.mean()
    assert stats["synth.rows"] == len(rows)


def test_a_day_synthesized_alone_equals_that_day_within_a_range(tmp_path, features):
    """The daily pipeline synthesizes one day at a time: a day's sessions, items and clicks
    derive from its date, so the days differ and match a multi-day run (only the click
    history differs: it accumulates over the days synthesized together)."""
    synthesize(features, synth_config("small", users=50, days=2), tmp_path / "range")
    second = dt.date(2026, 11, 2)
    synthesize(
        features, synth_config("small", users=50, days=1, start_date=second), tmp_path / "one"
    )
    keys = ("event_id", "session_id", "user_id", "item_id", "label", "ts")
    alone = [[r[k] for k in keys] for r in _rows(tmp_path / "one/ds=2026-11-02")]
    assert alone == [[r[k] for k in keys] for r in _rows(tmp_path / "range/ds=2026-11-02")]
    first = {r["event_id"] for r in _rows(tmp_path / "range/ds=2026-11-01")}
    assert first.isdisjoint(r[0] for r in alone)


def test_the_oracle_figures_equal_a_direct_computation(tmp_path, features):
    """synth records the NE/AUC of the true click probabilities it drew the labels from."""
    import datetime as dt
    import json

    from sklearn.metrics import log_loss, roc_auc_score

    from recd_core.config import SynthConfig
    from recd_core.data.logs_root import read_oracle
    from recd_core.data.synth import World, generate_day, synthesize

    cfg = SynthConfig(users=50, items=200, samples_per_day=600, days=2)
    summary = synthesize(features, cfg, tmp_path)
    day = generate_day(World(features, cfg), cfg.start_date)  # the first day, again
    y, p = day.labels, day.click_prob
    ctr = y.mean()
    ne = log_loss(y, p) / -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))
    first = cfg.start_date.isoformat()
    oracle = read_oracle(tmp_path / f"ds={first}")
    assert oracle["ne"] == pytest.approx(ne, rel=1e-9)
    assert oracle["auc"] == pytest.approx(roc_auc_score(y, p), rel=1e-9)
    assert oracle["rows"] == sum(map(len, day.chunks)) == day.rows == y.size
    assert summary[f"synth.oracle_ne.{first}"] == pytest.approx(ne, rel=1e-9)
    second = (cfg.start_date + dt.timedelta(days=1)).isoformat()
    assert summary[f"synth.oracle_auc.{second}"] == read_oracle(tmp_path / f"ds={second}")["auc"]
    assert (
        0 < summary["synth.oracle_ne"] < 1
        and json.loads((tmp_path / f"ds={first}" / "_oracle.json").read_text())["ds"] == first
    )
    assert read_oracle(tmp_path / "ds=1999-01-01") is None  # real logs: no oracle


def test_the_logit_parts_add_up_to_the_oracles_click_probabilities(features):
    """The learnable bound (bench) hands some parts of the click model over and estimates
    others: the parts must be the generator's own, term by term."""
    from recd_core.config import SynthConfig
    from recd_core.data.synth import World, generate_day, logit_parts

    cfg = SynthConfig(users=50, items=200, samples_per_day=600)
    world = World(features, cfg)
    day = generate_day(world, cfg.start_date)
    p = logit_parts(world, day)
    logit = (
        cfg.base_ctr_logit
        + cfg.topic_effect * p["topic_match"]
        + p["affinity_seen"]
        + p["affinity_ids"]
        + p["user_bias"]
        + p["item_bias"]
        - 0.02 * p["position"]
    )
    np.testing.assert_allclose(1 / (1 + np.exp(-logit)), day.click_prob, rtol=1e-6)
    assert p["topic_match"].mean() > 1 / cfg.topics  # targeted impressions match more often
    assert np.abs(p["affinity_ids"]).sum() > 0 and np.abs(p["affinity_seen"]).sum() > 0


def test_a_day_is_written_file_by_file_and_sized_from_the_command_line(tmp_path, monkeypatch):
    """`--samples-per-day` sizes a day without a config file; a day larger than a file is
    split into files of ROWS_PER_FILE lines, in order, holding the same rows."""
    import subprocess
    import sys
    from pathlib import Path

    import recd_core.data.synth as synth

    recd = str(Path(sys.executable).with_name("recd"))
    cmd = [
        recd,
        "synth",
        "--logs",
        str(tmp_path / "one"),
        "--ds",
        "2026-11-01",
        "--samples-per-day",
        "3000",
        "--users",
        "60",
        "--items",
        "300",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    (one,) = (tmp_path / "one").glob("ds=*")
    rows = _rows(one)
    assert 3000 <= len(rows) < 3000 + 64, "whole sessions: up to one session more"
    assert len({r["user_id"] for r in rows}) <= 60
    assert max(r["item_id"] for r in rows) < 300

    monkeypatch.setattr(synth, "ROWS_PER_FILE", 700)
    cfg = synth_config("small", samples_per_day=3000, users=60, items=300)
    synthesize(load_feature_set("synthetic"), cfg, tmp_path / "split")
    files = sorted((tmp_path / "split" / one.name).glob("*.jsonl.gz"))
    sizes = [len(gzip.decompress(f.read_bytes()).splitlines()) for f in files]
    assert sizes == [700, 700, 700, 700, len(rows) - 2800]
    assert _rows(files[0].parent) == rows


def test_skewed_id_probabilities_are_the_drawn_frequencies():
    from recd_core.data.synth import _skewed_ids, skewed_id_probabilities

    p = skewed_id_probabilities(50)
    assert p.sum() == pytest.approx(1.0)
    draws = _skewed_ids(np.random.default_rng(0), 50, 400_000)
    freq = np.bincount(draws, minlength=50) / draws.size
    np.testing.assert_allclose(freq, p, atol=0.003)


def test_the_topic_posterior_is_bayes_over_the_entitys_topical_ids(features):
    """The features-alone reference (bench) reads the topics from the ids as the generator
    drew them: each entity's posterior equals the product of per-id likelihoods, computed
    directly, and names the true topic for users (long lists), less surely for items."""
    from recd_core.bench.bounds import topic_posterior
    from recd_core.config import SynthConfig
    from recd_core.data.synth import TOPIC_LEAN, Ragged, World, skewed_id_probabilities

    cfg = SynthConfig(users=60, items=300, samples_per_day=100)
    world = World(features, cfg)
    for side, n, true in (("user", 60, world.user_topic), ("item", 300, world.item_topic)):
        post = topic_posterior(world, side)
        np.testing.assert_allclose(post.sum(1), 1.0)
        static = world.user_static if side == "user" else world.item_static
        for e in (0, 1, n - 1):
            loglik = np.zeros(cfg.topics)
            for spec in world.features.by_side(side):
                table, size = static.get(spec.name), spec.table_size or 1
                width = size // cfg.topics
                if table is None or spec.kind == "dense" or width < 1:
                    continue
                ids = table.row(e) if isinstance(table, Ragged) else [table[e]]
                skew = skewed_id_probabilities(size)
                for i in ids:
                    for t in range(cfg.topics):
                        inside = t * width <= i < (t + 1) * width
                        loglik[t] += np.log(
                            TOPIC_LEAN * inside / width + (1 - TOPIC_LEAN) * skew[i]
                        )
            direct = np.exp(loglik - loglik.max())
            np.testing.assert_allclose(post[e], direct / direct.sum(), rtol=1e-6, atol=1e-12)
        right = post[np.arange(n), true].mean()
        assert right > (0.95 if side == "user" else 0.6)


def test_the_latent_posterior_mean_is_the_regression_of_the_latent_on_the_dense_feature(features):
    from recd_core.bench.bounds import latent_posterior_mean, latent_prior
    from recd_core.config import SynthConfig
    from recd_core.data.synth import World

    cfg = SynthConfig(users=4000, items=100, samples_per_day=100)
    world = World(features, cfg)
    mean = latent_posterior_mean(world, "user", 4)
    latent = world.user_latent[:, :4]
    for k in range(4):  # E[latent | x] is the least-squares fit of the latent on x
        slope = (mean[:, k] @ latent[:, k]) / (mean[:, k] @ mean[:, k])
        assert slope == pytest.approx(1.0, abs=0.05)
    assert np.mean((latent - mean) ** 2) < np.mean(latent**2) * 0.2
    # the full prior: the user's dense feature carries every latent dimension, the item's
    # only its first four; each variance is what the feature leaves unknown
    for side, entities in (("user", world.user_latent), ("item", world.item_latent)):
        mean, var = latent_prior(world, side)
        assert mean.shape == entities.shape and var.shape == (cfg.latent_dim,)
        left = np.var(entities - mean, axis=0)
        assert left == pytest.approx(var, rel=0.15 if side == "user" else 0.5)
    carried = next(s.dim for s in features.by_side("item") if s.kind == "dense")
    assert np.all(latent_prior(world, "item")[0][:, carried:] == 0)
    assert np.all(latent_prior(world, "item")[1][carried:] == 1)


def test_a_world_whose_ids_outgrow_an_unhashed_table_is_refused(tmp_path, features):
    """The synthetic ids are row indices (`hash: false`): more users than the user table has
    rows would wrap users onto each other's rows, so synth says so before drawing a row."""
    size = features["user_id"].table_size
    cfg = synth_config("small", users=size + 1)
    with pytest.raises(ConfigError, match=f"'user_id' draws ids up to {size}, beyond its table"):
        synthesize(features, cfg, tmp_path)
    hashed = features.model_copy(
        update={"features": [f.model_copy(update={"hash": True}) for f in features.features]}
    )
    synthesize(hashed, cfg.model_copy(update={"samples_per_day": 50}), tmp_path)
    assert (tmp_path / "ds=2026-11-01").is_dir()
