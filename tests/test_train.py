"""Dedup-aware training: parity with the baseline, resume after SIGKILL, learning, bad input."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from recd_core.config import DedupConfig, ModelConfig, PreprocessConfig, TrainConfig
from recd_core.dedup.sparse import JaggedError
from recd_core.dedup.unique import plan_dedup
from recd_core.dpp.encode import make_batch
from recd_core.dpp.preprocess import preprocess
from recd_core.metrics import auc
from recd_core.modeling.checkpoints import Checkpoints, batches_id, run_name
from recd_core.modeling.model import DLRM
from recd_core.modeling.saved import CheckpointError, ModelError, batches_of, load_model, predict
from recd_core.modeling.train import BatchMismatch, train
from recd_core.schema import feature_set_of

DAY, NEXT = "2026-11-01", "2026-11-02"


def fit(wh, cfg: TrainConfig, nproc: int = 1) -> dict:
    """DPP for the arm (batches of cfg.batch_size), then training on those batches."""
    preprocess(wh, DAY, PreprocessConfig(mode=cfg.mode, batch_size=cfg.batch_size))
    return train(wh, DAY, cfg, nproc=nproc)


SMALL_MODEL = ModelConfig(embedding_dim=16, bottom_mlp=[32], top_mlp=[32], history_ff=32)


def _grads(model, batch):
    model.zero_grad()
    logits = model(batch)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    grads = {
        n: (p.grad.to_dense() if p.grad.is_sparse else p.grad)
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return logits.detach(), grads


@pytest.mark.parametrize(
    ("cross_layers", "fm", "split_groups"), [(0, True, False), (2, True, False), (0, False, True)]
)
def test_dedup_and_baseline_give_the_same_logits_and_gradients(
    fresh_warehouse, cross_layers, fm, split_groups
):
    """The dedup batch's interaction has its user side once a unique row
    (modeling/interaction.py); the baseline's is every sample's. Also with DCN-v2's cross
    layers over the interaction vectors (MovieLens' config: the full interaction then), and
    with the user's features in two groups (the larger once a row, the other expanded)."""
    table = fresh_warehouse.read("samples", DAY, layout="clustered").slice(0, 700)
    features = feature_set_of(table.schema)
    plan = plan_dedup(table, features, DedupConfig(), 700)
    assert "user_history" in plan.groups["user"] and "item_id" not in plan.grouped
    if split_groups:
        users = plan.groups["user"]
        cfg = DedupConfig(groups={"profile": users[:4], "user": users[4:]})
        plan = plan_dedup(table, features, cfg, 700)
        assert len(plan.groups) == 2
    dedup, base = make_batch(table, features, plan), make_batch(table, features, None)
    assert dedup.groups["user"].num_unique < 100 < 700 == dedup.size
    model = DLRM(features, SMALL_MODEL.model_copy(update={"cross_layers": cross_layers, "fm": fm}))
    with torch.no_grad():  # cross layers and the fm start at zero: make them count
        for p in [*model.cross.parameters(), *(model.fm.parameters() if fm else [])]:
            p.normal_(0, 0.05)
    l1, g1 = _grads(model, dedup)
    l2, g2 = _grads(model, base)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g2.keys() and len(g1) == len(list(model.parameters()))
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)


def _state(uri):
    model, meta = load_model(uri)
    return model.state_dict(), meta


