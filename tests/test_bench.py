"""The benchmark code paths on small data: every figure is produced and consistent. (Speed
targets are measured by `make bench`, never asserted in tests.)"""

import math

import pytest

from recd_core.bench.report import markdown
from recd_core.bench.run import dpp_figures
from recd_core.bench.training import bench_embeddings, bench_train, peak_memory
from recd_core.config import ModelConfig, TrainConfig

DAY = "2026-11-01"
SMALL = TrainConfig(
    batch_size=256, model=ModelConfig(embedding_dim=8, bottom_mlp=[16], top_mlp=[16], history_ff=16)
)


def test_training_bench_figures(fresh_warehouse, tmp_path):
    table = fresh_warehouse.read("samples", DAY, layout="clustered")
    r = bench_train(table, SMALL, repeats=2, n_batches=2)
    for key in (
        "bench.train_speedup",
        "bench.train_speedup_bound",
        "bench.train_speedup_component_bound",
    ):
        assert r[key] > 0 and math.isfinite(r[key]), key
    assert r["train.group_dedup_factor"] > 1
    assert r["train.samples_per_s.dedup"] == pytest.approx(256 / (r["train.step_ms.dedup"] / 1000))
    mem = peak_memory(table, SMALL, str(tmp_path))
    assert (
        mem["train.peak_mem_bytes.dedup"] > 100e6 and mem["train.peak_mem_bytes.baseline"] > 100e6
    )
    pytest.importorskip("torchrec", reason="the torchrec extra is not installed")
    e = bench_embeddings(table, SMALL, repeats=1)
    assert {
        "embedding.step_ms.torchrec_kjt",
        "embedding.step_ms.torchrec_vbe",
        "embedding.step_ms.ours_dedup",
    } <= e.keys()


def test_dpp_bench_figures_and_report(fresh_warehouse):
    r = dpp_figures(fresh_warehouse, DAY, repeats=1)
    assert r["bench.dpp_speedup"] > 0 and r["dpp.bytes_out.dedup"] < r["dpp.bytes_out.baseline"]
    # at the bench's batch (the training bench's), the pipeline's beside it; the stage's
    # fixed cost apart from the transform's throughput
    assert r["bench.dpp_batch_size"] == 4096 and r["bench.dpp_pipeline_batch_size"] == 512
    assert r["bench.dpp_pipeline_batch_speedup"] > 0
    for arm in ("dedup", "baseline"):
        assert r[f"dpp.fixed_seconds.{arm}"] >= 0
        assert r[f"dpp.transform_samples_per_s.{arm}"] > r[f"dpp.samples_per_s.{arm}"]
    report = markdown({"bench.preset": "small", **r})
    assert "DPP preprocessing" in report and "fixed cost" in report


def test_the_storage_table_names_the_movielens_release_it_measured():
    """ml-1m's storage row says ml-1m (the row read "MovieLens-100k" whatever was measured)."""
    storage = {
        "rows": 1_000_209,
        "sessions": 25_165,
        "shuffled_bytes": 190_000_000,
        "clustered_bytes": 35_000_000,
        "storage_ratio": 5.39,
        "lower_bound_bytes": 34_900_000,
        "clustered_over_lower_bound": 1.001,
        "dedup_factor_mean_clustered": 45.2,
        "dedup_factor_mean_shuffled": 4.62,
    }
    report = markdown({"bench.preset": "small", "movielens": {**storage, "data": "ml-1m"}})
    assert "| MovieLens (ml-1m) | 1,000,209 | 25,165 |" in report


