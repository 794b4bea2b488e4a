"""`recd bench`'s quality part: our model next to a reference on the same data, never alone.

Two workloads:

  MovieLens-100k, split by time   each user's first 80% of ratings (by timestamp) train, the
                                  last 20% test. Ours: DPP + training (its validation is the
                                  latest 10% of the training part, folded into the tables
                                  after it chose the state) + evaluation. References:
                                  a logistic regression (scikit-learn) on a one-hot encoding
                                  of the very same features (multi-hot for id lists and the
                                  history), and a factorization machine on the same encoding
                                  (the linear model plus an interaction for every pair of
                                  columns), each tuned on the latest 10%, then refit on the
                                  whole training part.
  synthetic, a week               each day trained on, warm-started from the previous day's
                                  model (the daily DAG starts from the champion), evaluated
                                  on the next day, against the oracle: the true click
                                  probabilities the generator drew the labels from. The first
                                  day is also trained by the baseline arm: both arms must
                                  reach the same quality.

The oracle knows what no model can: each user's and item's topic, latent vector and bias.
`learnable_bounds` gives references a model can approach. The bound: the generator's own
click model with the topic match and the affinity the dense features carry handed over, and
the two biases estimated from the days trained on (a per-id logistic fit, the rest of the
true logit as offset). It is generous (a model must learn the handed-over parts too), so a
model above it is short of what the data teaches, and an aim below it asks for the latent
parts only ids carry. The features alone: the same with the topic match and the affinity
read from the features (by Bayes, as the generator draws them) instead of handed over: a
model above it has not yet read what its features show; a model below it has learned from
ids what no feature shows. The generator's model, learned: nothing handed over but the
click model's form and its priors; each user's and item's latent vector starts from what
its dense feature shows, its topic from what its ids show (by Bayes), and every one of
them, with the biases, is fitted to the days' clicks (MAP, the topics mean-field): what a
correctly specified model reaches on the days seen, the realistic best for a model that
must learn it all.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recd_core import metrics
from recd_core.config import (
    FeatureSet,
    IngestConfig,
    PipelineConfig,
    SynthConfig,
    TrainConfig,
    load_feature_set,
    load_pipeline_config,
    synth_config,
)
from recd_core.warehouse import Warehouse

ML_ALL, ML_TRAIN, ML_TEST = "2026-10-01", "2026-10-02", "2026-10-03"
WEEK_START = "2026-11-01"


def _day(ds: str, k: int) -> str:
    return (dt.date.fromisoformat(ds) + dt.timedelta(days=k)).isoformat()


# -- the reference: one-hot logistic regression --------------------------------------------------
def one_hot(table: pa.Table, features: FeatureSet):
    """A sparse design matrix: one column per (feature, id) for id features and id lists
    (multi-hot, each list's ids weighted 1/length), dense features as they are (scaled)."""
    from scipy import sparse

    blocks = []
    for f in features.features:
        col = table[f.name].combine_chunks()
        if f.kind == "dense":
            flat = col.flatten() if pa.types.is_list(col.type) else col
            x = np.asarray(flat.fill_null(0), np.float64).reshape(table.num_rows, f.dim)
            blocks.append(sparse.csr_matrix(x))
            continue
        if pa.types.is_list(col.type):
            lengths = np.asarray(pc.list_value_length(col).fill_null(0), np.int64)
            ids = np.asarray(col.flatten().fill_null(0), np.int64)
        else:
            lengths = np.ones(table.num_rows, np.int64)
            ids = np.asarray(col.fill_null(0), np.int64)
        rows = np.repeat(np.arange(table.num_rows), lengths)
        size = f.table_size or 1
        weights = 1.0 / np.maximum(np.repeat(lengths, lengths), 1)
        blocks.append(
            sparse.csr_matrix((weights, (rows, ids % size)), shape=(table.num_rows, size))
        )
    return sparse.hstack(blocks, format="csr")


LR_C = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def scaled_design(tables: list[pa.Table], features: FeatureSet):
    """`one_hot` with each column divided by its largest magnitude over `tables` (the
    training and test parts together: the scale is a property of the encoding, not of the
    labels), as a function of a table."""
    x_all = one_hot(pa.concat_tables(tables), features)
    scale = np.maximum(abs(x_all).max(axis=0).toarray().ravel(), 1e-12)
    return lambda t: one_hot(t, features).multiply(1.0 / scale).tocsr()


def _labels(table: pa.Table) -> np.ndarray:
    return np.asarray(table["label"], np.float64)


def logistic_regression(
    train: pa.Table,
    test: pa.Table,
    features: FeatureSet,
    per_user: bool = True,
    strengths: tuple[float, ...] = LR_C,
) -> dict:
    """NE and AUC on `test` of an L2 logistic regression on one-hot features, its strength
    chosen like our early stopping: fit on the earlier 90% of `train` by time (per user, as
    the split), the C with the best NE on the latest 10%, then refit on all of `train`. A
    tuned reference, so a gain over it is real.

    `ne_calibrated`: the same model calibrated as our training calibrates its model
    (modeling/calibration.py): a slope and an offset of the logit fitted on the latest 10%
    by the earlier-90% fit, applied to the refit's logits. Our model is calibrated that
    way, so the reference gets it too."""
    from sklearn.linear_model import LogisticRegression

    from recd_core.modeling.calibration import fit_calibration

    late = time_split(train, 0.9, per_user)
    fit_rows, val_rows = train.filter(pc.invert(late)), train.filter(late)
    design = scaled_design([train, test], features)

    def fit(x, y: np.ndarray, c: float):
        return LogisticRegression(C=c, max_iter=3000).fit(x, y)

    x_fit, y_fit = design(fit_rows), _labels(fit_rows)
    x_val, y_val = design(val_rows), _labels(val_rows)
    fits = {c: fit(x_fit, y_fit, c) for c in strengths}
    val_ne = {
        c: metrics.normalized_entropy(y_val, m.predict_proba(x_val)[:, 1]) for c, m in fits.items()
    }
    best = min(val_ne, key=val_ne.get)
    calibration = fit_calibration(fits[best].decision_function(x_val), y_val)
    z = fit(design(train), _labels(train), best).decision_function(design(test))
    p, p_cal = (1.0 / (1.0 + np.exp(-v)) for v in (z, calibration.apply(z)))
    y = _labels(test)
    return {
        "ne": metrics.normalized_entropy(y, p),
        "auc": metrics.auc(y, p),
        "c": best,
        "ne_calibrated": metrics.normalized_entropy(y, p_cal),
    }


FM_L2 = (3e-4, 1e-3, 3e-3)


class FactorizationMachine:
    """Rendle's factorization machine (ICDM 2010) over a sparse design matrix x [n, d]:

        logit = b + x.w + sum over column pairs i < j of x_i x_j <v_i, v_j>
              = b + x.w + 0.5 * sum_f ((x V)_f^2 - (x^2 V^2)_f)      (the O(nnz * k) form)

    with w [d] and V [d, k]. Fit full-batch by Adam with an L2 penalty on w and V."""

    def __init__(self, d: int, k: int, seed: int = 0):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.b = torch.zeros(1, requires_grad=True)
        self.w = torch.zeros(d, requires_grad=True)
        self.v = (0.01 * torch.randn(d, k, generator=gen)).requires_grad_()

    @staticmethod
    def tensors(x) -> tuple:
        """(x, x squared) as torch CSR tensors, from a scipy matrix (CSR: ~1.5x COO's speed)."""
        import warnings

        import torch

        def csr(m):
            m = m.tocsr()
            with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
                warnings.simplefilter("ignore", UserWarning)
                return torch.sparse_csr_tensor(
                    torch.from_numpy(m.indptr.astype(np.int64)),
                    torch.from_numpy(m.indices.astype(np.int64)),
                    torch.from_numpy(m.data.astype(np.float32)),
                    m.shape,
                    check_invariants=True,
                )

        return csr(x), csr(x.power(2))

    def logit(self, xs: tuple):
        import torch

        x, x2 = xs
        xv = torch.sparse.mm(x, self.v)
        pairs = 0.5 * (xv * xv - torch.sparse.mm(x2, self.v * self.v)).sum(1)
        return self.b + torch.sparse.mm(x, self.w[:, None])[:, 0] + pairs

    def fit(self, xs: tuple, y: np.ndarray, l2: float, epochs: int, lr: float, each=None):
        """Up to `epochs` full-batch Adam steps; `each(epoch)` after every step (validation:
        returning False stops the fit)."""
        import torch

        target = torch.tensor(y, dtype=torch.float32)
        opt = torch.optim.Adam([self.b, self.w, self.v], lr=lr)
        for epoch in range(epochs):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(self.logit(xs), target)
            (loss + 0.01 * l2 * (self.w**2).sum() + l2 * (self.v**2).sum()).backward()
            opt.step()
            if each is not None and each(epoch) is False:
                break
        return self

    def predict(self, xs: tuple) -> np.ndarray:
        import torch

        with torch.no_grad():
            return torch.sigmoid(self.logit(xs)).numpy().astype(np.float64)


def factorization_machine(
    train: pa.Table,
    test: pa.Table,
    features: FeatureSet,
    per_user: bool = True,
    k: int = 32,
    strengths: tuple[float, ...] = FM_L2,
    max_epochs: int = 200,
    lr: float = 0.02,
    patience: int = 15,
) -> dict:
    """NE and AUC on `test` of a factorization machine on the logistic regression's design:
    the linear model plus a learned interaction for every pair of one-hot columns (user x
    item, history x item, ...), as DeepFM's FM part. The classical reference for what
    pairwise interactions of these features add; tuned like the logistic regression: the L2
    strength and the number of passes with the best NE on the latest 10% of `train` (a
    strength's fit stops `patience` passes after its best), then refit on all of it for that
    many passes."""
    late = time_split(train, 0.9, per_user)
    fit_rows, val_rows = train.filter(pc.invert(late)), train.filter(late)
    design = scaled_design([train, test], features)
    x_fit, x_val = (
        FactorizationMachine.tensors(design(fit_rows)),
        FactorizationMachine.tensors(design(val_rows)),
    )
    d = x_fit[0].shape[1]
    y_val = _labels(val_rows)
    best = (np.inf, None, 0)  # (validation NE, l2, passes)
    for l2 in strengths:
        fm, mine = FactorizationMachine(d, k), [np.inf, 0]  # this strength's best NE, pass

        def each(epoch: int, fm=fm, mine=mine) -> bool:
            ne = metrics.normalized_entropy(y_val, fm.predict(x_val))
            if ne < mine[0]:
                mine[:] = [ne, epoch + 1]
            return epoch + 1 - mine[1] < patience

        fm.fit(x_fit, _labels(fit_rows), l2, max_epochs, lr, each)
        if mine[0] < best[0]:
            best = (mine[0], l2, mine[1])
    _, l2, passes = best
    fm = FactorizationMachine(d, k).fit(
        FactorizationMachine.tensors(design(train)), _labels(train), l2, passes, lr
    )
    p, y = fm.predict(FactorizationMachine.tensors(design(test))), _labels(test)
    return {"ne": metrics.normalized_entropy(y, p), "auc": metrics.auc(y, p), "l2": l2,
            "passes": passes}  # fmt: skip


# -- MovieLens split by time ------------------------------------------------------------------------
def time_split(samples: pa.Table, train_share: float, per_user: bool) -> pa.Array:
    """The test rows of a split by time: the latest `1 - train_share` of all rows, or with
    `per_user` of each user's rows (every user is in both parts, as in RecBole's
    time-ordered split grouped by user)."""
    ts = np.asarray(samples["ts"], np.int64)
    if not per_user:
        cut = np.sort(ts)[int(ts.size * train_share)]
        return pa.array(ts >= cut)
    users = np.asarray(samples["user_id"], np.int64)
    order = np.lexsort((np.asarray(samples["event_id"], np.int64), ts, users))
    starts = np.flatnonzero(np.r_[True, users[order][1:] != users[order][:-1]])
    counts = np.diff(np.r_[starts, users.size])
    rank = np.arange(users.size) - np.repeat(starts, counts)  # position in the user's timeline
    test = np.zeros(users.size, bool)
    test[order] = rank >= np.repeat(np.floor(counts * train_share), counts)
    return pa.array(test)


def movielens_quality(
    source: Path, out: Path, train_cfg: TrainConfig | None = None, per_user: bool = True
) -> dict:
    """Ours vs logistic regression on MovieLens ratings split by time (80/20)."""
    from recd_core.data.generate import generate, write_samples
    from recd_core.data.ingest import ingest
    from recd_core.dpp.preprocess import preprocess
    from recd_core.modeling.evaluate import evaluate
    from recd_core.modeling.train import train

    wh = Warehouse(_fresh(out / "movielens-quality"))
    pipeline = load_pipeline_config(dataset="movielens")
    ingest(
        source, wh, ML_ALL, pipeline.features, IngestConfig(format="movielens"), pipeline.generate
    )
    generate(wh, ML_ALL, pipeline.generate, layouts=("clustered",))
    samples = wh.read("samples", ML_ALL, layout="clustered")
    late = time_split(samples, 0.8, per_user)
    train_rows, test_rows = samples.filter(pc.invert(late)), samples.filter(late)
    write_samples(wh, ML_TRAIN, "clustered", train_rows, pipeline.generate)
    write_samples(wh, ML_TEST, "clustered", test_rows, pipeline.generate)
    cfg = train_cfg or pipeline.train
    by = "user" if per_user else "time"  # validate like the test split
    prep = pipeline.preprocess.model_copy(
        update={"batch_size": cfg.batch_size, "validation_by": by}
    )
    preprocess(wh, ML_TRAIN, prep)
    trained = train(wh, ML_TRAIN, cfg)
    ours = evaluate(wh, trained["train.model_uri"], ML_TEST)
    lr = logistic_regression(train_rows, test_rows, pipeline.features, per_user)
    fm = factorization_machine(train_rows, test_rows, pipeline.features, per_user)
    return {
        "bench.quality.movielens.ne": ours["eval.ne"],
        "bench.quality.movielens.auc": ours["eval.auc"],
        "bench.quality.movielens.lr_ne": lr["ne"],
        "bench.quality.movielens.lr_auc": lr["auc"],
        "bench.quality.movielens.lr_c": lr["c"],
        "bench.quality.movielens.lr_calibrated_ne": lr["ne_calibrated"],
        "bench.quality.movielens.auc_gain": ours["eval.auc"] - lr["auc"],
        "bench.quality.movielens.ne_gain": lr["ne"] - ours["eval.ne"],
        "bench.quality.movielens.fm_ne": fm["ne"],
        "bench.quality.movielens.fm_auc": fm["auc"],
        "bench.quality.movielens.fm_l2": fm["l2"],
        "bench.quality.movielens.fm_passes": fm["passes"],
        "movielens_quality": {
            "train_rows": train_rows.num_rows,
            "test_rows": test_rows.num_rows,
            "test_ctr": ours["eval.ctr"],
            "epochs_trained": trained["train.steps"] / max(trained["train.steps_per_epoch"], 1),
            "best_step": trained.get("train.best_step"),
            "val_ne": trained.get("train.val_ne"),
        },
    }


# -- what the data teaches: the learnable bound ---------------------------------------------------
def _bias_estimate(
    ids: np.ndarray, labels: np.ndarray, offset: np.ndarray, n: int, prior_sd: float
) -> np.ndarray:
    """Per-id bias, MAP under N(0, prior_sd^2), by Newton steps (labels ~ offset + bias)."""
    b = np.zeros(n)
    for _ in range(25):
        p = 1.0 / (1.0 + np.exp(-(offset + b[ids])))
        grad = np.bincount(ids, labels - p, n) - b / prior_sd**2
        hess = np.bincount(ids, p * (1 - p), n) + 1.0 / prior_sd**2
        b += grad / hess
    return b


def fit_id_terms(
    users: np.ndarray,
    items: np.ndarray,
    labels: np.ndarray,
    offset: np.ndarray,
    shape: tuple[int, int, int],
    bias_sd: float,
    latent_scale: float,
    iters: int = 400,
    *,
    latent_priors: tuple | None = None,
    topics: tuple | None = None,
    rounds: int = 1,
    start: dict | None = None,
) -> dict[str, np.ndarray]:
    """The ids' own terms of a click model, MAP from impressions whose other terms are
    `offset`:

        logit = offset + user_bias[u] + item_bias[i] + <P[u], Q[i]> / latent_scale
                [+ effect * (topic[u] == topic[i])]

    with user_bias, item_bias ~ N(0, bias_sd^2) and P [users, k], Q [items, k] normal, by
    default standard normal as the generator draws them; `latent_priors` = (P mean
    [users, k], P variances [k], Q mean, Q variances) gives each row its own prior (what
    the dense features show of it: `synth.latent_prior`). `topics` = (user topic prior
    [users, T], item topic prior [items, T], effect) adds the topic match with each side's
    topic unknown: mean-field, each user's and item's topic a distribution that starts at
    its prior (what its ids show: `synth.topic_posterior`) and takes its clicks' evidence,
    alternating `rounds` times with the fit of the rest (the expected log likelihood over
    both topics). Full-batch L-BFGS in float64 (converged: 1,500 iterations give the same
    next-day NE to 1e-4 as 400 on the standard preset's week). `shape` is (users, items,
    k); `start` a previous fit to continue from (a later day's fit from the days before).
    Returns `user_bias`, `item_bias`, `P`, `Q` (and `user_topic`, `item_topic` with
    `topics`)."""
    import torch

    def t(a):
        return torch.as_tensor(np.asarray(a), dtype=torch.float64)

    n_users, n_items, k = shape
    u, i = torch.as_tensor(users, dtype=torch.long), torch.as_tensor(items, dtype=torch.long)
    y, off = t(labels), t(offset)
    if latent_priors is None:
        p_mean, p_var = torch.zeros(n_users, k, dtype=torch.float64), torch.ones(k)
        q_mean, q_var = torch.zeros(n_items, k, dtype=torch.float64), torch.ones(k)
    else:
        p_mean, p_var, q_mean, q_var = (t(a) for a in latent_priors)
    if start is not None:
        p, q, bu, bi = (t(start[key]).clone() for key in ("P", "Q", "user_bias", "item_bias"))
    else:
        gen = torch.Generator().manual_seed(0)  # a small random start: zero is a saddle of <P, Q>
        p = p_mean + 0.1 * torch.randn(n_users, k, generator=gen, dtype=torch.float64)
        q = q_mean + 0.1 * torch.randn(n_items, k, generator=gen, dtype=torch.float64)
        bu, bi = (
            torch.zeros(n_users, dtype=torch.float64),
            torch.zeros(n_items, dtype=torch.float64),
        )
    params = [x.requires_grad_() for x in (p, q, bu, bi)]
    match, effect = torch.zeros_like(y), 0.0
    if topics is not None:
        prior_u, prior_i, effect = t(topics[0]), t(topics[1]), float(topics[2])
        qu, qi = (t(start["user_topic"]), t(start["item_topic"])) if start else (prior_u, prior_i)
        log_u, log_i = (torch.log(x.clamp_min(1e-300)) for x in (prior_u, prior_i))

    def nll(logit):
        return torch.nn.functional.binary_cross_entropy_with_logits(logit, y, reduction="none")

    for _ in range(rounds):
        if topics is not None:
            match = (qu[u] * qi[i]).sum(1)  # P(same topic) under the current distributions
        opt = torch.optim.LBFGS(params, lr=1, max_iter=iters, history_size=20,
                                line_search_fn="strong_wolfe", tolerance_grad=1e-9,
                                tolerance_change=1e-12)  # fmt: skip

        def closure(opt=opt, match=match):
            opt.zero_grad()
            z = off + bu[u] + bi[i] + (p[u] * q[i]).sum(1) / latent_scale
            if topics is None:
                fit = nll(z).sum()
            else:
                fit = (match * nll(z + effect) + (1 - match) * nll(z)).sum()
            prior = (((p - p_mean) ** 2 / p_var).sum() + ((q - q_mean) ** 2 / q_var).sum()
                     + ((bu**2).sum() + (bi**2).sum()) / bias_sd**2)  # fmt: skip
            loss = fit + 0.5 * prior
            loss.backward()
            return loss

        opt.step(closure)
        if topics is not None:  # each side's topic given its impressions and the other side's
            with torch.no_grad():
                z = off + bu[u] + bi[i] + (p[u] * q[i]).sum(1) / latent_scale
                gain = nll(z) - nll(z + effect)  # log-likelihood gain of a match, per row
                qu = torch.softmax(log_u.index_add(0, u, qi[i] * gain[:, None]), 1)
                qi = torch.softmax(log_i.index_add(0, i, qu[u] * gain[:, None]), 1)
    out = {"user_bias": bu, "item_bias": bi, "P": p, "Q": q}
    if topics is not None:
        out |= {"user_topic": qu, "item_topic": qi}
    return {key: v.detach().numpy() for key, v in out.items()}


def id_terms_probability(
    fit: dict, users: np.ndarray, items: np.ndarray, offset: np.ndarray, latent_scale: float,
    effect: float = 0.0,
) -> np.ndarray:  # fmt: skip
    """P(click) of impressions under a `fit_id_terms` fit: with topics, the mixture over
    whether the two topics match (the predictive of the mean-field fit)."""
    z = (offset + fit["user_bias"][users] + fit["item_bias"][items]
         + (fit["P"][users] * fit["Q"][items]).sum(1) / latent_scale)  # fmt: skip
    sigmoid = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
    if "user_topic" not in fit:
        return sigmoid(z)
    match = (fit["user_topic"][users] * fit["item_topic"][items]).sum(1)
    return match * sigmoid(z + effect) + (1 - match) * sigmoid(z)


def learnable_bounds(
    features: FeatureSet, synth: SynthConfig, train_days: list[str], eval_days: list[str]
) -> list[dict[str, float]]:
    """For each k, three references on `eval_days[k]`, learned from `train_days[: k + 1]`
    (the days a warm-started model has seen), each scored after a logistic regression of
    the evaluated day's labels on its terms (a generous calibration, the same for all):

      bound     the generator's click model given the true topic match, the true affinity
                the dense features carry and the position (generous: a model must learn
                those; it leaves out the affinity only item ids carry)
      features  the same model given only what the features show of those: the topic
                match as P(same topic) from each side's topic posterior (`topic_posterior`:
                the topical ids, by Bayes) and the affinity from the latents' posterior
                means given the dense features. What a model that used the features
                perfectly, and learned nothing from ids but the biases, would reach; ids
                learned over days can take a model past it
      learned   the generator's click model with nothing handed over but its form and
                priors, every term learned from the days seen (`_learned_model`); each
                day's fit continues from the day before's"""
    from sklearn.linear_model import LogisticRegression

    from recd_core.data.synth import (
        _World,
        click_logit,
        generate_day,
        latent_posterior_mean,
        latent_prior,
        logit_parts,
        seen_latent_dims,
        topic_posterior,
    )

    world = _World(features, synth)
    days = {
        d: generate_day(world, dt.date.fromisoformat(d)) for d in sorted({*train_days, *eval_days})
    }
    parts = {d: logit_parts(world, day) for d, day in days.items()}
    # the true logit without the two biases (the parts estimated)
    base = {
        d: click_logit(
            synth, p["topic_match"], p["affinity_seen"] + p["affinity_ids"], 0.0, 0.0, p["position"]
        )
        for d, p in parts.items()
    }
    topics = {side: topic_posterior(world, side) for side in ("user", "item")}
    seen_dims = seen_latent_dims(world)
    latents = {side: latent_posterior_mean(world, side, seen_dims) for side in ("user", "item")}
    priors = (*latent_prior(world, "user"), *latent_prior(world, "item"))
    out, learned = [], None
    for k, eval_day in enumerate(eval_days):
        seen = train_days[: k + 1]
        learned = _learned_model(days, seen, synth, priors, topics, learned)
        estimates = []
        for side, ids_of, n in (("user", "users", synth.users), ("item", "items", synth.items)):
            other = "item" if side == "user" else "user"
            ids = np.concatenate([getattr(days[d], ids_of) for d in seen])
            labels = np.concatenate([days[d].labels for d in seen])
            offset = np.concatenate([base[d] + parts[d][f"{other}_bias"] for d in seen])
            estimates.append(_bias_estimate(ids, labels, offset, n, prior_sd=0.5))
        day, p = days[eval_day], parts[eval_day]
        rest = [p["position"], estimates[0][day.users], estimates[1][day.items]]
        shown_match = (topics["user"][day.users] * topics["item"][day.items]).sum(1)
        shown_affinity = (latents["user"][day.users] * latents["item"][day.items]).sum(1)

        def ne(columns: list[np.ndarray], day=day) -> float:
            x = np.stack(columns, axis=1)
            fit = LogisticRegression(C=1e6, max_iter=2000).fit(x, day.labels)
            return float(metrics.normalized_entropy(day.labels, fit.predict_proba(x)[:, 1]))

        scale = np.sqrt(synth.latent_dim)
        learned_logit = _logit(id_terms_probability(
            learned, day.users, day.items, _rest_of_logit(synth, day), scale, synth.topic_effect
        ))  # fmt: skip
        out.append(
            {
                "bound": ne([p["topic_match"], p["affinity_seen"], *rest]),
                "features": ne([shown_match, shown_affinity / scale, *rest]),
                "learned": ne([learned_logit]),
            }
        )
    return out


def _rest_of_logit(synth: SynthConfig, day) -> np.ndarray:
    """The click logit's terms that are neither an entity's nor its topic's: the base
    rate and the position."""
    from recd_core.data.synth import click_logit

    return click_logit(synth, 0.0, 0.0, 0.0, 0.0, day.position.astype(np.float64))


def _logit(prob: np.ndarray) -> np.ndarray:
    p = np.clip(prob, 1e-12, 1 - 1e-12)
    return np.log(p / (1 - p))


def _learned_model(
    days: dict, seen: list[str], synth: SynthConfig, priors: tuple, topics: dict,
    start: dict | None,
) -> dict:  # fmt: skip
    """The generator's click model learned from the days seen, nothing handed over but
    its form and priors (`fit_id_terms` with each row's latent prior from its dense
    feature and each side's topic from its ids), continued from the fit of the days before."""

    def cat(f):
        return np.concatenate([f(days[d]) for d in seen])

    return fit_id_terms(
        cat(lambda d: d.users), cat(lambda d: d.items), cat(lambda d: d.labels),
        cat(lambda d: _rest_of_logit(synth, d)), (synth.users, synth.items, synth.latent_dim),
        bias_sd=0.5, latent_scale=np.sqrt(synth.latent_dim), iters=150, latent_priors=priors,
        topics=(topics["user"], topics["item"], synth.topic_effect), rounds=2, start=start,
    )  # fmt: skip


def missed_terms(
    warehouse: Warehouse, model_uri: str, eval_day: str, features: FeatureSet, synth: SynthConfig
) -> dict[str, float]:
    """Where a model's gap to the oracle lies, term by term. The model's logit on the
    evaluated day, with one true term of the generator's click logit beside it, is refit as
    a logistic regression on half of the day's rows and scored (NE) on the other half: the
    term whose addition lowers NE most is the one the model learned least. Keys: `model`
    (the model alone, recalibrated the same way), each term of `synth.logit_parts`, and
    `all` (every term: near the oracle)."""
    from sklearn.linear_model import LogisticRegression

    from recd_core.data.synth import IDS_PER_DAY, _World, generate_day, logit_parts
    from recd_core.modeling.saved import load_model, predict

    world = _World(features, synth)
    day = generate_day(world, dt.date.fromisoformat(eval_day))
    samples = warehouse.read("samples", eval_day, layout="clustered")
    model, meta = load_model(model_uri)
    p = np.clip(predict(model, meta, samples).astype(np.float64), 1e-7, 1 - 1e-7)
    rows = (
        np.asarray(samples["event_id"]) - dt.date.fromisoformat(eval_day).toordinal() * IDS_PER_DAY
    )
    labels = day.labels[rows]
    parts = {k: v[rows] for k, v in logit_parts(world, day).items()}
    logit = np.log(p / (1 - p))
    fit_half = np.arange(labels.size) % 2 == 0

    def ne_with(terms: list[str]) -> float:
        x = np.stack([logit, *(parts[t] for t in terms)], axis=1)
        fit = LogisticRegression(C=1e6, max_iter=3000).fit(x[fit_half], labels[fit_half])
        scored = fit.predict_proba(x[~fit_half])[:, 1]
        return float(metrics.normalized_entropy(labels[~fit_half], scored))

    return {"model": ne_with([]), **{t: ne_with([t]) for t in parts}, "all": ne_with(list(parts))}


# -- a synthetic week, warm-started day after day ----------------------------------------------------
def synthetic_week(
    out: Path, preset: str = "standard", days: int = 7, both_arms: bool = True
) -> dict:
    """`days` daily runs, each warm-started from the previous day's model, each evaluated on
    its next day next to the oracle; the first day also by the baseline arm."""
    from recd_core.data.generate import generate
    from recd_core.data.ingest import ingest
    from recd_core.data.synth import eval_oracle, logs_for_day, synthesize_missing
    from recd_core.dpp.preprocess import preprocess
    from recd_core.modeling.evaluate import evaluate
    from recd_core.modeling.train import train

    root = _fresh(out / "week")
    wh, logs = Warehouse(root / "warehouse"), root / "logs"
    pipeline = PipelineConfig(features=load_feature_set("synthetic"), synth=synth_config(preset))
    all_days = [_day(WEEK_START, k) for k in range(days + 1)]
    synthesize_missing(logs, all_days, pipeline.features, pipeline.synth)
    for day in all_days:
        ingest(logs_for_day(logs, day), wh, day, pipeline.features, pipeline.ingest,
               pipeline.generate)  # fmt: skip
        generate(wh, day, pipeline.generate, layouts=("clustered",))
    rows, previous = [], None
    for day, eval_day in zip(all_days[:-1], all_days[1:], strict=True):
        preprocess(wh, day, pipeline.preprocess)
        trained = train(wh, day, pipeline.train, init_from=previous)
        scored = evaluate(wh, trained["train.model_uri"], eval_day)
        oracle = eval_oracle(logs, eval_day)
        rows.append(
            {
                "day": day,
                "eval_day": eval_day,
                "init": "warm" if trained["train.init_from"] else "scratch",
                "ne": scored["eval.ne"],
                "auc": scored["eval.auc"],
                "oracle_ne": oracle["eval.oracle_ne"],
                "oracle_auc": oracle["eval.oracle_auc"],
                "gap": scored["eval.ne"] - oracle["eval.oracle_ne"],
                "steps": trained["train.steps"],
                "best_step": trained.get("train.best_step"),
            }
        )
        previous = trained["train.model_uri"]
        if len(rows) in (1, days):  # where the first and the last model's gaps lie
            rows[-1]["missed"] = missed_terms(
                wh, previous, eval_day, pipeline.features, pipeline.synth
            )
    bounds = learnable_bounds(pipeline.features, pipeline.synth, all_days[:-1], all_days[1:])
    for row, bound in zip(rows, bounds, strict=True):
        row["bound_ne"], row["features_ne"], row["learned_ne"] = (
            bound["bound"], bound["features"], bound["learned"])  # fmt: skip
    result = {
        "bench.quality.week.first_ne": rows[0]["ne"],
        "bench.quality.week.first_gap": rows[0]["gap"],
        "bench.quality.week.last_ne": rows[-1]["ne"],
        "bench.quality.week.last_gap": rows[-1]["gap"],
        "bench.quality.week.last_oracle_ne": rows[-1]["oracle_ne"],
        "bench.quality.week.first_bound_ne": bounds[0]["bound"],
        "bench.quality.week.last_bound_ne": bounds[-1]["bound"],
        "bench.quality.week.first_features_ne": bounds[0]["features"],
        "bench.quality.week.last_features_ne": bounds[-1]["features"],
        "bench.quality.week.first_learned_ne": bounds[0]["learned"],
        "bench.quality.week.last_learned_ne": bounds[-1]["learned"],
        "week": rows,
    }
    if both_arms:
        day, eval_day = all_days[0], all_days[1]
        base_prep = pipeline.preprocess.model_copy(update={"mode": "baseline"})
        preprocess(wh, day, base_prep)
        base = train(wh, day, pipeline.train.model_copy(update={"mode": "baseline"}))
        base_ne = evaluate(wh, base["train.model_uri"], eval_day)["eval.ne"]
        result["bench.quality.week.baseline_first_ne"] = base_ne
        result["bench.quality.week.arms_ne_gap"] = abs(base_ne - rows[0]["ne"])
    return result


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