def test_n_steps_end_at_the_same_loss_and_weights(fresh_warehouse):
    cfgs = [
        TrainConfig(mode=m, batch_size=256, max_steps=24, patience=100, model=SMALL_MODEL)
        for m in ("dedup", "baseline")
    ]
    d, b = (fit(fresh_warehouse, c) for c in cfgs)
    assert d["train.steps"] == b["train.steps"] == 24
    assert d["train.loss"] == pytest.approx(b["train.loss"], rel=1e-4)
    assert d["train.val_ne"] == pytest.approx(b["train.val_ne"], rel=1e-4)
    sd, sb = _state(d["train.model_uri"])[0], _state(b["train.model_uri"])[0]
    # Float summation order differs between the arms (duplicate gradients are summed by
    # index_select's backward vs by the optimizer's coalesce). Row-wise Adagrad normalizes a
    # table row by its whole gradient, so roundoff stays roundoff: every weight agrees.
    for name in sd:
        torch.testing.assert_close(
            sd[name], sb[name], rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert d["train.dedup_groups"] == {"user": 12} and b["train.dedup_groups"] == {}


@pytest.mark.parametrize("average", [1, 3])
def test_sigkill_mid_training_then_resume_matches_an_uninterrupted_run(
    fresh_warehouse, samples_warehouse, tmp_path, average
):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(samples_warehouse, other)
    # batches of 256: ~14 a pass, so the resumed run also restarts the tables for its
    # second pass from the start it rebuilt (the seeded init), not from the checkpoint.
    # `average`: the states averaged at the validations before the kill are checkpointed
    cfg = TrainConfig(
        batch_size=256,
        max_steps=20,
        checkpoint_every=4,
        model=SMALL_MODEL,
        threads=1,
        average_states=average,
    )
    script = textwrap.dedent(
        f"""
        import os, signal
        from recd_core.config import TrainConfig
        from recd_core.modeling.checkpoints import Checkpoints
        from recd_core.modeling.train import BatchMismatch, train
        from recd_core.warehouse import Warehouse
        real = Checkpoints.save
        def save_then_die(self, state):
            path = real(self, state)
            if state["step"] == 12:
                os.kill(os.getpid(), signal.SIGKILL)
            return path
        Checkpoints.save = save_then_die
        train(Warehouse({str(fresh_warehouse.uri)!r}), {DAY!r}, TrainConfig.model_validate_json({cfg.model_dump_json()!r}))  # batches made above
        """
    )
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=cfg.batch_size))
    r = subprocess.run([sys.executable, "-c", script])
    assert r.returncode == -9, "the training process was killed"
    ckpts = Checkpoints(
        fresh_warehouse, run_name(DAY, cfg, batches_id(fresh_warehouse, DAY, cfg.mode)), 2
    ).list()
    assert ckpts[-1].endswith("step-00000012.pt") and len(ckpts) == 2
    resumed = train(fresh_warehouse, DAY, cfg)
    assert resumed["train.resumed_from_step"] == 12 and resumed["train.steps"] == 20
    from recd_core.warehouse import Warehouse

    straight = fit(Warehouse(other), cfg)
    assert 12 < straight["train.steps_per_epoch"] < 20  # a pass ended after the kill
    a, b = _state(resumed["train.model_uri"])[0], _state(straight["train.model_uri"])[0]
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_a_trained_model_ranks_the_next_day_well_above_chance(fresh_warehouse):
    s = fit(fresh_warehouse, TrainConfig(batch_size=128, epochs=3))
    model, meta = load_model(s["train.model_uri"])
    nxt = fresh_warehouse.read("samples", NEXT, layout="clustered")
    p = predict(model, meta, nxt)
    score = auc(np.asarray(nxt["label"]), p)
    # the small day trains on ~3,600 rows (the oracle's AUC is ~0.83; defaults tuned on
    # 50k-200k-sample days reach ~0.58 here); over ~4,000 scored rows AUC's standard error
    # is ~0.01, so 0.55 is well clear of chance (0.5)
    assert score > 0.55, score
    assert meta["prepared"]["groups"]["user"] and meta["summary"]["train.steps"] == s["train.steps"]