def test_recd_bench_writes_and_logs_its_report(tmp_path):
    """`recd bench` end to end on the small preset: the ratios and bounds in one JSON, the
    markdown table and the chart under --out, all logged to MLflow."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    exe = Path(sys.executable).parent / "recd"
    r = subprocess.run(
        [
            exe,
            "--tracking-uri",
            uri,
            "bench",
            "--preset",
            "small",
            "--out",
            tmp_path / "b",
            "--quality-days",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "b/bench.json").read_text())
    for key in (
        "bench.storage_ratio",
        "bench.dpp_speedup",
        "bench.train_speedup",
        "bench.train_speedup_bound",
    ):
        assert result[key] > 0, key
    assert (tmp_path / "b/bench.png").read_bytes()[:4] == b"\x89PNG"
    # the training steps again beside a busy neighbour, threads passive and spinning
    for name in ("passive", "spinning"):
        assert result[f"bench.neighbour.train_speedup.{name}"] > 0, name
    # the tables sharded over 2 processes: the dedup arm's all-to-alls carry unique rows
    for sharding in ("table_wise", "row_wise"):
        k = f"sharded.{sharding}"
        for what in ("id_bytes_per_step", "vector_bytes_per_step"):
            assert 0 < result[f"{k}.dedup.{what}"] < result[f"{k}.baseline.{what}"] / 2, what
    assert result["sharded.dedup_factor_per_rank"] > 2
    # the over-budget table: row-wise on both ranks, each holding less than the budget
    assert result["sharded.big_table_bytes"] > result["sharded.budget_mb"] << 20
    assert result["sharded.big_table_plan"] == "row_wise on ranks 0,1"
    assert all(
        b < result["sharded.budget_mb"] << 20 for b in result["sharded.table_bytes_per_rank"]
    )
    assert "no placement of the tables" in result["sharded.half_budget_refusal"]
    # FlexShard's placement replayed on the day's lookups: fewer bytes between nodes than
    # row-wise at 16 ranks, within at most a quarter more rows a rank
    fs = "sharded.flexshard.baseline.w16"
    assert (
        result[f"{fs}.flexshard.cross_bytes_per_step"]
        < result[f"{fs}.row_wise.cross_bytes_per_step"]
    )
    assert (
        result[f"{fs}.flexshard.rows_per_rank"]
        <= 1.25 * result[f"{fs}.row_wise.rows_per_rank"] + 10
    )
    # the quality part: two warm-started days against the oracle, the first by both arms
    week = result["week"]
    assert [w["init"] for w in week] == ["scratch", "warm"]
    assert all(0 < w["oracle_ne"] < w["ne"] for w in week)
    assert all(w["oracle_ne"] < w["bound_ne"] < 1 for w in week)  # what the data teaches
    # the features show less than the bound hands over (topics and latents, read noisily)
    assert all(w["bound_ne"] < w["features_ne"] < 1.05 for w in week)
    assert all(w["oracle_ne"] < w["learned_ne"] < 1 for w in week)  # nothing given but the form
    assert result["bench.quality.week.arms_ne_gap"] < 0.01
    # where each model's gap lies: the true terms, added to its logit, close most of it
    for w in week:
        assert w["missed"]["all"] < w["missed"]["model"]
    # the served week's model: recd serve and mlflow models serve, each request size
    for size in (1, 100, 10_000):
        for server in ("serving", "serving.mlflow"):
            k = f"{server}.rows_{size}"
            assert 0 < result[f"{k}.p50_ms"] <= result[f"{k}.p99_ms"], k
            assert result[f"{k}.peak_rss"] > 0, k
    # ranking requests, as rows and with dedup off: measured (the ratios are the bench's)
    for n in (1, 100, 1_000):
        for kind in ("request", "rows", "no_dedup"):
            k = f"serving.ranking.{kind}_{n}"
            assert 0 < result[f"{k}.p50_ms"] <= result[f"{k}.p99_ms"], k
            assert result[f"{k}.requests_per_s"] > 0 and result[f"{k}.peak_rss"] > 0, k
    assert result["serving.ranking.rows_ratio_1000"] > 0
    # many clients: every closed-loop request answered (the load is within the limits the
    # row budget sets), 8 and 32 clients sharing model calls
    for c in (1, 8, 32):
        k = f"serving.load.closed.c{c}"
        assert result[f"{k}.answered"] > 0 and result[f"{k}.refused_503"] == 0, k
        assert result[f"{k}.other_errors"] == 0 and result[f"{k}.p50_ms"] > 0, k
    assert result["serving.load.closed.c32.requests_a_call"] > 1
    assert result["serving.load.closed.c8.n1000.rows_ratio"] > 0
    assert result["serving.load.open.x0.5.answered"] > 0
    # 4,000 one-line files are read as a few texts, not 4,000 parses
    assert result["bench.small_files.events_files_many"] < 10
    md = (tmp_path / "b/bench.md").read_text()
    assert "recd serve p50" in md and "one-line files" in md and "ranking request" in md
    assert "closed loop, 32 clients" in md
    assert "learnable bound" in md and "the features alone" in md and "Where the gap lies" in md
    assert "beside a busy neighbour, passive threads" in md
    assert "tables sharded, 2 processes" in md and "A table past a process's budget" in md
    assert "the generator's model, learned" in md
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(result["mlflow.run_id"])
    assert run.data.metrics["bench/storage_ratio"] == pytest.approx(result["bench.storage_ratio"])
    assert {"bench.md", "bench.png", "summary.json"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)
    }


def test_the_logistic_regression_reference_and_the_split_by_time_per_user(fresh_warehouse):
    import numpy as np
    import pyarrow.compute as pc

    from recd_core.bench.references import logistic_regression, time_split
    from recd_core.schema import feature_set_of

    samples = fresh_warehouse.read("samples", "2026-11-01", layout="clustered")
    test = np.asarray(time_split(samples, 0.8, per_user=True))
    users, ts = np.asarray(samples["user_id"]), np.asarray(samples["ts"])
    for u in np.unique(users)[:50]:  # each user's latest rows are the test rows
        mine = users == u
        if test[mine].any() and (~test[mine]).any():
            assert ts[mine][~test[mine]].max() <= ts[mine][test[mine]].min()
    assert 0.15 < test.mean() < 0.3
    mask = time_split(samples, 0.8, per_user=False)
    assert np.asarray(samples["ts"])[np.asarray(mask)].min() >= ts[~np.asarray(mask)].max()
    train, held = samples.filter(pc.invert(mask)), samples.filter(mask)
    features = feature_set_of(samples.schema)
    keep = ("user_id", "user_liked_categories", "user_dense", "item_id", "item_tags", "position")
    features = features.model_copy(update={"features": [features[f] for f in keep]})
    lr = logistic_regression(train, held, features, per_user=False, strengths=(0.1, 1.0))
    assert 0.5 < lr["auc"] < 1 and 0 < lr["ne"] < 1.2 and lr["c"] > 0
    assert 0 < lr["ne_calibrated"] < 1.2  # calibrated as ours is (on the latest tenth)


def test_a_reference_tuned_to_its_grids_end_tries_past_it():
    """A choice on the end of a reference's grid says the best lies beyond it: the search
    goes on by the grid's own ratio (`WIDEN` values at most each way), and stays inside a
    grid whose best is inside it."""
    import numpy as np

    from recd_core.bench.references import WIDEN, search

    def distance_to(best: float):
        return lambda v: abs(np.log10(v / best))  # a validation NE, lowest at `best`

    grid = (0.01, 0.1, 1.0)
    value, scores = search(grid, distance_to(10.0))  # one step above the grid
    assert np.isclose(value, 10.0) and len(scores) == 5  # 10 won, 100 scored worse
    value, scores = search(grid, distance_to(1e-9))  # far below it
    assert len(scores) == 3 + WIDEN and np.isclose(value, 0.01 / 10**WIDEN)
    value, scores = search(grid, distance_to(0.1))  # inside: nothing more is tried
    assert value == 0.1 and sorted(scores) == list(grid)
    value, scores = search((31, 127), distance_to(2))  # integers stay integers, at least 2
    assert value == 2 and sorted(scores) == [2, 8, 31, 127]


def test_the_id_terms_fit_recovers_biases_and_id_only_affinity_from_enough_impressions():
    """`fit_id_terms` (behind the week's "generator's model, learned"): labels drawn from the model it
    fits, with plenty of impressions per id, give back the biases and the affinity; with
    the labels shuffled and few, it learns no affinity, and its priors bound what it fits."""
    import numpy as np

    from recd_core.bench.bounds import fit_id_terms

    rng = np.random.default_rng(0)
    n_users, n_items, k, n = 60, 80, 2, 60_000
    bu, bi = rng.normal(0, 0.5, n_users), rng.normal(0, 0.5, n_items)
    p, q = rng.normal(size=(n_users, k)), rng.normal(size=(n_items, k))
    u, i = rng.integers(0, n_users, n), rng.integers(0, n_items, n)
    offset = rng.normal(-1.0, 0.5, n)
    affinity = (p[u] * q[i]).sum(1) / 2.0
    y = (rng.random(n) < 1 / (1 + np.exp(-(offset + bu[u] + bi[i] + affinity)))).astype(float)
    fit = fit_id_terms(u, i, y, offset, (n_users, n_items, k), bias_sd=0.5, latent_scale=2.0)
    assert np.corrcoef(fit["user_bias"], bu)[0, 1] > 0.9
    assert np.corrcoef(fit["item_bias"], bi)[0, 1] > 0.9
    learned = (fit["P"][u] * fit["Q"][i]).sum(1) / 2.0
    assert np.corrcoef(learned, affinity)[0, 1] > 0.9
    few = slice(0, 4_000)  # ~60 impressions an id: where the priors matter
    shuffled = rng.permutation(y[few])
    noise = fit_id_terms(u[few], i[few], shuffled, offset[few], (n_users, n_items, k), 0.5, 2.0)
    fitted_noise = (noise["P"][u] * noise["Q"][i]).sum(1) / 2.0
    assert abs(np.corrcoef(fitted_noise, affinity)[0, 1]) < 0.1
    # MAP fits some noise where ids are seen ~60 times (the affinity's own scale, not more):
    # the week's reference recalibrates on the evaluated day, which weighs that down
    assert np.abs(fitted_noise).mean() < 1.5 * np.abs(affinity).mean()


def test_the_factorization_machine_scores_every_pair_of_active_columns():
    """The O(nnz * k) form equals the definition: bias + x.w + the sum over column pairs
    i < j of x_i x_j <v_i, v_j>."""
    import numpy as np
    import torch
    from scipy import sparse

    from recd_core.bench.references import FactorizationMachine

    rng = np.random.default_rng(0)
    x = sparse.random(6, 9, density=0.4, random_state=1, format="csr") * 3
    fm = FactorizationMachine(9, 4, seed=2)
    with torch.no_grad():
        fm.b.fill_(0.3)
        fm.w.copy_(torch.tensor(rng.normal(size=9), dtype=torch.float32))
    dense, w, v = x.toarray(), fm.w.detach().numpy(), fm.v.detach().numpy()
    direct = [
        0.3
        + row @ w
        + sum(row[i] * row[j] * (v[i] @ v[j]) for i in range(9) for j in range(i + 1, 9))
        for row in dense
    ]
    with torch.no_grad():
        got = fm.logit(FactorizationMachine.tensors(x)).numpy()
    np.testing.assert_allclose(got, direct, rtol=1e-5, atol=1e-6)


def test_the_factorization_machine_reference_learns_what_the_linear_one_cannot():
    """Clicks that depend only on whether a user's and an item's hidden groups match: every
    user and item clicks half the time, so one-hot weights learn nothing (AUC ~0.5); the
    factorization machine's pairwise term learns the match."""
    import numpy as np
    import pyarrow as pa

    from recd_core.bench.references import factorization_machine, logistic_regression
    from recd_core.config import FeatureSet, FeatureSpec

    rng = np.random.default_rng(0)
    n, users, items = 6000, 60, 60
    u, i = rng.integers(0, users, n), rng.integers(0, items, n)
    match = (u % 2) == (i % 2)
    label = rng.random(n) < np.where(match, 0.8, 0.2)
    table = pa.table(
        {
            "user_id": u,
            "item_id": i,
            "label": label.astype(np.int64),
            "ts": np.arange(n),
            "event_id": np.arange(n),
        }
    )
    features = FeatureSet(
        name="pairs",
        features=[
            FeatureSpec(name="user_id", side="user", kind="sparse", table_size=users),
            FeatureSpec(name="item_id", side="item", kind="sparse", table_size=items),
        ],
    )
    train, test = table.slice(0, 5000), table.slice(5000)
    lr = logistic_regression(train, test, features, per_user=False, strengths=(1.0,))
    fm = factorization_machine(
        train, test, features, per_user=False, k=4, strengths=(1e-4,), max_epochs=150, lr=0.05
    )
    assert lr["auc"] < 0.6
    assert fm["auc"] > 0.75 and fm["ne"] < lr["ne"] - 0.1
    assert fm["l2"] == 1e-4 and 1 <= fm["passes"] <= 150


def _history_match_samples(n: int, seed: int = 0):
    """Samples whose click depends only on whether the shown item's genre is among the
    genres of the user's history: each user and item clicks about half the time, so ids
    alone learn little; a model that compares the candidate with the history learns it."""
    import numpy as np
    import pyarrow as pa

    from recd_core.config import FeatureSet, FeatureSpec

    rng = np.random.default_rng(seed)
    items, genres, users = 40, 4, 100
    genre_of = np.arange(items) % genres
    item = rng.integers(0, items, n)
    history = [rng.choice(items, rng.integers(1, 4), replace=False) for _ in range(n)]
    match = np.array([genre_of[i] in genre_of[h] for i, h in zip(item, history, strict=True)])
    label = rng.random(n) < np.where(match, 0.85, 0.15)
    table = pa.table(
        {
            "user_id": rng.integers(0, users, n),
            "user_history": [h.tolist() for h in history],
            "item_id": item,
            "item_genres": [[int(genre_of[i])] for i in item],
            "label": label.astype(np.int64),
            "ts": np.arange(n),
            "event_id": np.arange(n),
        }
    )
    features = FeatureSet(
        name="match",
        user_key="user_id",
        item_key="item_id",
        features=[
            FeatureSpec(name="user_id", side="user", kind="sparse", table_size=users, hash=False),
            FeatureSpec(
                name="user_history",
                side="user",
                kind="sequence",
                table="items",
                table_size=items,
                max_length=16,
                hash=False,
            ),
            FeatureSpec(
                name="item_id",
                side="item",
                kind="sparse",
                table="items",
                table_size=items,
                hash=False,
            ),
            FeatureSpec(
                name="item_genres", side="item", kind="id_list", table_size=genres, max_length=1
            ),
        ],
    )
    return table, features, match


def test_the_sequential_references_learn_what_the_history_says_of_the_candidate():
    """DIN, DCN-v2 and SIM (bench/sequential.py) each learn a click that depends on the
    candidate against the history, where the one-hot logistic regression cannot; each is
    tuned on the latest 10% and refit."""
    from recd_core.bench.references import logistic_regression
    from recd_core.bench.sequential import sequential_reference

    table, features, _ = _history_match_samples(6000)
    train, test = table.slice(0, 5000), table.slice(5000)
    lr = logistic_regression(train, test, features, per_user=False, strengths=(1.0,))
    assert lr["auc"] < 0.65
    for name in ("din", "sim", "dcn_v2"):
        got = sequential_reference(
            name,
            train,
            test,
            features,
            per_user=False,
            batch=128,
            max_passes=6,
            learning_rates=(3e-3,),
        )
        assert got["auc"] > 0.75 and got["ne"] < lr["ne"] - 0.1, (name, got, lr)
        assert got["lr"] == 3e-3 and 0 < got["passes"] <= 6 * 1.2


def test_sim_searches_out_the_most_recent_history_items_sharing_a_genre():
    """SIM's general search unit keeps the history's items of the candidate's genres, the
    most recent first, and marks the slots it could not fill."""

    from recd_core.bench.sequential import SIM, SIM_TOP_K, encode, genre_masks

    table, features, match = _history_match_samples(50, seed=3)
    every_item, _, _ = _history_match_samples(2000)
    model = SIM(features, 4, 0, genre_masks([every_item], features))
    x = encode(table, features)
    ids, item = x.lists["user_history"].long(), x.ids["item_id"]
    pos, found = model.search(ids, item)
    assert pos.shape == (50, min(SIM_TOP_K, ids.shape[1]))
    for row in range(50):
        genre = (int(item[row]) - 1) % 4
        want = [
            p
            for p in range(ids.shape[1])
            if ids[row, p] > 0 and (int(ids[row, p]) - 1) % 4 == genre
        ]
        got = pos[row][found[row]].tolist()
        assert got == sorted(want, reverse=True)  # the most recent (last) first
        assert bool(found[row].any()) == bool(match[row])


def test_the_learned_generator_model_takes_each_topic_from_the_clicks_beyond_its_prior():
    """`fit_id_terms` with topics (the week's "generator's model, learned" reference): each
    user's and item's topic starts at a vague prior (what its ids show) and the clicks
    sharpen it; its predictive, the mixture over a match, beats the prior's and a later
    day's fit continues from the earlier one."""
    import numpy as np

    from recd_core import metrics
    from recd_core.bench.bounds import fit_id_terms, id_terms_probability

    rng = np.random.default_rng(1)
    n_users, n_items, n_topics, n, effect = 200, 300, 4, 60_000, 2.0
    tu, ti = rng.integers(0, n_topics, n_users), rng.integers(0, n_topics, n_items)

    def vague(truth, size):  # the true topic a little more likely, noisily: often not the top
        score = rng.normal(0, 0.5, (size, n_topics))
        score[np.arange(size), truth] += 0.4
        prior = np.exp(score)
        return prior / prior.sum(1, keepdims=True)

    prior_u, prior_i = vague(tu, n_users), vague(ti, n_items)
    u, i = rng.integers(0, n_users, n), rng.integers(0, n_items, n)
    offset = np.full(n, -2.0)
    y = (rng.random(n) < 1 / (1 + np.exp(-(offset + effect * (tu[u] == ti[i]))))).astype(float)
    shape = (n_users, n_items, 1)
    zero_latent = (
        np.zeros((n_users, 1)),
        np.full(1, 1e-6),
        np.zeros((n_items, 1)),
        np.full(1, 1e-6),
    )
    topics = (prior_u, prior_i, effect)

    def fit(rows, start=None):
        return fit_id_terms(
            u[rows],
            i[rows],
            y[rows],
            offset[rows],
            shape,
            0.5,
            1.0,
            iters=50,
            latent_priors=zero_latent,
            topics=topics,
            rounds=3,
            start=start,
        )

    def right(topic, truth):
        return (topic.argmax(1) == truth).mean()

    assert right(prior_u, tu) < 0.6 and right(prior_i, ti) < 0.6
    first = fit(slice(0, n // 2))
    both = fit(slice(0, n), start=first)
    for learned in (first, both):
        assert right(learned["user_topic"], tu) > 0.9 and right(learned["item_topic"], ti) > 0.85
    assert right(both["item_topic"], ti) >= right(first["item_topic"], ti)
    held = slice(n // 2, n)
    prior_only = {
        "user_bias": np.zeros(n_users),
        "item_bias": np.zeros(n_items),
        "P": np.zeros((n_users, 1)),
        "Q": np.zeros((n_items, 1)),
        "user_topic": prior_u,
        "item_topic": prior_i,
    }
    ne = {
        name: metrics.normalized_entropy(
            y[held], id_terms_probability(f, u[held], i[held], offset[held], 1.0, effect)
        )
        for name, f in (("prior", prior_only), ("learned", first))
    }
    assert ne["learned"] < ne["prior"] - 0.02


def test_gradient_boosted_trees_learn_what_two_ids_say_together():
    """The trees reference takes each id as a categorical column: clicks that depend only on
    whether a user's and an item's hidden groups match (every id clicks half the time) are
    learned by a split on the user's group, then on the item's."""
    import numpy as np
    import pyarrow as pa

    from recd_core.bench.references import gradient_boosted_trees, tree_design
    from recd_core.config import FeatureSet, FeatureSpec

    rng = np.random.default_rng(0)
    n, users, items = 6000, 60, 60
    u, i = rng.integers(0, users, n), rng.integers(0, items, n)
    label = rng.random(n) < np.where((u % 2) == (i % 2), 0.8, 0.2)
    table = pa.table(
        {
            "user_id": u,
            "item_id": i,
            "tags": [[int(x % 5), int(x % 7)] for x in i],
            "label": label.astype(np.int64),
            "ts": np.arange(n),
            "event_id": np.arange(n),
        }
    )
    features = FeatureSet(
        name="pairs",
        features=[
            FeatureSpec(name="user_id", side="user", kind="sparse", table_size=users),
            FeatureSpec(name="item_id", side="item", kind="sparse", table_size=items),
            FeatureSpec(name="tags", side="item", kind="id_list", table_size=8, max_length=2),
        ],
    )
    x, categorical = tree_design(table, features)
    assert categorical == [0, 1] and x.shape == (n, 2 + 8 + 1)  # ids, tags multi-hot, length
    gbdt = gradient_boosted_trees(table.slice(0, 5000), table.slice(5000), features, False)
    assert gbdt["auc"] > 0.75 and gbdt["leaves"] >= 2 and gbdt["rounds"] >= 1


def test_a_bench_rerun_keeps_what_was_measured_on_the_same_rows_and_code(fresh_warehouse, tmp_path):
    """`make bench-1m` runs for hours: a rerun after an interruption reuses each model's
    figures measured on the same rows by the same code, and fits again where either
    differs or the kept file is damaged."""
    import json

    import pyarrow.compute as pc

    from recd_core.bench.kept import Kept, rows_digest, source_digest
    from recd_core.bench.references import logistic_regression, time_split
    from recd_core.schema import feature_set_of

    samples = fresh_warehouse.read("samples", "2026-11-01", layout="clustered")
    mask = time_split(samples, 0.8, per_user=False)
    train, held = samples.filter(pc.invert(mask)), samples.filter(mask)
    features = feature_set_of(samples.schema)
    features = features.model_copy(update={"features": [features["user_id"], features["item_id"]]})
    fits = []

    def fit(test=held) -> dict:
        fits.append(test.num_rows)
        return logistic_regression(train, test, features, per_user=False, strengths=(0.1,))

    def key(test=held) -> dict:
        return {
            "rows": rows_digest(train, test),
            "code": source_digest("recd_core.bench.references"),
        }

    first = Kept(tmp_path / "kept").figures("lr", key(), fit)
    rerun = Kept(tmp_path / "kept")
    assert rerun.figures("lr", key(), fit) == first and len(fits) == 1  # not fitted again
    assert rerun.reused[0]["model"] == "lr" and rerun.reused[0]["measured"].startswith("20")
    # a test row fewer: other rows, fitted again, and the new figures kept in its place
    fewer = held.slice(1)
    assert rows_digest(train, fewer) != rows_digest(train, held)
    Kept(tmp_path / "kept").figures("lr", key(fewer), lambda: fit(fewer))
    assert fits == [held.num_rows, held.num_rows - 1]
    Kept(tmp_path / "kept").figures("lr", key(fewer), lambda: fit(fewer))
    assert len(fits) == 2  # what is kept now is the second measurement
    assert json.loads((tmp_path / "kept/lr.json").read_text())["figures"]["auc"] > 0.5
    # a damaged file (a disk that filled up) is measured again, not a crash
    (tmp_path / "kept/lr.json").write_text('{"key": "')
    Kept(tmp_path / "kept").figures("lr", key(), fit)
    assert len(fits) == 3


def test_the_kept_figures_key_follows_the_code_a_model_imports_and_no_other(tmp_path):
    """A change to a module the reference imports (transitively) measures it again; a
    change elsewhere in the package does not throw its hours away."""
    from recd_core.bench.kept import source_digest

    pkg = tmp_path / "recd_core"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "metrics.py").write_text("def auc(): return 1\n")
    (pkg / "serving.py").write_text("def serve(): pass\n")
    (pkg / "bench/__init__.py").write_text("")
    (pkg / "bench/base.py").write_text("from recd_core import metrics\n")
    (pkg / "bench/ref.py").write_text("def fit():\n    from recd_core.bench.base import x\n")
    before = source_digest("recd_core.bench.ref", root=pkg)
    (pkg / "serving.py").write_text("def serve(): return 2\n")
    assert source_digest("recd_core.bench.ref", root=pkg) == before
    (pkg / "metrics.py").write_text("def auc(): return 2\n")  # imported by what ref imports
    assert source_digest("recd_core.bench.ref", root=pkg) != before


def test_the_movielens_tables_show_ours_and_the_best_reference_over_seeds(movielens_dir, tmp_path):
    """`recd bench --seeds 2` on a slice of MovieLens: ours and the best reference fitted
    again with another seed, the spread and ours' worst seed against the reference's best
    under the table; a rerun elsewhere pointed at the first run's kept folder reuses every
    seed's figures."""
    import shutil

    from recd_core.bench.quality import movielens_quality
    from recd_core.bench.report import movielens_markdown
    from recd_core.bench.sequential import SEQUENTIAL

    src = tmp_path / "ml-slice"
    src.mkdir()
    for suffix in ("item", "user"):
        shutil.copy(movielens_dir / f"ml-100k.{suffix}", src / f"ml-slice.{suffix}")
    lines = (movielens_dir / "ml-100k.inter").read_text().splitlines()
    kept_users = [ln for ln in lines[1:] if int(ln.split("\t")[0]) <= 40]
    (src / "ml-slice.inter").write_text("\n".join([lines[0], *kept_users]) + "\n")
    r = movielens_quality(src, tmp_path / "out", split="global", seeds=2)
    q = "bench.quality.movielens_global."
    best = r[q + "spread_reference"]
    assert r[q + "seeds"] == 2 and r[q + "ours_seeds_fitted"] == 2
    assert r[q + "ours_seeds_ne_min"] < r[q + "ours_seeds_ne_max"]  # the seed changed the fit
    assert r[q + "ours_seeds_ne_min"] <= r[q + "ne"] <= r[q + "ours_seeds_ne_max"]
    assert r[f"{q}{best}_seeds_fitted"] == (2 if best in SEQUENTIAL else 1)
    # the lead of ours' worst seed over the reference's best is never more than the table's
    assert r[q + "worst_seed_ne_gain"] <= r[q + "best_ne_gain"] + 1e-12
    assert r[q + "worst_seed_auc_gain"] <= r[q + "best_auc_gain"] + 1e-12
    md = "\n".join(movielens_markdown(r, q, "split globally"))
    assert "recd DLRM, 2 seeds: mean (lowest-highest)" in md and "worst seed over" in md
    again = movielens_quality(
        src, tmp_path / "rerun", split="global", seeds=2, kept=tmp_path / "out" / "kept"
    )
    kept = again["movielens_quality_global"]["kept"]
    assert {"ours", "ours.seed1"} <= {k["model"] for k in kept}
    assert again[q + "worst_seed_ne_gain"] == r[q + "worst_seed_ne_gain"]
