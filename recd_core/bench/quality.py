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
                                  columns), gradient-boosted trees (LightGBM), and the
                                  sequential CTR models practitioners know (DIN, DCN-v2,
                                  SIM: bench/sequential.py), each tuned on the latest
                                  10%, then refit on the whole training part. The same
                                  again split globally by time (`SPLITS`).
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
import time
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from recd_core.bench.bounds import learnable_bounds, missed_terms
from recd_core.bench.kept import Kept, rows_digest, source_digest
from recd_core.bench.references import (
    factorization_machine,
    gradient_boosted_trees,
    logistic_regression,
    time_split,
)
from recd_core.bench.sequential import SEQUENTIAL, sequential_reference
from recd_core.config import FeatureSet, IngestConfig, TrainConfig
from recd_core.config_files import load_pipeline_config
from recd_core.data.generate import generate, write_samples
from recd_core.data.ingest import ingest
from recd_core.data.movielens import release_name
from recd_core.modeling.evaluate import evaluate
from recd_core.orchestration.overlay import pipeline_config
from recd_core.orchestration.stage_args import parse_args
from recd_core.orchestration.stages import run_stage
from recd_core.warehouse import Warehouse

ML_ALL, ML_TRAIN, ML_TEST = "2026-10-01", "2026-10-02", "2026-10-03"
WEEK_START = "2026-11-01"


def _day(ds: str, k: int) -> str:
    return (dt.date.fromisoformat(ds) + dt.timedelta(days=k)).isoformat()


# -- MovieLens split by time ------------------------------------------------------------------------
# the two splits by time: (keys' prefix, per user?, the training share, its words)
SPLITS = {
    "user": ("bench.quality.movielens.", True, 0.8, "split by time per user (80/20)"),
    # what daily retraining meets: everything before a moment trains, everyone's next
    # ratings test
    "global": (
        "bench.quality.movielens_global.",
        False,
        0.9,
        "split globally by time (the latest tenth tests)",
    ),
}