def test_model_file_is_a_plain_state_dict(fresh_warehouse):
    s = fit(fresh_warehouse, TrainConfig(batch_size=512, max_steps=2, model=SMALL_MODEL))
    path = s["train.model_uri"] + "/model.pt"
    state = torch.load(path, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    meta = json.loads(Path(s["train.model_uri"], "model.json").read_text())
    assert meta["train"]["mode"] == "dedup" and meta["features"]["name"] == "synthetic"


def test_corrupt_checkpoint_is_a_clear_error(fresh_warehouse, tmp_path):
    cfg = TrainConfig(batch_size=512, max_steps=2, checkpoint_every=1, model=SMALL_MODEL)
    fit(fresh_warehouse, cfg)
    latest = Checkpoints(
        fresh_warehouse, run_name(DAY, cfg, batches_id(fresh_warehouse, DAY, cfg.mode)), 2
    ).list()[-1]
    with open(latest, "r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage\x00" * 10)
    with pytest.raises(CheckpointError, match=r"step-00000002.pt is corrupt"):
        train(fresh_warehouse, DAY, cfg)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "recd_core.cli",
            "train",
            "--warehouse",
            fresh_warehouse.uri,
            "--ds",
            DAY,
            "--batch-size",
            "512",
            "--max-steps",
            "2",
            "--checkpoint-every",
            "1",
            "--train-config",
            str(_write_yaml(tmp_path, cfg)),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "is corrupt" in r.stderr and r.stderr.strip().count("\n") == 0


def _write_yaml(tmp_path, cfg):
    import yaml

    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    return path


def test_out_of_range_ids_and_bad_batches_are_clear_errors(fresh_warehouse):
    table = fresh_warehouse.read("samples", DAY, layout="clustered").slice(0, 64)
    features = feature_set_of(table.schema)
    model = DLRM(features, SMALL_MODEL)
    batch = make_batch(table, features, None)
    batch.kjt.values[0] = 10**9  # past the first feature's table
    with pytest.raises(JaggedError, match=r"feature 'user_id': ids must be in \[0, 100000\)"):
        model(batch)
    narrow = make_batch(table, features, None)
    narrow.dense = narrow.dense[:, :3]
    with pytest.raises(JaggedError, match="dense input has 3 columns"):
        model(narrow)


def test_training_needs_its_partition(tmp_path):
    from recd_core.warehouse import PartitionNotFound, Warehouse

    with pytest.raises(PartitionNotFound, match="batches/mode=dedup/ds=2026-11-01"):
        train(Warehouse(tmp_path), DAY, TrainConfig())


@pytest.mark.slow
def test_two_processes_data_parallel_on_gloo(fresh_warehouse):
    cfg = TrainConfig(batch_size=256, epochs=1, patience=100, model=SMALL_MODEL, threads=1)
    s = fit(fresh_warehouse, cfg, nproc=2)
    n = fresh_warehouse.info("samples", DAY, layout="clustered").rows
    assert s["train.world_size"] == 2
    batches = fresh_warehouse.manifest("batches", DAY, mode="dedup")["batches"]
    assert s["train.steps"] == batches // 2  # each rank: every other batch, same step count
    held_out = fresh_warehouse.manifest("batches", DAY, mode="dedup")["validation"]["samples"]
    assert s["train.samples"] >= n - held_out - 2 * 256 and np.isfinite(s["train.loss"])
    model, _ = load_model(s["train.model_uri"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_training_refuses_batches_of_another_size(fresh_warehouse):
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=512))
    with pytest.raises(
        BatchMismatch, match=r"preprocessed with batch size 512, the training config asks for 256"
    ):
        train(fresh_warehouse, DAY, TrainConfig(batch_size=256, model=SMALL_MODEL))


def test_a_small_day_gets_smaller_batches_and_a_large_one_a_single_model(fresh_warehouse):
    """`min_steps_per_pass`: DPP halves the batch until a pass has that many steps, and
    training, asking for the batch size it was configured with, takes the batches' size;
    `members_up_to_samples`: past it the day trains (and saves) one model, not an average."""
    rows = fresh_warehouse.info("samples", DAY, layout="clustered").rows
    steps = int(rows * 0.9 / 256) + 1  # more than a pass at 512 has, fewer than at 256
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=1024, min_steps_per_pass=steps))
    model = SMALL_MODEL.model_copy(update={"members": 3, "members_up_to_samples": rows // 2})
    cfg = TrainConfig(batch_size=1024, max_steps=4, model=model)
    summary = train(fresh_warehouse, DAY, cfg)
    assert summary["train.batch_size"] == 256 and summary["train.members"] == 1
    single, meta = load_model(summary["train.model_uri"])
    assert not hasattr(single, "members") and meta["train"]["model"]["members"] == 1
    with pytest.raises(BatchMismatch, match=r"preprocessed with batch size 1024, .* asks for 256"):
        train(fresh_warehouse, DAY, cfg.model_copy(update={"batch_size": 256}))


def test_early_stopping_keeps_the_best_validated_state(fresh_warehouse):
    """Trained well past its best (several passes, small batches): the saved model is the
    state with the best validation NE, not the last one, and the curve says where that was."""
    from recd_core.dpp.batch_store import BatchStore
    from recd_core.modeling.train import validate

    # tables kept across passes (they memorize the day): patience counts validations
    cfg = TrainConfig(
        batch_size=128,
        epochs=4,
        patience=3,
        model=SMALL_MODEL,
        lr_sparse=0.3,
        restart_tables=False,
        fold_in_validation=False,
    )
    s = fit(fresh_warehouse, cfg)
    curve = s["train.history"]["train.val_ne"]
    assert curve[0][0] == 0 and len(curve) >= 4  # validated before the first step, then often
    best_step, best_ne = min(curve, key=lambda p: p[1])
    assert (s["train.best_step"], s["train.val_ne"]) == (best_step, pytest.approx(best_ne))
    assert s["train.stopped_early"]  # four passes over tables that memorize: past its best
    assert s["train.steps"] < s["train.steps_per_epoch"] * cfg.epochs
    assert all(ne >= best_ne for step, ne in curve if step > best_step)
    model, _ = load_model(s["train.model_uri"])
    valid = BatchStore(fresh_warehouse, DAY, "dedup", split="validation")
    cpu = torch.device("cpu")
    # saved calibrated (fitted on the same slice after the best state was chosen)
    assert validate(model, valid, cpu)["eval.ne"] == pytest.approx(
        s["train.val_ne_calibrated"], rel=1e-5
    )
    model.reset_calibration()  # the raw logit: the state early stopping chose
    assert validate(model, valid, cpu)["eval.ne"] == pytest.approx(best_ne, rel=1e-5)


def test_each_validation_scores_the_mean_of_the_last_states_and_the_best_mean_is_saved(
    fresh_warehouse, monkeypatch
):
    """`average_states: 3`: what a validation scores is the mean of the weights at it and
    the two validations before (fewer at the start; the init is no member), and the saved
    model is the best of those means, not a live state."""
    import recd_core.modeling.train as training

    live, validated, steps = {}, {}, [0]
    real_step, real_validate = training.train_step, training.validate

    def copy(model):
        return {n: v.detach().clone() for n, v in model.state_dict().items()}

    def stepping(net, *args, **kwargs):
        loss = real_step(net, *args, **kwargs)
        steps[0] += 1
        live[steps[0]] = copy(net)
        return loss

    def validating(model, valid, device):
        validated[steps[0]] = copy(model)
        return real_validate(model, valid, device)

    monkeypatch.setattr(training, "train_step", stepping)
    monkeypatch.setattr(training, "validate", validating)
    cfg = TrainConfig(
        batch_size=128,
        epochs=2,
        patience=100,
        average_states=3,
        restart_tables=False,
        fold_in_validation=False,
        model=SMALL_MODEL,
    )
    s = fit(fresh_warehouse, cfg)
    at = sorted(k for k in validated if k > 0)
    assert len(at) >= 6 and s["train.steps"] == at[-1]
    for i, step in enumerate(at):
        members = at[max(0, i - 2) : i + 1]
        for name, value in validated[step].items():
            mean = sum(live[m][name] for m in members) / len(members)
            torch.testing.assert_close(value, mean, msg=f"step {step}: {name}")
    best = s["train.best_step"]
    assert best in at[1:], "a mean of two states or more was the best"
    model, _ = load_model(s["train.model_uri"])
    model.reset_calibration()  # the raw logit: the state early stopping chose
    saved = model.state_dict()
    for name, value in validated[best].items():
        torch.testing.assert_close(saved[name], value, msg=name)
    differs = [n for n, v in validated[best].items() if not torch.equal(v, live[best][n])]
    assert differs, "the saved state is a mean of several states, not the live one"


def test_each_pass_restarts_the_tables_from_where_the_run_started(fresh_warehouse, monkeypatch):
    """Each pass after the first takes the embedding tables (and their Adagrad state) back to
    the run's start and keeps the dense layers; a second pass over tables that have seen
    the day memorizes it. Patience counts passes, so worse validations early in a pass
    (new tables) do not stop the run. Each later pass fine-tunes the dense layers at a
    lower rate (`lr_dense_pass_decay`)."""
    import recd_core.modeling.train as training

    seen = []
    real_step = training.train_step

    def recording(model, batch, opt_dense, opt_sparse, amp, aux=None, scale=1.0):
        seen.append(
            (
                [p.detach().clone() for p in model.sparse_parameters()],
                [p.detach().clone() for p in model.dense_parameters()],
                sum(len(s) for s in opt_sparse.state.values()),
                opt_dense.param_groups[0]["lr"],
            )
        )
        return real_step(model, batch, opt_dense, opt_sparse, amp, aux, scale)

    monkeypatch.setattr(training, "train_step", recording)
    cfg = TrainConfig(
        batch_size=256,
        epochs=2,
        pass_patience=1,
        model=SMALL_MODEL,
        lr_dense=2e-3,
        lr_dense_pass_decay=0.5,
    )
    s = fit(fresh_warehouse, cfg)
    per_pass = s["train.steps_per_epoch"]
    assert s["train.steps"] == 2 * per_pass  # pass_patience 1: not stopped mid-pass
    (tables0, dense0, _, rate0), (tables1, _, _, _) = seen[0], seen[1]
    tables2, dense2, opt2, rate2 = seen[per_pass]  # the first step of the second pass
    assert not all(torch.equal(a, b) for a, b in zip(tables0, tables1, strict=True))
    for start, again in zip(tables0, tables2, strict=True):
        assert torch.equal(start, again)
    assert opt2 == 0  # Adagrad as at the start: no accumulator yet
    assert not all(torch.equal(a, b) for a, b in zip(dense0, dense2, strict=True))
    assert (rate0, rate2, seen[-1][3]) == (2e-3, 1e-3, 1e-3)


def test_validation_rows_are_the_latest_and_never_trained_on(fresh_warehouse):
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256))
    m = fresh_warehouse.manifest("batches", DAY, mode="dedup")
    n = fresh_warehouse.info("samples", DAY, layout="clustered").rows
    assert m["samples"] + m["validation"]["samples"] == n
    assert m["validation"]["samples"] == pytest.approx(0.1 * n, abs=2)
    assert any(f.startswith("valid-") for f in m["files"])


