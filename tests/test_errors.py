"""One error taxonomy: every failure recd expects carries its exit code and whether a retry
can fix it, and the CLI and the components report the same failure the same way."""

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import recd_core
from recd_core.errors import BadInput, GateFailed, RecdError, TrackingError, classify

REPO = Path(__file__).resolve().parents[1]
RECD = Path(sys.executable).parent / "recd"


def _exception_classes() -> dict[str, type]:
    found = {}
    for mod in pkgutil.walk_packages(recd_core.__path__, "recd_core."):
        if mod.name.startswith("recd_core.bench"):
            continue  # heavy imports; it defines no errors
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            mine = inspect.isclass(obj) and obj.__module__ == module.__name__
            if mine and issubclass(obj, BaseException):
                found[f"{mod.name}.{name}"] = obj
    return found


def test_every_error_recd_defines_is_a_recd_error_with_an_exit_code_and_a_retry_rule():
    classes = _exception_classes()
    assert len(classes) >= 12
    for name, cls in classes.items():
        assert issubclass(cls, RecdError), name
    codes = {n.rsplit(".", 1)[1]: (c.exit_code, c.retryable) for n, c in classes.items()}
    assert codes["ConfigError"] == codes["SourceError"] == codes["PartitionNotFound"] == (2, False)
    assert codes["CheckpointError"] == (2, False)  # a corrupt checkpoint: fix it, do not retry
    assert codes["QuarantineExceeded"] == (3, False)
    assert codes["TrackingError"] == (4, True)  # a server that is down may come back
    assert codes["TrackingStoreUnwritable"] == (4, False)  # permissions do not heal


def test_a_malformed_value_is_bad_input_and_anything_unexpected_is_left_alone():
    assert classify(ValueError("--ds must be YYYY-MM-DD")).exit_code == 2
    assert classify(GateFailed("arms differ")).exit_code == 3
    assert classify(KeyError("bug")) is None and classify(OSError("disk full")) is None
    assert str(BadInput("a\n  multi-line\nreason")) == "a multi-line reason"
    assert issubclass(TrackingError, RecdError)


@pytest.mark.parametrize("stage", ["generate", "preprocess"])
def test_the_cli_and_the_component_fail_the_same_way(stage, tmp_path):
    """A missing upstream partition: the same one line, the same exit code."""
    common = ["--warehouse", str(tmp_path / "wh"), "--ds", "2026-11-01"]
    cli = subprocess.run([str(RECD), stage, *common], capture_output=True, text=True)
    comp = subprocess.run(
        [sys.executable, "-m", f"components.{stage}", *common],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert cli.returncode == comp.returncode == 2, (cli.stderr, comp.stderr)
    for r in (cli, comp):
        assert "Traceback" not in r.stderr and f"recd {stage}: error:" in r.stderr
        assert "ds=2026-11-01" in r.stderr
