"""MLflow "model from code" entry: the registered model is this file plus its artifacts, so
nothing is pickled (mlops/versions.py logs it; MLflow runs it when the model is loaded)."""

from mlflow.models import set_model

from recd_core.mlops.pyfunc import SampleScorer

set_model(SampleScorer())