def test_warm_start_loads_the_given_models_weights_or_says_why_it_cannot(fresh_warehouse):
    from recd_core.dpp.batch_store import BatchStore
    from recd_core.modeling.train import validate
    from recd_core.modeling.warm_start import initial_state

    first = fit(fresh_warehouse, TrainConfig(batch_size=256, max_steps=6, model=SMALL_MODEL))
    model, _ = load_model(first["train.model_uri"])
    assert model.calibration.tolist() == pytest.approx(
        [first["train.calibration_slope"], first["train.calibration_offset"]]
    )
    model.reset_calibration()  # training starts from the raw logit and fits its own
    valid = BatchStore(fresh_warehouse, DAY, "dedup", split="validation")
    start_ne = validate(model, valid, torch.device("cpu"))["eval.ne"]
    cfg = TrainConfig(batch_size=256, max_steps=2, model=SMALL_MODEL)
    warm = train(fresh_warehouse, DAY, cfg, init_from=first["train.model_uri"])
    assert warm["train.init_from"] == first["train.model_uri"]
    assert warm["train.init_reason"].startswith("warm start from")
    # its curve starts where the given model ended: the same weights
    assert warm["train.history"]["train.val_ne"][0][1] == pytest.approx(start_ne, rel=1e-6)
    other = TrainConfig(
        batch_size=256, max_steps=2, model=SMALL_MODEL.model_copy(update={"embedding_dim": 8})
    )
    scratch = train(fresh_warehouse, DAY, other, init_from=first["train.model_uri"])
    assert scratch["train.init_from"] == ""
    assert "model config changed (embedding_dim)" in scratch["train.init_reason"]
    # ids mapped to rows another way (hashed vs row indices): the rows mean other ids
    flipped = model.features.model_copy(
        update={
            "features": [
                f.model_copy(update={"hash": not f.hash}) if f.name == "item_id" else f
                for f in model.features.features
            ]
        }
    )
    init = initial_state(first["train.model_uri"], flipped, cfg)
    assert init.state is None and "the feature set changed (item_id)" in init.reason
    every = model.features.model_copy(
        update={"features": [f.model_copy(update={"required": False}) for f in flipped.features]}
    )
    reason = initial_state(first["train.model_uri"], every, cfg).reason
    assert reason.endswith(f"and {len(every.features) - 4} more)"), "a long list is cut short"
    with pytest.raises(CheckpointError, match="not a recd model"):
        train(fresh_warehouse, DAY, cfg, init_from=str(fresh_warehouse.root) + "/models/nothing")


