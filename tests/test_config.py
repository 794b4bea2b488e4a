from pathlib import Path

import pytest

from recd_core.config import ConfigError, FeatureSpec
from recd_core.config_files import load_feature_set, load_pipeline_config, synth_config
from recd_core.dpp.preprocess import scaled_batch_size


def test_builtin_feature_sets_load():
    synthetic = load_feature_set("synthetic")
    assert synthetic.user_key == "user_id"
    assert {f.side for f in synthetic.features} == {"user", "item", "context"}
    assert synthetic["user_history"].kind == "sequence"
    movielens = load_feature_set("movielens")
    assert movielens["item_genres"].max_length == 19


def test_pipeline_config_from_yaml_with_named_feature_set(tmp_path: Path):
    path = tmp_path / "pipe.yaml"
    path.write_text(
        "features: movielens\ngenerate: {batch_size: 256}\ningest: {max_quarantine_fraction: 0.2}\n"
    )
    cfg = load_pipeline_config(path)
    assert cfg.features.name == "movielens"
    assert cfg.generate.batch_size == 256
    assert cfg.ingest.max_quarantine_fraction == 0.2


def test_the_builtin_movielens_pipeline_trains_as_its_file_says(tmp_path: Path):
    """A `format: movielens` run without a config file trains as the MovieLens bench does
    (batches and an average that scale with the data, several passes), not with the daily
    retrain's settings; the synthetic default keeps those; a user's file naming the MovieLens
    features changes only what it names."""
    movielens = load_pipeline_config(dataset="movielens")
    assert movielens.train.batch_size == movielens.preprocess.batch_size
    # ml-100k's 80k training ratings in batches of 256 and five models; ml-1m's 800k in
    # batches of 1024 and two models; ten times that in the batch size asked for
    batch_of = lambda rows: scaled_batch_size(rows, movielens.preprocess)  # noqa: E731
    assert [batch_of(n) for n in (80_000, 800_000, 8_000_000)] == [256, 1024, 4096]
    model = movielens.train.model
    assert model.for_samples(72_000).members == 5 and model.for_samples(720_000).members == 2
    assert model.cross_layers == 2
    assert movielens.train.epochs == 20
    assert not movielens.train.restart_tables and movielens.train.cooccurrence_weight == 0
    synthetic = load_pipeline_config(dataset="synthetic")
    assert synthetic.train.batch_size == 512 and synthetic.train.model.members == 1
    own = tmp_path / "own.yaml"
    own.write_text("features: movielens\ntrain: {epochs: 2}\n")
    own_cfg = load_pipeline_config(own)
    assert own_cfg.train.epochs == 2 and own_cfg.train.model == movielens.train.model


def test_bad_config_names_file_and_field(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "features:\n  name: x\n  features:\n"
        "    - {name: user_id, side: user, kind: sparse, table_size: 10}\n"
        "    - {name: item_id, side: item, kind: sparse, table_size: 10}\n"
        "    - {name: tags, side: item, kind: id_list, table_size: -3, max_length: 4}\n"
        "generate: {batch_sise: 10}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_pipeline_config(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "features.features.2.table_size" in msg
    assert "generate.batch_sise" in msg  # unknown keys are errors, not silently ignored


def test_invalid_yaml_and_missing_file(tmp_path: Path):
    bad = tmp_path / "x.yaml"
    bad.write_text("features: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_pipeline_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline_config(tmp_path / "missing.yaml")


def test_a_config_past_its_size_limit_is_refused_unread_and_a_yaml_bomb_stays_small(tmp_path):
    """A 10 MB config (one unknown key, as a probe sent) is refused before it is parsed, on
    the CLI in one line with exit 2; an alias bomb is parsed by the C loader as shared
    references, not expanded, and refused as the config it is not."""
    import resource
    import subprocess
    import sys

    big = tmp_path / "big.yaml"
    big.write_text("unknown_key: " + "x" * 10_000_000 + "\n")
    with pytest.raises(ConfigError, match="larger than 1,048,576 bytes"):
        load_pipeline_config(big)
    status_cmd = [sys.executable, "-m", "recd_core.cli", "status", "--ds", "2026-11-01"]
    status_cmd += ["--warehouse", str(tmp_path / "wh"), "--config", str(big)]
    r = subprocess.run(status_cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "larger than" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    bomb = tmp_path / "bomb.yaml"
    levels = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    bomb.write_text("\n".join(levels) + "\ntrain: *a9\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError):
        load_pipeline_config(bomb)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


@pytest.mark.parametrize(
    "spec, problem",
    [
        ({"name": "a", "side": "user", "kind": "sparse"}, "needs `table_size`"),
        ({"name": "a", "side": "user", "kind": "id_list", "table_size": 5}, "needs `max_length`"),
        ({"name": "a", "side": "user", "kind": "dense", "table_size": 5}, "dense feature"),
        (
            {
                "name": "a",
                "side": "user",
                "kind": "id_list",
                "table_size": 5,
                "max_length": 4,
                "synth_length": [2, 9],
            },
            "synth_length",
        ),
        ({"name": "Bad-Name", "side": "user", "kind": "dense"}, "pattern"),
        ({"name": "a", "side": "sideways", "kind": "dense"}, "side"),
    ],
)
def test_feature_spec_rejects_inconsistent_fields(spec, problem):
    with pytest.raises(ValueError, match=problem):
        FeatureSpec.model_validate(spec)


def test_feature_set_keys_must_exist(tmp_path: Path):
    path = tmp_path / "fs.yaml"
    path.write_text(
        "name: x\nuser_key: uid\nfeatures:\n  - {name: item_id, side: item, kind: sparse, table_size: 3}\n"
    )
    with pytest.raises(ConfigError, match="uid"):
        load_feature_set(path)


def test_synth_presets_and_overrides():
    assert synth_config("standard").samples_per_day == 200_000
    assert synth_config("small", users=7).users == 7
    with pytest.raises(ConfigError, match="unknown preset"):
        synth_config("huge")
    with pytest.raises(ConfigError, match="mean_session_length"):
        synth_config("small", mean_session_length=500.0)


def test_a_partial_config_changes_only_the_fields_it_names(tmp_path):
    """`train: {cooccurrence_weight: 0}` once replaced the whole section (batch 512 -> 4096)."""
    from recd_core.config_files import load_pipeline_config

    builtin = load_pipeline_config(None)
    path = tmp_path / "c.yaml"
    path.write_text(
        "features: synthetic\ntrain: {cooccurrence_weight: 0, model: {embedding_dim: 16}}\n"
    )
    cfg = load_pipeline_config(path)
    assert cfg.train.cooccurrence_weight == 0 and cfg.train.model.embedding_dim == 16
    rest = cfg.train.model_copy(
        update={
            "cooccurrence_weight": builtin.train.cooccurrence_weight,
            "model": builtin.train.model.model_copy(
                update={"embedding_dim": builtin.train.model.embedding_dim}
            ),
        }
    )
    assert rest == builtin.train  # batch size 512 and every other field kept
    assert cfg.model_dump(exclude={"train"}) == builtin.model_dump(exclude={"train"})
    # a file naming a built-in feature set keeps that set's own settings (MovieLens' training)
    path.write_text("features: movielens\ntrain: {epochs: 2}\n")
    movielens = load_pipeline_config(None, dataset="movielens")
    cfg = load_pipeline_config(path)
    assert cfg.train.epochs == 2
    assert cfg.train.model_copy(update={"epochs": movielens.train.epochs}) == movielens.train
    assert cfg.preprocess == movielens.preprocess