def movielens_quality(
    source: Path,
    out: Path,
    train_cfg: TrainConfig | None = None,
    split: str = "user",
    seeds: int = 1,
    kept: Path | None = None,
) -> dict:
    """Ours vs the references (`REFERENCES`: logistic regression, factorization machine,
    gradient-boosted trees, DIN, DCN-v2, SIM) on MovieLens ratings split by time (`SPLITS`:
    each user's latest 20% test, or the latest tenth of all ratings): ml-100k, ml-1m or any
    release the adapter reads, with the built-in configuration (it scales with the data).
    The references tune on the latest tenth of the training part, split the same way; ours
    validates on it. `seeds` > 1: ours and the best reference fitted again with other
    seeds (`seed_spread`), so a lead is read against the spread of a single fit. `kept`:
    where each model's figures are kept as it finishes (`<out>/kept` unless given;
    bench/kept.py)."""
    q, per_user, share, _ = SPLITS[split]
    from recd_core.dpp.preprocess import preprocess
    from recd_core.modeling.train import train

    wh = Warehouse(_fresh(out / f"movielens-quality-{split}"))
    pipeline = load_pipeline_config(dataset="movielens")
    ingest(
        source, wh, ML_ALL, pipeline.features, IngestConfig(format="movielens"), pipeline.generate
    )
    generate(wh, ML_ALL, pipeline.generate, layouts=("clustered",))
    samples = wh.read("samples", ML_ALL, layout="clustered")
    late = time_split(samples, share, per_user)
    train_rows, test_rows = samples.filter(pc.invert(late)), samples.filter(late)
    write_samples(wh, ML_TRAIN, "clustered", train_rows, pipeline.generate)
    write_samples(wh, ML_TEST, "clustered", test_rows, pipeline.generate)
    cfg = train_cfg or pipeline.train
    kept = Kept((kept or out / "kept") / split)  # each model's figures, as it finishes
    rows = rows_digest(train_rows, test_rows)
    features = pipeline.features.model_dump(mode="json")

    def fit_ours(cfg: TrainConfig = cfg) -> dict:
        by = "user" if per_user else "time"  # validate like the test split
        prep = pipeline.preprocess.model_copy(
            update={"batch_size": cfg.batch_size, "validation_by": by}
        )
        preprocess(wh, ML_TRAIN, prep)
        trained = train(wh, ML_TRAIN, cfg)
        scored = evaluate(wh, trained["train.model_uri"], ML_TEST)
        return {
            **{k: scored["eval." + k] for k in ("ne", "auc", "logloss", "ctr")},
            **{
                k: trained["train." + k]
                for k in ("seconds", "samples_per_s", "batch_size", "members")
            },
            "epochs_trained": trained["train.steps"] / max(trained["train.steps_per_epoch"], 1),
            "best_step": trained.get("train.best_step"),
            "val_ne": trained.get("train.val_ne"),
        }

    def ours_key(cfg: TrainConfig) -> dict:
        return {
            "rows": rows,
            "features": features,
            "train": cfg.model_dump(mode="json"),
            "preprocess": pipeline.preprocess.model_dump(mode="json"),
            "code": source_digest(*OURS_CODE),
        }

    ours = kept.figures("ours", ours_key(cfg), fit_ours)
    refs = references(
        train_rows, test_rows, pipeline.features, per_user, ours["batch_size"], kept, rows
    )
    runs = {"ours": [ours]}
    best = min(refs, key=lambda name: refs[name]["ne"])
    runs[best] = [refs[best]]
    for seed in range(1, seeds):
        again = _reseeded(cfg, seed)
        runs["ours"].append(
            kept.figures(f"ours.seed{seed}", ours_key(again), partial(fit_ours, again))
        )
        if best in SEQUENTIAL:  # the others fit the same model from the same rows each time
            runs[best].append(
                reference_again(
                    best,
                    refs[best],
                    seed,
                    train_rows,
                    test_rows,
                    pipeline.features,
                    per_user,
                    kept,
                    rows,
                )
            )
    h = ours["logloss"] / ours["ne"]  # the test rows' click entropy
    best_ne = refs[best]["ne"]
    best_auc = max(r["auc"] for r in refs.values())
    result = {
        q + "data": release_name(source),
        q + "ne": ours["ne"],
        q + "auc": ours["auc"],
        q + "logloss": ours["logloss"],
        # log loss = NE x this (the test rows' click entropy): every model's, same rows
        q + "test_entropy": h,
        q + "lr_calibrated_ne": refs["lr"].pop("ne_calibrated"),
        q + "auc_gain": ours["auc"] - refs["lr"]["auc"],
        q + "ne_gain": refs["lr"]["ne"] - ours["ne"],
    }
    for name, ref in refs.items():  # lr_ne, lr_auc, lr_c, ..., din_ne, din_lr, ...
        ref.setdefault("logloss", ref["ne"] * h)
        result.update({f"{q}{name}_{k}": v for k, v in ref.items()})
    result.update(
        {
            # ours against the best reference of any kind, figure by figure
            q + "best_ne_gain": best_ne - ours["ne"],
            q + "best_auc_gain": ours["auc"] - best_auc,
            q + "train_minutes": ours["seconds"] / 60,
            q + "train_samples_per_s": ours["samples_per_s"],
            q + "batch_size": ours["batch_size"],
            q + "members": ours["members"],
            **(seed_spread(q, runs, best) if seeds > 1 else {}),
            # the models an earlier run measured on these rows with this code (bench.md says when)
            q + "kept": ", ".join(k["model"] for k in kept.reused) or "none",
            f"movielens_quality_{split}": {
                "train_rows": train_rows.num_rows,
                "test_rows": test_rows.num_rows,
                "test_ctr": ours["ctr"],
                "epochs_trained": ours["epochs_trained"],
                "best_step": ours["best_step"],
                "val_ne": ours["val_ne"],
                # models whose figures an earlier run on the same rows and code measured
                "kept": kept.reused,
            },
        }
    )
    return result