def improving_validation(monkeypatch) -> None:
    """Every validation better than the one before: the best state is always the latest, so
    a test sees the mechanism, not what the data happens to do."""
    import recd_core.modeling.train as training

    calls: list[int] = []

    def validate(model, valid, device):
        calls.append(0)
        return {"eval.ne": 1.0 / len(calls), "eval.auc": 0.5}

    monkeypatch.setattr(training, "validate", validate)


def test_a_pass_without_a_better_state_ends_the_run_and_the_best_states_optimizer_is_saved(
    fresh_warehouse, monkeypatch
):
    """With restarted tables, a pass that does not beat the previous ones ends the run
    (`pass_patience` 1); the saved model is the best state, and the optimizer state saved
    with it (what tomorrow's warm start continues) is that step's, not the last step's."""
    import recd_core.modeling.train as training
    from recd_core.dpp.batch_store import BatchStore

    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256))
    per_pass = len(BatchStore(fresh_warehouse, DAY, "dedup"))
    steps: list[int] = []
    real_step = training.train_step

    def counting(*args):
        steps.append(0)
        return real_step(*args)

    def validate(model, valid, device):  # better through the first pass, worse after it
        return {
            "eval.ne": 1.0 - 0.01 * len(steps) if len(steps) <= per_pass else 2.0,
            "eval.auc": 0.5,
        }

    monkeypatch.setattr(training, "train_step", counting)
    monkeypatch.setattr(training, "validate", validate)
    cfg = TrainConfig(batch_size=256, epochs=3, pass_patience=1, model=SMALL_MODEL)
    s = train(fresh_warehouse, DAY, cfg)
    assert s["train.steps"] == 2 * per_pass and s["train.stopped_early"]
    assert s["train.best_step"] == per_pass
    saved = torch.load(Path(s["train.model_uri"]) / "optimizer.pt", weights_only=True)
    assert {int(v["step"]) for v in saved["dense"]["state"].values()} == {per_pass}


def test_warm_start_continues_the_saved_optimizer_state(fresh_warehouse, monkeypatch):
    """Daily retraining continues yesterday's optimizers (Adam's moments and step count, the
    tables' Adagrad accumulators); a model saved without them starts fresh ones."""

    def optimizer(summary: dict) -> dict:
        path = Path(summary["train.model_uri"]) / "optimizer.pt"
        return torch.load(path, weights_only=True)

    def adam_steps(state: dict) -> set[int]:
        return {int(s["step"]) for s in state["dense"]["state"].values()}

    def adam_lr(state: dict) -> float:
        return state["dense"]["param_groups"][0]["lr"]

    improving_validation(monkeypatch)  # the best state is the last: its optimizer is saved
    first = fit(fresh_warehouse, TrainConfig(batch_size=256, max_steps=6, model=SMALL_MODEL))
    saved = optimizer(first)
    assert adam_steps(saved) == {6}
    assert first["train.lr_dense"] == adam_lr(saved) == TrainConfig().lr_dense  # scratch
    cfg = TrainConfig(batch_size=256, max_steps=2, model=SMALL_MODEL, seed=1)
    continued = train(fresh_warehouse, DAY, cfg, init_from=first["train.model_uri"])
    warm = optimizer(continued)
    assert adam_steps(warm) == {8}
    # a warm start fine-tunes the dense layers with their own, smaller learning rate
    assert continued["train.lr_dense"] == adam_lr(warm) == cfg.lr_dense_warm < cfg.lr_dense
    for k, before in saved["sparse"]["state"].items():
        after = warm["sparse"]["state"][k]["sum"]
        assert torch.all(after >= before["sum"])  # accumulated on, never restarted
    assert any(
        torch.any(warm["sparse"]["state"][k]["sum"] > v["sum"])
        for k, v in saved["sparse"]["state"].items()
    )
    (Path(first["train.model_uri"]) / "optimizer.pt").unlink()  # a model saved without it
    fresh = TrainConfig(batch_size=256, max_steps=2, model=SMALL_MODEL, seed=2)
    again = train(fresh_warehouse, DAY, fresh, init_from=first["train.model_uri"])
    assert again["train.init_reason"].startswith("warm start from")
    assert adam_steps(optimizer(again)) == {2}
    assert adam_lr(optimizer(again)) == fresh.lr_dense_warm
    plain = TrainConfig(batch_size=256, max_steps=2, model=SMALL_MODEL, lr_dense_warm=None)
    same = train(fresh_warehouse, DAY, plain, init_from=first["train.model_uri"])
    assert same["train.lr_dense"] == plain.lr_dense  # None: the warm start keeps lr_dense


