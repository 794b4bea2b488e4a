"""The references our model is compared with on the same data (`recd bench`'s MovieLens
part): a logistic regression (scikit-learn) on a one-hot encoding of the very same features
(multi-hot for id lists and the history), and a factorization machine on the same encoding
(the linear model plus an interaction for every pair of columns, as DeepFM's FM part); each
tuned on the latest 10% of the training part, then refit on all of it."""

from __future__ import annotations

import itertools
import logging
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recd_core import metrics
from recd_core.config import FeatureSet
from recd_core.modeling.calibration import fit_calibration

log = logging.getLogger(__name__)


def _dense(col: pa.Array, f, rows: int) -> np.ndarray:
    """A dense feature's values as a [rows, dim] matrix (nulls 0)."""
    flat = col.flatten() if pa.types.is_list(col.type) else col
    return np.asarray(flat.fill_null(0), np.float64).reshape(rows, f.dim)


def _id_values(col: pa.Array, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """An id feature's ids, flat, and how many each row holds (one for a single id)."""
    if pa.types.is_list(col.type):
        lengths = np.asarray(pc.list_value_length(col).fill_null(0), np.int64)
        return np.asarray(col.flatten().fill_null(0), np.int64), lengths
    return np.asarray(col.fill_null(0), np.int64), np.ones(rows, np.int64)


def one_hot(table: pa.Table, features: FeatureSet):
    """A sparse design matrix: one column per (feature, id) for id features and id lists
    (multi-hot, each list's ids weighted 1/length), dense features as they are (scaled)."""
    from scipy import sparse

    blocks, n = [], table.num_rows
    for f in features.features:
        col = table[f.name].combine_chunks()
        if f.kind == "dense":
            blocks.append(sparse.csr_matrix(_dense(col, f, n)))
            continue
        ids, lengths = _id_values(col, n)
        rows = np.repeat(np.arange(n), lengths)
        size = f.table_size or 1
        weights = 1.0 / np.maximum(np.repeat(lengths, lengths), 1)
        blocks.append(sparse.csr_matrix((weights, (rows, ids % size)), shape=(n, size)))
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
    tuned reference, so a gain over it is real. The grid widens past an end the choice
    sits on (`search`), as every reference's does.

    `ne_calibrated`: the same model calibrated as our training calibrates its model
    (modeling/calibration.py): a slope and an offset of the logit fitted on the latest 10%
    by the earlier-90% fit, applied to the refit's logits. Our model is calibrated that
    way, so the reference gets it too."""
    from sklearn.linear_model import LogisticRegression

    late = time_split(train, 0.9, per_user)
    fit_rows, val_rows = train.filter(pc.invert(late)), train.filter(late)
    design = scaled_design([train, test], features)

    def fit(x, y: np.ndarray, c: float):
        return LogisticRegression(C=c, max_iter=3000).fit(x, y)

    x_fit, y_fit = design(fit_rows), _labels(fit_rows)
    x_val, y_val = design(val_rows), _labels(val_rows)
    fits = {}

    def score(c: float) -> float:
        fits[c] = fit(x_fit, y_fit, c)
        return metrics.normalized_entropy(y_val, fits[c].predict_proba(x_val)[:, 1])

    best, _ = search(strengths, score)
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
    def parts(x, rows: int = 100_000) -> list[tuple]:
        """`tensors` of consecutive slices of at most `rows` rows: a larger design is fit a
        slice a step (ml-1m: 8 steps a pass instead of one, so far fewer passes), a smaller
        one full batch."""
        x = x.tocsr()
        return [FactorizationMachine.tensors(x[a : a + rows]) for a in range(0, x.shape[0], rows)]

    @staticmethod
    def tensors(x) -> tuple:
        """(x, x squared) as torch CSR tensors, from a scipy matrix (CSR: ~1.5x COO's speed)."""

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

    def fit(self, parts: list[tuple], y: np.ndarray, l2: float, epochs: int, lr: float, each=None):
        """Up to `epochs` passes of Adam, one step per part of the rows (`tensors`: one part
        is full batch); `each(epoch)` after every pass (validation: returning False stops
        the fit)."""
        import torch

        bounds = np.cumsum([0] + [p[0].shape[0] for p in parts])
        targets = [torch.tensor(y[a:b], dtype=torch.float32) for a, b in itertools.pairwise(bounds)]
        opt = torch.optim.Adam([self.b, self.w, self.v], lr=lr)
        for epoch in range(epochs):
            for xs, target in zip(parts, targets, strict=True):
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


# values a tuned choice may add past either end of its grid (`search`)
WIDEN = 2


def _beyond(values: list, low: bool):
    """The next value past the low or high end of sorted `values`, by the ratio of the two
    values there (0.01, 0.03, ... -> 0.00333; leaves 31, 127 -> 8): integers stay integers."""
    a, b = (values[0], values[1]) if low else (values[-1], values[-2])
    step = a * a / b
    return max(2, round(step)) if all(isinstance(v, int) for v in values) else step


def search(grid, score, widen: int = WIDEN) -> tuple[object, dict]:
    """The value of `grid` with the lowest `score(value)` (a validation NE), the grid extended
    past an end while the best sits on it, at most `widen` values each way: a choice on the
    end of its grid says the best lies beyond it, and a reference tuned short of its best
    would flatter ours. Returns (the best value, {every value tried: its score})."""
    scores = {v: score(v) for v in grid}
    added = {True: 0, False: 0}  # values added below, above
    while len(scores) > 1:
        values = sorted(scores)
        best = min(values, key=scores.get)
        low = best == values[0]
        if best not in (values[0], values[-1]) or added[low] >= widen:
            break
        value = _beyond(values, low)
        if value in scores:  # integers rounded onto a value tried
            break
        added[low] += 1
        log.info("tuning: %s chosen at its grid's end; trying %s", best, value)
        scores[value] = score(value)
    return min(scores, key=scores.get), scores


def tune(grid, fit, validate, patience: int) -> tuple[float, object, int]:
    """The grid value, and the step, at which a reference's validation NE is lowest (the grid
    widened past an end as `search` does): for each value `fit(value, each)` trains a fresh
    model, calling `each(step, model)` at every validation point, which validates it
    (`validate(model)` -> NE) and says whether to go on (`patience` steps at most past the
    value's best). Returns (NE, value, step)."""
    steps = {}

    def score(value) -> float:
        mine = [np.inf, 0]  # this value's best NE, and its step

        def each(step: int, model) -> bool:
            ne = validate(model)
            if ne < mine[0]:
                mine[:] = [ne, step]
            return step - mine[1] < patience

        fit(value, each)
        steps[value] = mine[1]
        return mine[0]

    value, scores = search(grid, score)
    return scores[value], value, steps[value]


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
    many passes. `max_epochs` and `patience` count Adam steps: a design fit a slice a step
    (`parts`) spends them a slice at a time, so ml-1m gets as many steps as ml-100k."""
    late = time_split(train, 0.9, per_user)
    fit_rows, val_rows = train.filter(pc.invert(late)), train.filter(late)
    design = scaled_design([train, test], features)
    x_fit, x_val = (
        FactorizationMachine.parts(design(fit_rows)),
        FactorizationMachine.tensors(design(val_rows)),
    )
    d = x_val[0].shape[1]
    # the budgets are Adam steps: a design fit a slice a step takes as many a pass
    max_passes = max(1, max_epochs // len(x_fit))
    patience_passes = max(2, -(-patience // len(x_fit)))
    y_val = _labels(val_rows)
    y_fit = _labels(fit_rows)

    def fit(l2: float, each) -> None:
        fm = FactorizationMachine(d, k)
        fm.fit(x_fit, y_fit, l2, max_passes, lr, lambda epoch: each(epoch + 1, fm))

    def validate(fm) -> float:
        return metrics.normalized_entropy(y_val, fm.predict(x_val))

    _, l2, passes = tune(strengths, fit, validate, patience_passes)
    fm = FactorizationMachine(d, k).fit(
        FactorizationMachine.parts(design(train)), _labels(train), l2, passes, lr
    )
    p, y = fm.predict(FactorizationMachine.tensors(design(test))), _labels(test)
    return {
        "ne": metrics.normalized_entropy(y, p),
        "auc": metrics.auc(y, p),
        "l2": l2,
        "passes": passes,
    }


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


GBDT_LEAVES = (31, 127)


def tree_design(table: pa.Table, features: FeatureSet):
    """The same information laid out for trees: each id feature one categorical column (its
    id), each dense value a column, each id list a multi-hot block (1 per id) and its length.
    Returns (sparse matrix, the categorical columns' indices)."""
    from scipy import sparse

    blocks, categorical, width, n = [], [], 0, table.num_rows
    for f in features.features:
        col = table[f.name].combine_chunks()
        if f.kind == "dense":
            block = sparse.csr_matrix(_dense(col, f, n))
        elif pa.types.is_list(col.type):
            ids, lengths = _id_values(col, n)
            size = f.table_size or 1
            rows = np.repeat(np.arange(n), lengths)
            hot = sparse.csr_matrix((np.ones(ids.size), (rows, ids % size)), shape=(n, size))
            hot.sum_duplicates()
            hot.data[:] = 1.0
            block = sparse.hstack([hot, sparse.csr_matrix(lengths[:, None].astype(np.float64))])
        else:
            ids, _ = _id_values(col, n)
            block = sparse.csr_matrix((ids % (f.table_size or 1))[:, None].astype(np.float64))
            categorical.append(width)
        blocks.append(block)
        width += block.shape[1]
    return sparse.hstack(blocks, format="csr"), categorical


def gradient_boosted_trees(
    train: pa.Table,
    test: pa.Table,
    features: FeatureSet,
    per_user: bool = True,
    leaves: tuple[int, ...] = GBDT_LEAVES,
    max_rounds: int = 2000,
    learning_rate: float = 0.05,
    patience: int = 50,
) -> dict:
    """NE and AUC on `test` of gradient-boosted trees (LightGBM) on the same information
    (`tree_design`: ids as categorical splits, lists multi-hot): the reference of another
    kind, strong where ratings' statistics carry the signal. Tuned like the others: the
    number of leaves and of rounds with the best NE on the latest 10% of `train` (early
    stopping), then refit on all of `train` for that many rounds."""
    import lightgbm as lgb

    late = np.asarray(time_split(train, 0.9, per_user))
    x_all, cats = tree_design(train, features)  # once; the fit and validation rows of it
    y_all = _labels(train)
    x_fit, y_fit, x_val, y_val = x_all[~late], y_all[~late], x_all[late], y_all[late]

    def params(num_leaves: int) -> dict:
        return {
            "objective": "binary",
            "learning_rate": learning_rate,
            "num_leaves": num_leaves,
            "min_data_in_leaf": 100,
            "feature_fraction": 0.8,
            "bagging_fraction": 0.8,
            "bagging_freq": 1,
            "cat_smooth": 10,
            "verbose": -1,
            "seed": 0,
        }

    fit_set = lgb.Dataset(x_fit, y_fit, categorical_feature=cats, free_raw_data=False)
    val_set = lgb.Dataset(x_val, y_val, reference=fit_set, free_raw_data=False)
    best_rounds = {}

    def score(num_leaves: int) -> float:
        booster = lgb.train(
            params(num_leaves),
            fit_set,
            max_rounds,
            valid_sets=[val_set],
            callbacks=[lgb.early_stopping(patience, verbose=False)],
        )
        best_rounds[num_leaves] = booster.best_iteration
        p_val = booster.predict(x_val, num_iteration=booster.best_iteration)
        return metrics.normalized_entropy(y_val, p_val)

    num_leaves, _ = search(leaves, score)
    rounds = best_rounds[num_leaves]
    booster = lgb.train(
        params(num_leaves), lgb.Dataset(x_all, y_all, categorical_feature=cats), rounds
    )
    p, y = booster.predict(tree_design(test, features)[0]), _labels(test)
    return {
        "ne": metrics.normalized_entropy(y, p),
        "auc": metrics.auc(y, p),
        "leaves": num_leaves,
        "rounds": rounds,
    }
