"""Compatibility only: models registered before the layered layout (recd_core/mlops/) keep
`from recd_core.registry import SampleScorer` in their stored entry code, so this name must
import for them to load and serve (`mlflow models serve`, `mlflow.pyfunc.load_model`)."""

from recd_core.mlops.registry import SampleScorer

__all__ = ["SampleScorer"]