def test_a_model_whose_weights_do_not_fit_its_config_is_refused_and_warm_starts_afresh(
    fresh_warehouse,
):
    """A model.json whose config does not describe its weights (edited, or written by
    another version of recd): scoring refuses it naming the model, and a warm start from it
    trains from scratch, saying why."""
    old = fit(fresh_warehouse, TrainConfig(batch_size=256, max_steps=2, model=SMALL_MODEL))
    meta_path = Path(old["train.model_uri"]) / "model.json"
    meta = json.loads(meta_path.read_text())
    meta["train"]["model"]["fm"] = not meta["train"]["model"]["fm"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ModelError, match=f"{old['train.model_uri']} is not a recd model"):
        load_model(old["train.model_uri"])
    cfg = TrainConfig(batch_size=256, max_steps=2, model=SMALL_MODEL)
    new = train(fresh_warehouse, DAY, cfg, init_from=old["train.model_uri"])
    assert new["train.init_from"] == ""
    assert "model config changed (fm)" in new["train.init_reason"]


def test_a_training_window_trains_on_the_days_before_too(fresh_warehouse):
    prep = PreprocessConfig(batch_size=256)
    for day in (DAY, NEXT):
        preprocess(fresh_warehouse, day, prep)
    per_day = {
        d: fresh_warehouse.manifest("batches", d, mode="dedup")["batches"] for d in (DAY, NEXT)
    }
    cfg = TrainConfig(batch_size=256, epochs=1, window_days=3, model=SMALL_MODEL)
    s = train(fresh_warehouse, NEXT, cfg)
    assert s["train.days"] == [DAY, NEXT]  # the day before NEXT-2 has no batches: skipped
    assert s["train.steps_per_epoch"] == per_day[DAY] + per_day[NEXT]