# the references, each tuned on the latest tenth of the training part, then refit on all of
# it; in the order the bench's tables list them
REFERENCES = ("lr", "fm", "gbdt", *SEQUENTIAL)


# the code each model's figures depend on (`source_digest` adds what these import)
OURS_CODE = ("recd_core.dpp.preprocess", "recd_core.modeling.train", "recd_core.modeling.evaluate")


def references(
    train: pa.Table,
    test: pa.Table,
    features: FeatureSet,
    per_user: bool,
    batch: int,
    kept: Kept | None = None,
    rows: str | None = None,
) -> dict:
    """Every reference's figures on `test` (`REFERENCES`), each with its `minutes` of
    tuning and refitting on this machine; the sequential ones in ours' `batch`. With
    `kept`, a reference measured before on the same rows (`rows`: their digest) by the
    same code is not fitted again."""
    fits = {
        "lr": logistic_regression,
        "fm": factorization_machine,
        "gbdt": gradient_boosted_trees,
        **{name: partial(sequential_reference, name, batch=batch) for name in SEQUENTIAL},
    }
    out = {}
    if kept is not None:
        shared = _reference_key(train, test, features, per_user, batch, rows)
    for name in REFERENCES:
        fit = partial(_timed, fits[name], train, test, features, per_user)
        if kept is None:
            out[name] = fit()
            continue
        code = getattr(fits[name], "func", fits[name]).__module__
        out[name] = kept.figures(name, {**shared, "code": source_digest(code)}, fit)
    return out


def _timed(fit, *args, **kwargs) -> dict:
    """A reference's figures with the `minutes` its tuning and refitting took here."""
    started = time.perf_counter()
    figures = fit(*args, **kwargs)
    return {**figures, "minutes": (time.perf_counter() - started) / 60}


def _reference_key(
    train, test, features: FeatureSet, per_user: bool, batch: int, rows: str | None
) -> dict:
    """What every reference's kept figures depend on besides its code and its seed."""
    return {
        "rows": rows or rows_digest(train, test),
        "per_user": per_user,
        "batch": batch,
        "features": features.model_dump(mode="json"),
    }


def _reseeded(cfg: TrainConfig, seed: int) -> TrainConfig:
    """Ours' training with the `seed`-th other seed: every member's seed (seed, seed + 1,
    ... one per member) apart from the first fit's and from each other seed's."""
    return cfg.model_copy(update={"seed": cfg.seed + seed * 16})  # 16: members' maximum


def reference_again(
    name: str,
    tuned: dict,
    seed: int,
    train: pa.Table,
    test: pa.Table,
    features: FeatureSet,
    per_user: bool,
    kept: Kept,
    rows: str,
) -> dict:
    """A sequential reference fitted again with another `seed` at the learning rate its
    tuning chose (the steps chosen again on the latest tenth, as the first fit chose
    them): the spread of one fit of the same reference, kept like its first figures."""
    key = {
        **_reference_key(train, test, features, per_user, tuned["batch"], rows),
        "code": source_digest(sequential_reference.__module__),
        "seed": seed,
        "lr": tuned["lr"],
    }

    fit = partial(
        _timed,
        sequential_reference,
        name,
        train,
        test,
        features,
        per_user,
        batch=tuned["batch"],
        learning_rates=(tuned["lr"],),
        seed=seed,
    )
    return kept.figures(f"{name}.seed{seed}", key, fit)


