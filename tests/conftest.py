"""Shared fixtures: small synthetic logs generated once per session, fresh warehouses."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from recd_core.config import FeatureSet
from recd_core.config_files import load_feature_set, synth_config
from recd_core.data.synth import synthesize
from recd_core.warehouse import Warehouse

DAY = "2026-11-01"


@pytest.fixture(scope="session")
def features() -> FeatureSet:
    return load_feature_set("synthetic")


@pytest.fixture(scope="session")
def small_logs(tmp_path_factory, features) -> Path:
    """Two days of the small preset: OUT/ds=2026-11-01, OUT/ds=2026-11-02."""
    out = tmp_path_factory.mktemp("logs")
    synthesize(features, synth_config("small", start_date=dt.date.fromisoformat(DAY), days=2), out)
    return out


@pytest.fixture
def day_logs(small_logs, tmp_path) -> Path:
    """A private copy of the first day's logs (tests may damage it)."""
    dst = tmp_path / "logs" / f"ds={DAY}"
    shutil.copytree(small_logs / f"ds={DAY}", dst)
    return dst


@pytest.fixture
def warehouse(tmp_path) -> Warehouse:
    return Warehouse(tmp_path / "warehouse")


@pytest.fixture(scope="session")
def movielens_dir() -> Path:
    """The real MovieLens-100k files (`make movielens`); `make test` always provides them."""
    env = os.environ.get("RECD_MOVIELENS_DIR")
    if not env:
        pytest.skip(
            "RECD_MOVIELENS_DIR not set: run through `make test` (it fetches MovieLens-100k)"
        )
    path = Path(env)
    assert (path / "ml-100k.inter").exists(), (
        f"RECD_MOVIELENS_DIR={path} has no ml-100k.inter: run `make movielens`"
    )
    return path


@pytest.fixture(scope="session")
def samples_warehouse(tmp_path_factory, small_logs, features) -> Path:
    """A warehouse with both days of the small preset ingested and generated (read-only:
    tests that write copy it with `fresh_warehouse`)."""
    from recd_core.config import GenerateConfig, IngestConfig
    from recd_core.data.generate import generate
    from recd_core.data.ingest import ingest

    root = tmp_path_factory.mktemp("samples_wh")
    wh = Warehouse(root)
    for ds in ("2026-11-01", "2026-11-02"):
        ingest(small_logs / f"ds={ds}", wh, ds, features, IngestConfig())
        generate(wh, ds, GenerateConfig(), layouts=("clustered",))
    return root


@pytest.fixture
def fresh_warehouse(samples_warehouse, tmp_path) -> Warehouse:
    dst = tmp_path / "wh"
    shutil.copytree(samples_warehouse, dst)
    return Warehouse(dst)


# The suite runs on every core (pytest-xdist, `addopts` in pyproject.toml), a test file at a
# time on a worker (`--dist loadfile`), so a file's module fixtures (a trained model, a
# pipeline's day, a built image) are made once and its tests run in order. (`--dist
# loadgroup` is not used: xdist 3.8 marks a group in `item._nodeid`, which pytest 9 no longer
# reads, so its groups split a file across workers.) The files starting a local Ray
# instance run one at a time (a lock held for the file), since two on one machine at once
# would contend for its ports. The slowest files go first (in the order one `--durations`
# run on 2 cores gave), so the workers end together instead of one finishing the bench alone.
RAY_FILES = ("test_dpp", "test_generate", "test_ingest", "test_ray_train")
SLOWEST_FIRST = (
    "test_bench",
    "test_image",
    "test_airflow_server",
    "test_pipeline",
    "test_sharding",
    "test_flexshard_training",
    "test_serving",
    "test_airflow",
    "test_ray_train",
    "test_concurrency",
    "test_kubeflow",
    "test_failure_semantics",
    "test_train",
    "test_bagpipe",
    "test_faults",
    "test_sharded_pipeline",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    place = {stem: i for i, stem in enumerate(SLOWEST_FIRST)}
    # stable: a file's tests keep their order, the files not listed theirs after the rest
    items.sort(key=lambda item: place.get(item.path.stem, len(SLOWEST_FIRST)))


@pytest.fixture(scope="module", autouse=True)
def one_ray_file_at_a_time(request):
    """A file that starts a local Ray instance holds the run's Ray lock while it runs."""
    workers = getattr(request.config, "workerinput", None)
    if workers is None or request.path.stem not in RAY_FILES:
        yield
        return
    from recd_core.leftovers import flocked

    with flocked(f"{tempfile.gettempdir()}/recd-tests-ray-{workers['testrunuid']}.lock"):
        yield