def _cooc_grads(model, batch, negatives=64):
    from recd_core.modeling.cooccurrence import cooccurrence_loss

    model.zero_grad()
    loss = cooccurrence_loss(model, batch, negatives, torch.Generator().manual_seed(3))
    loss.backward()
    grads = {n: p.grad.to_dense() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_the_list_cooccurrence_loss_is_the_same_on_unique_rows_and_on_every_sample(fresh_warehouse):
    table = fresh_warehouse.read("samples", DAY, layout="clustered").slice(0, 700)
    features = feature_set_of(table.schema)
    plan = plan_dedup(table, features, DedupConfig(), 700)
    dedup, base = make_batch(table, features, plan), make_batch(table, features, None)
    model = DLRM(features, SMALL_MODEL)
    l1, g1 = _cooc_grads(model, dedup)
    l2, g2 = _cooc_grads(model, base)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    # the user-side lists' tables, shared ones included (clicked items -> the item table)
    assert {"bags.t_items.weight", "bags.t_creators.weight"} <= g1.keys() == g2.keys()
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_list_cooccurrence_loss_equals_a_direct_computation():
    """Each member scored against the mean of the other half of its row (positions of the
    other parity), in a softmax with the negatives (here: every distinct id of the feature,
    the member itself counted once); rows weighted by their samples."""
    from recd_core.dedup.sparse import JaggedTensor
    from recd_core.modeling.cooccurrence import feature_loss

    torch.manual_seed(0)
    table = torch.randn(10, 4)
    rows = [[1, 2, 3], [4, 5], [6], [7, 1, 2, 9]]
    counts = torch.tensor([3.0, 1.0, 5.0, 2.0])
    lengths = torch.tensor([len(r) for r in rows])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    jt = JaggedTensor(torch.tensor([i for r in rows for i in r]), lengths, offsets)
    got_sum, got_weight = feature_loss(table, jt, counts, 1000, torch.Generator())
    pool = sorted({i for r in rows for i in r})
    total, weight = 0.0, 0.0
    for r, c in zip(rows, counts.tolist(), strict=True):
        if len(r) < 2:
            continue
        losses = []
        for p, member in enumerate(r):
            other = [r[q] for q in range(len(r)) if q % 2 != p % 2]
            ctx = table[other].mean(0)
            logits = torch.stack(
                [ctx @ table[member]] + [ctx @ table[k] for k in pool if k != member]
            )
            losses.append(float(torch.logsumexp(logits, 0) - ctx @ table[member]))
        total += c * sum(losses) / len(r)
        weight += c
    assert float(got_weight) == weight
    assert float(got_sum) == pytest.approx(total, rel=1e-5)
    # a sharded model's way (the rows' ids looked up already, a drawn negative's vector where
    # it first appears): the same loss and the same gradient on the table
    t1, t2 = table.clone().requires_grad_(), table.clone().requires_grad_()
    a = feature_loss(t1, jt, counts, 5, torch.Generator().manual_seed(1))[0]
    b = feature_loss(None, jt, counts, 5, torch.Generator().manual_seed(1), t2[jt.values])[0]
    a.backward()
    b.backward()
    assert b.item() == pytest.approx(a.item(), rel=1e-6)
    assert torch.allclose(t1.grad.to_dense(), t2.grad, atol=1e-6)


def test_the_calibration_fit_recovers_a_known_slope_and_offset_and_never_reverses_a_ranking():
    from recd_core.modeling.calibration import fit_calibration

    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, 50_000)
    y = (rng.random(z.size) < 1 / (1 + np.exp(-(0.6 * z - 0.8)))).astype(float)
    fit = fit_calibration(z, y)
    assert (fit.slope, fit.offset) == (pytest.approx(0.6, abs=0.02), pytest.approx(-0.8, abs=0.03))
    p = 1 / (1 + np.exp(-fit.apply(z)))
    assert p.mean() == pytest.approx(y.mean(), rel=1e-4)  # the offset's condition: rates agree
    one_class = fit_calibration(z, np.ones_like(z))
    assert (one_class.slope, one_class.offset) == (1.0, 0.0) and "one class" in one_class.reason
    reversed_ = fit_calibration(-z, y)  # scores that rank the slice backwards
    assert reversed_.slope == 1.0 and "offset only" in reversed_.reason
    assert (1 / (1 + np.exp(-reversed_.apply(-z)))).mean() == pytest.approx(y.mean(), rel=1e-4)
    small = z[:40]  # a small slice the model ranks perfectly: still a finite, steeper fit
    separated = fit_calibration(small, (small > 0).astype(float))
    assert separated.reason == "fitted on the validation slice" and 1 < separated.slope < 10


def test_the_saved_model_is_calibrated_on_the_latest_rows_and_predicts_their_click_rate(
    fresh_warehouse,
):
    """Training fits a slope and an offset of the logit on the validation slice (the latest
    rows, never trained on): the saved model predicts that slice's click rate, its NE there
    is no worse than the raw logit's, and `calibrate: false` keeps the raw scores."""
    from recd_core.dpp.batch_store import BatchStore
    from recd_core.modeling.train import validate

    cfg = TrainConfig(batch_size=256, max_steps=8, model=SMALL_MODEL, fold_in_validation=False)
    s = fit(fresh_warehouse, cfg)
    assert s["train.calibration_reason"] == "fitted on the validation slice"
    assert s["train.calibration_slope"] > 0
    assert s["train.val_ne_calibrated"] <= s["train.val_ne_uncalibrated"]
    model, _ = load_model(s["train.model_uri"])
    valid = BatchStore(fresh_warehouse, DAY, "dedup", split="validation")
    figures = validate(model, valid, torch.device("cpu"))
    assert figures["eval.calibration"] == pytest.approx(1.0, abs=2e-3)
    assert figures["eval.ne"] == pytest.approx(s["train.val_ne_calibrated"], rel=1e-6)
    raw = train(fresh_warehouse, DAY, cfg.model_copy(update={"calibrate": False, "seed": 3}))
    assert "train.calibration_slope" not in raw
    assert load_model(raw["train.model_uri"])[0].calibration.tolist() == [1.0, 0.0]