def seed_spread(q: str, runs: dict[str, list[dict]], best: str) -> dict:
    """Ours' and the best reference's figures over their seeds (`runs`: each model's fits,
    the table's first): the mean, lowest and highest NE, log loss and AUC of each, and
    ours' worst seed against the reference's best seed, figure by figure. A lead that
    holds there is no lucky draw of either. The logistic regression, the factorization
    machine and LightGBM fit the same model from the same rows every time: one fit each."""
    out = {q + "seeds": len(runs["ours"]), q + "spread_reference": best}
    for model, fits in runs.items():
        for k in ("ne", "logloss", "auc"):
            values = [f[k] for f in fits]
            out.update(
                {
                    f"{q}{model}_seeds_{k}_mean": sum(values) / len(values),
                    f"{q}{model}_seeds_{k}_min": min(values),
                    f"{q}{model}_seeds_{k}_max": max(values),
                }
            )
        out[f"{q}{model}_seeds_fitted"] = len(fits)
        out[f"{q}{model}_seeds_minutes"] = sum(
            f.get("minutes", f.get("seconds", 0) / 60) for f in fits[1:]
        )
    theirs = f"{q}{best}_seeds_"
    out[q + "worst_seed_ne_gain"] = out[theirs + "ne_min"] - out[q + "ours_seeds_ne_max"]
    out[q + "worst_seed_logloss_gain"] = (
        out[theirs + "logloss_min"] - out[q + "ours_seeds_logloss_max"]
    )
    out[q + "worst_seed_auc_gain"] = out[q + "ours_seeds_auc_min"] - out[theirs + "auc_max"]
    return out


# -- a synthetic week, warm-started day after day ----------------------------------------------------
def synthetic_week(
    out: Path, preset: str = "standard", days: int = 7, both_arms: bool = True
) -> dict:
    """`days` daily runs, each warm-started from the previous day's model, each evaluated on
    its next day next to the oracle; the first day also by the baseline arm. Every stage
    runs as the pipelines run it (`stages.run_stage`, the built-in config at `preset`)."""

    root = _fresh(out / "week")
    run = {"warehouse": str(root / "warehouse"), "logs": str(root / "logs"), "preset": preset}
    all_days = [_day(WEEK_START, k) for k in range(days + 1)]
    every_day = {**run, "ds": WEEK_START, "days": days, "days_of": "run"}
    run_stage("synth", every_day)
    run_stage("ingest", every_day)
    run_stage("generate", {**every_day, "layout": "clustered"})
    pipeline = pipeline_config(parse_args({**run, "ds": WEEK_START}))  # the stages' config
    rows, previous = [], None
    for day, eval_day in zip(all_days[:-1], all_days[1:], strict=True):
        run_stage("preprocess", {**run, "ds": day})
        trained = run_stage("train", {**run, "ds": day, "init_from": previous})
        scored = run_stage("evaluate", {**run, "ds": day, "model_uri": trained["train.model_uri"]})
        rows.append(
            {
                "day": day,
                "eval_day": eval_day,
                "init": "warm" if trained["train.init_from"] else "scratch",
                "ne": scored["eval.ne"],
                "auc": scored["eval.auc"],
                "oracle_ne": scored["eval.oracle_ne"],
                "oracle_auc": scored["eval.oracle_auc"],
                "gap": scored["eval.ne"] - scored["eval.oracle_ne"],
                "steps": trained["train.steps"],
                "best_step": trained.get("train.best_step"),
            }
        )
        previous = trained["train.model_uri"]
        if len(rows) in (1, days):  # where the first and the last model's gaps lie
            rows[-1]["missed"] = missed_terms(
                Warehouse(run["warehouse"]), previous, eval_day, pipeline.features, pipeline.synth
            )
    bounds = learnable_bounds(pipeline.features, pipeline.synth, all_days[:-1], all_days[1:])
    for row, bound in zip(rows, bounds, strict=True):
        row["bound_ne"], row["features_ne"], row["learned_ne"] = (
            bound["bound"],
            bound["features"],
            bound["learned"],
        )
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
        # the last day's model and the day after it: what the serving bench serves
        "week_model": {"uri": previous, "warehouse": run["warehouse"], "ds": all_days[-1]},
    }
    if both_arms:
        baseline = {**run, "ds": all_days[0], "mode": "baseline"}
        run_stage("preprocess", baseline)
        base = run_stage("train", baseline)
        base_ne = run_stage("evaluate", {**baseline, "model_uri": base["train.model_uri"]})[
            "eval.ne"
        ]
        result["bench.quality.week.baseline_first_ne"] = base_ne
        result["bench.quality.week.arms_ne_gap"] = abs(base_ne - rows[0]["ne"])
    return result


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
