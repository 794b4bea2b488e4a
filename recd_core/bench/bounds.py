"""What the synthetic data teaches: references a model can approach, beside the oracle (which
knows what no model can: each user's and item's topic, latent vector and bias).

`learnable_bounds` gives three. The bound: the generator's own click model with the topic
match and the affinity the dense features carry handed over, and the two biases estimated
from the days trained on (a per-id logistic fit, the rest of the true logit as offset). It
is generous (a model must learn the handed-over parts too), so a model above it is short of
what the data teaches. The features alone: the same with the topic match and the affinity
read from the features (by Bayes, as the generator draws them: `topic_posterior`,
`latent_prior`) instead of handed over. The generator's model, learned: nothing handed over
but the click model's form and its priors, every term fitted to the days' clicks (MAP, the
topics mean-field): the realistic best for a model that must learn it all.
`missed_terms` says where a trained model's gap to the oracle lies, term by term."""

from __future__ import annotations

import datetime as dt

import numpy as np

from recd_core import metrics
from recd_core.config import FeatureSet, SynthConfig
from recd_core.data.synth import (
    DENSE_NOISE,
    DENSE_SIGNAL,
    IDS_PER_DAY,
    TOPIC_LEAN,
    Ragged,
    World,
    click_logit,
    generate_day,
    logit_parts,
    seen_latent_dims,
    skewed_id_probabilities,
)
from recd_core.warehouse import Warehouse


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
        opt = torch.optim.LBFGS(
            params,
            lr=1,
            max_iter=iters,
            history_size=20,
            line_search_fn="strong_wolfe",
            tolerance_grad=1e-9,
            tolerance_change=1e-12,
        )

        def closure(opt=opt, match=match):
            opt.zero_grad()
            z = off + bu[u] + bi[i] + (p[u] * q[i]).sum(1) / latent_scale
            if topics is None:
                fit = nll(z).sum()
            else:
                fit = (match * nll(z + effect) + (1 - match) * nll(z)).sum()
            prior = (
                ((p - p_mean) ** 2 / p_var).sum()
                + ((q - q_mean) ** 2 / q_var).sum()
                + ((bu**2).sum() + (bi**2).sum()) / bias_sd**2
            )
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
    fit: dict,
    users: np.ndarray,
    items: np.ndarray,
    offset: np.ndarray,
    latent_scale: float,
    effect: float = 0.0,
) -> np.ndarray:
    """P(click) of impressions under a `fit_id_terms` fit: with topics, the mixture over
    whether the two topics match (the predictive of the mean-field fit)."""
    z = (
        offset
        + fit["user_bias"][users]
        + fit["item_bias"][items]
        + (fit["P"][users] * fit["Q"][items]).sum(1) / latent_scale
    )
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

    world = World(features, synth)
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
        learned_logit = _logit(
            id_terms_probability(
                learned, day.users, day.items, _rest_of_logit(synth, day), scale, synth.topic_effect
            )
        )
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

    return click_logit(synth, 0.0, 0.0, 0.0, 0.0, day.position.astype(np.float64))


def _logit(prob: np.ndarray) -> np.ndarray:
    p = np.clip(prob, 1e-12, 1 - 1e-12)
    return np.log(p / (1 - p))


def _learned_model(
    days: dict, seen: list[str], synth: SynthConfig, priors: tuple, topics: dict, start: dict | None
) -> dict:
    """The generator's click model learned from the days seen, nothing handed over but
    its form and priors (`fit_id_terms` with each row's latent prior from its dense
    feature and each side's topic from its ids), continued from the fit of the days before."""

    def cat(f):
        return np.concatenate([f(days[d]) for d in seen])

    return fit_id_terms(
        cat(lambda d: d.users),
        cat(lambda d: d.items),
        cat(lambda d: d.labels),
        cat(lambda d: _rest_of_logit(synth, d)),
        (synth.users, synth.items, synth.latent_dim),
        bias_sd=0.5,
        latent_scale=np.sqrt(synth.latent_dim),
        iters=150,
        latent_priors=priors,
        topics=(topics["user"], topics["item"], synth.topic_effect),
        rounds=2,
        start=start,
    )


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

    from recd_core.modeling.saved import load_model, predict

    world = World(features, synth)
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


# -- what the features show of the hidden terms, by Bayes as the generator draws them
def topic_posterior(world: World, side: str) -> np.ndarray:
    """[entities, topics]: P(topic | the entity's topical ids) for each user or item, by
    Bayes from how `_topical_ids` draws them (uniform prior). An id in topic t's slice of
    its table has likelihood TOPIC_LEAN / width + (1 - TOPIC_LEAN) * P_skew(id) under t and
    (1 - TOPIC_LEAN) * P_skew(id) under any other topic, so each id adds the log of their
    ratio to its slice's topic. What a model could know of the topics from the features."""
    cfg = world.cfg
    static = world.user_static if side == "user" else world.item_static
    n = cfg.users if side == "user" else cfg.items
    score = np.zeros((n, cfg.topics))
    for spec in world.features.by_side(side):
        table = static.get(spec.name)
        width = (spec.table_size or 1) // cfg.topics
        if table is None or spec.kind not in ("sparse", "id_list") or width < 1:
            continue
        skew = (1 - TOPIC_LEAN) * skewed_id_probabilities(spec.table_size or 1)
        gain = np.log(TOPIC_LEAN / width + skew) - np.log(skew)
        if isinstance(table, Ragged):
            owner, ids = np.repeat(np.arange(n), np.diff(table.offsets)), table.values
        else:
            owner, ids = np.arange(n), table
        topic = ids // width
        ok = topic < cfg.topics
        np.add.at(score, (owner[ok], topic[ok]), gain[ids[ok]])
    score -= score.max(1, keepdims=True)
    p = np.exp(score)
    return p / p.sum(1, keepdims=True)


def latent_prior(world: World, side: str) -> tuple[np.ndarray, np.ndarray]:
    """What an entity's dense feature tells of its latent vector: ([entities, latent_dim]
    means, [latent_dim] variances) of the latent given the feature. The dimensions the
    feature carries (x = DENSE_SIGNAL * latent + DENSE_NOISE * noise, both standard normal)
    have mean DENSE_SIGNAL * x / (DENSE_SIGNAL^2 + DENSE_NOISE^2) and variance
    DENSE_NOISE^2 / (DENSE_SIGNAL^2 + DENSE_NOISE^2); the others keep the prior N(0, 1)."""
    spec = next(s for s in world.features.by_side(side) if s.kind == "dense")
    static = world.user_static if side == "user" else world.item_static
    k = min(spec.dim, world.cfg.latent_dim)
    x = np.asarray(static[spec.name][:, :k], np.float64)
    mean = np.zeros((x.shape[0], world.cfg.latent_dim))
    var = np.ones(world.cfg.latent_dim)
    mean[:, :k] = DENSE_SIGNAL * x / (DENSE_SIGNAL**2 + DENSE_NOISE**2)
    var[:k] = DENSE_NOISE**2 / (DENSE_SIGNAL**2 + DENSE_NOISE**2)
    return mean, var


def latent_posterior_mean(world: World, side: str, dims: int) -> np.ndarray:
    """[entities, dims]: E[latent | dense feature] for the first `dims` latent dimensions."""
    return latent_prior(world, side)[0][:, :dims]