def test_the_tables_fold_in_the_validation_slice_after_it_chose_the_state(fresh_warehouse):
    """After the validation slice has chosen the state and fitted the calibration, the tables
    take one pass over it (the day's latest rows, which they would otherwise never see): the
    saved tables differ from the chosen state only in rows those rows use, the dense layers
    and the calibration are the chosen state's, and the saved Adagrad accumulators grew
    (tomorrow's warm start continues them)."""
    from recd_core.dpp.batch_store import BatchStore
    from recd_core.modeling.saved import read_optimizer

    cfg = TrainConfig(batch_size=256, max_steps=8, model=SMALL_MODEL)
    folded = fit(fresh_warehouse, cfg)
    kept = train(fresh_warehouse, DAY, cfg.model_copy(update={"fold_in_validation": False}))
    valid = BatchStore(fresh_warehouse, DAY, "dedup", split="validation")
    assert folded["train.folded_in_samples"] == sum(valid[k].size for k in range(len(valid)))
    assert kept["train.folded_in_samples"] == 0
    # two trainings agree to roundoff, not to the bit (the order of a few float sums varies
    # from run to run: once 5e-9 of NE apart); the fold-in's own moves are far larger
    same = dict(rtol=1e-5, atol=1e-7)
    assert folded["train.val_ne"] == pytest.approx(kept["train.val_ne"], rel=1e-6)  # one state
    a, _ = load_model(folded["train.model_uri"])
    b, _ = load_model(kept["train.model_uri"])
    assert torch.allclose(a.calibration, b.calibration, **same)
    tables, theirs = set(b.sparse_parameters()), dict(a.named_parameters())
    for name, p in b.named_parameters():
        if p not in tables:
            assert torch.allclose(theirs[name], p, **same), name  # dense layers stay
    table = b.table_of["position"]  # a table of its own: only the slice's positions move
    moved = ~torch.isclose(a.bags[table].weight, b.bags[table].weight, **same).all(dim=1)
    shown = {int(v) for k in range(len(valid)) for v in valid[k].kjt.to_dict()["position"].values}
    assert moved.any() and set(moved.nonzero().flatten().tolist()) <= shown
    acc_a = read_optimizer(folded["train.model_uri"])["sparse"]["state"]
    acc_b = read_optimizer(kept["train.model_uri"])["sparse"]["state"]
    grew = [bool((acc_a[k]["sum"] > acc_b[k]["sum"] * (1 + 1e-3)).any()) for k in acc_b]
    assert any(grew)
    assert all(bool((acc_a[k]["sum"] >= acc_b[k]["sum"] * (1 - 1e-5)).all()) for k in acc_b)


def test_an_ensembles_members_learn_as_models_of_their_own_and_it_scores_their_mean(
    fresh_warehouse,
):
    """`model.members`: each member fits its own loss (click and co-occurrence), so the
    first member ends where a single model of its seed does (to roundoff); the ensemble
    loads as one and scores the mean of its members' logits. A warm start from a single
    model into an ensemble trains from scratch and says why."""
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=256, validation_fraction=0.0))
    single = TrainConfig(batch_size=256, max_steps=6, model=SMALL_MODEL)
    pair = single.model_copy(update={"model": SMALL_MODEL.model_copy(update={"members": 2})})
    one, two = train(fresh_warehouse, DAY, single), train(fresh_warehouse, DAY, pair)
    solo, _ = load_model(one["train.model_uri"])
    ensemble, meta = load_model(two["train.model_uri"])
    first, second = ensemble.members
    assert first.cfg.seed == 0 and second.cfg.seed == 1
    for name, weight in solo.state_dict().items():
        torch.testing.assert_close(first.state_dict()[name], weight, rtol=1e-5, atol=1e-6)
    assert not torch.equal(first.bags["t_items"].weight, second.bags["t_items"].weight)
    table = fresh_warehouse.read("samples", NEXT, layout="clustered").slice(0, 500)
    p = predict(ensemble, meta, table)
    batch = next(batches_of(meta, table, batch_size=500))  # as predict preprocesses it
    with torch.no_grad():
        mean = torch.stack([first.raw_logit(batch), second.raw_logit(batch)]).mean(0)
    np.testing.assert_allclose(p, torch.sigmoid(mean).numpy(), rtol=1e-5, atol=1e-6)
    warm = train(fresh_warehouse, DAY, pair, init_from=one["train.model_uri"])
    assert warm["train.init_from"] == "" and "members" in warm["train.init_reason"]


def test_target_attention_per_unique_row_equals_attention_over_expanded_tokens():
    """The candidate's attention over its user's history, with the tokens kept once per
    unique row (the samples' queries brought to them), gives the same outputs and
    gradients as expanding the tokens to every sample, for rows of 0 to many samples."""
    from recd_core.modeling.model import target_attention

    g = torch.Generator().manual_seed(0)
    rows, width, d = 7, 9, 8
    inverse = torch.tensor([3, 0, 3, 3, 5, 0, 6, 3, 1, 6])  # rows 2 and 4: no sample
    valid = torch.rand(rows, width, generator=g) < 0.6
    valid[:, 0] = True  # the null token
    results = []
    for unique in (True, False):
        tokens = torch.randn(rows, width, d, generator=torch.Generator().manual_seed(1))
        query = torch.randn(inverse.numel(), d, generator=torch.Generator().manual_seed(2))
        tokens.requires_grad_(True), query.requires_grad_(True)
        if unique:
            out = target_attention(tokens, valid, query, inverse)
        else:
            out = target_attention(tokens[inverse], valid[inverse], query)
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        results.append((out.detach(), tokens.grad, query.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
