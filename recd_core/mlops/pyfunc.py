"""The served model: a registered version is an MLflow pyfunc that scores *sample rows* (a
DataFrame with the feature columns of `samples/`), not a `torch.nn.Module` fed tensors: the
DLRM takes a deduplicated sparse `Batch`, which DPP builds from rows with the training run's
own transforms and statistics. So the logged model carries the state dict, `model.json`
(those transforms, statistics and the dedup plan) and the `recd_core` code, with a
signature and an input example; `mlflow.pyfunc.load_model("models:/recd-dlrm@champion")
.predict(rows)` returns click probabilities. Nothing is pickled: the model is logged "from
code" (`mlops/mlflow_model.py`), and the state dict inside is plain `torch.save` of tensors,
loaded with `weights_only=True`.

It takes two formats (one signature, every column optional): sample rows, one per
impression (batch scoring), and ranking requests, one row per request with the user side
once and a `candidates` column listing each candidate's item and context features
(scoring/ranking.py: the user side computed once a request). The input example is a
ranking request; `predict` answers one probability per row, or per candidate in order."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from types import SimpleNamespace

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pyarrow as pa

import recd_core
from recd_core.config import ENVELOPE_COLUMNS
from recd_core.modeling.saved import load_model
from recd_core.scoring.ranking import CANDIDATES, candidate_side, user_side
from recd_core.scoring.request import RequestError
from recd_core.scoring.scorer import NonFinite, Scorer

EXAMPLE_ROWS = 5
NON_FEATURE_COLUMNS = tuple(ENVELOPE_COLUMNS)  # never trusted from a request: filled in
MAX_ROWS = 100_000  # rows or candidates in one pyfunc call (`recd serve` has serve.max_rows)


class SampleScorer(mlflow.pyfunc.PythonModel):
    """The registered model: `scoring.scorer.Scorer` behind MLflow's pyfunc interface.

    A DataFrame of sample rows (one per impression) or of ranking requests (a `candidates`
    column) is scored as `recd serve` scores a request body: typed and checked as ingest
    checks events, refused whole with a message naming the row and the field
    (INVALID_PARAMETER_VALUE, a 400 under `mlflow models serve`); an unexpected failure is
    an INTERNAL_ERROR that says to look in the server's log, where the traceback goes."""

    def load_context(self, context) -> None:
        # a server's: its own copies of any shard files, whatever becomes of the artifacts
        self.scorer = Scorer(*load_model(context.artifacts["dlrm"], private=True))

    def predict(self, context, model_input: pd.DataFrame, params=None) -> np.ndarray:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE

        columns = {str(c): [_plain(v) for v in model_input[c]] for c in model_input.columns}
        try:
            return self.scorer.score(columns, len(model_input), MAX_ROWS)
        except RequestError as e:
            raise MlflowException(f"scoring input {e}", INVALID_PARAMETER_VALUE) from None
        except NonFinite as e:
            raise MlflowException(f"the model {e}", INTERNAL_ERROR) from None
        except Exception as e:  # noqa: BLE001 - the traceback to the log, not to the client
            logging.getLogger("recd.serving").exception("scoring failed")
            raise MlflowException(
                f"scoring failed ({type(e).__name__}); the server log has the details",
                INTERNAL_ERROR,
            ) from None


def _plain(value):
    """A DataFrame cell as JSON gave it: numpy arrays (MLflow's typed lists) as lists."""
    if isinstance(value, np.ndarray):  # numbers: Python's already; objects: one by one
        return value.tolist() if value.dtype != object else [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def scoring_example(samples: pa.Table) -> pd.DataFrame:
    """The input example: the first rows of a samples table, features only. Float columns
    are widened to float64 so the signature says `double`: a served request's JSON numbers
    arrive as float64, which MLflow will not narrow to a `float` column (scoring
    casts them back to the warehouse's float32)."""
    keep = [c for c in samples.column_names if c not in NON_FEATURE_COLUMNS]
    rows = samples.slice(0, EXAMPLE_ROWS).select(keep)
    for i, f in enumerate(rows.schema):
        if f.type == pa.float32():
            rows = rows.set_column(i, f.name, rows[f.name].cast(pa.float64()))
        elif pa.types.is_list(f.type) and f.type.value_type == pa.float32():
            rows = rows.set_column(i, f.name, rows[f.name].cast(pa.list_(pa.float64())))
    return rows.to_pandas()


def ranking_example(samples: pa.Table, features) -> pd.DataFrame:
    """A ranking request as the input example: the first row's user side once, the first
    rows' item and context features as its candidates (float64, as `scoring_example`)."""
    rows = scoring_example(samples)
    request = {c: [_plain(rows[c].iloc[0])] for c in user_side(features)}
    cands = rows[candidate_side(features)]
    request[CANDIDATES] = [
        [{c: _plain(v) for c, v in rec.items()} for rec in cands.to_dict("records")]
    ]
    return pd.DataFrame(request)


def both_formats(rows: pd.DataFrame, request: pd.DataFrame, predicted: np.ndarray):
    """The signature of both formats: every column optional (a request has the user side and
    `candidates`, rows every feature), the candidates' objects typed."""
    from mlflow.models import infer_signature
    from mlflow.types.schema import ColSpec, Schema

    # MLflow's hint that an integer column cannot hold a missing value is said once here,
    # not as two warnings in every training log: recd's scorer types a request's values
    # itself (scoring/request.py), and through `mlflow models serve` a missing optional id
    # is refused by MLflow's schema check with a 400 naming the column (docs/operations.md)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
        by_rows = infer_signature(rows, predicted)
        by_request = infer_signature(request).inputs.input_dict()[CANDIDATES]
    cols = [ColSpec(c.type, c.name, required=False) for c in by_rows.inputs.inputs]
    cols.append(ColSpec(by_request.type, CANDIDATES, required=False))
    by_rows.inputs = Schema(cols)
    return by_rows


def save_pyfunc(model_dir: Path, samples: pa.Table, target: Path) -> None:
    """The trained model at `model_dir` as an MLflow pyfunc directory at `target` (model from
    code, signature and input example from `samples`): what `log_model` logs, and what
    `mlflow models serve -m <target>` serves without a tracking server."""
    import torch

    example = scoring_example(samples)
    scorer = SampleScorer()  # loaded as MLflow will load it, to sign what it returns
    scorer.load_context(SimpleNamespace(artifacts={"dlrm": str(model_dir)}))
    request = ranking_example(samples, scorer.scorer.features)
    signature = both_formats(example, request, scorer.predict(None, example))
    mlflow.pyfunc.save_model(
        path=str(target),
        python_model=str(Path(__file__).with_name("mlflow_model.py")),
        artifacts={"dlrm": str(model_dir)},
        code_paths=[str(Path(recd_core.__file__).parent)],
        signature=signature,
        input_example=request,
        pip_requirements=[
            f"torch=={torch.__version__.split('+')[0]}",
            f"pyarrow=={pa.__version__}",
            f"pandas=={pd.__version__}",
            f"numpy=={np.__version__}",
            "pydantic>=2",
            "pyyaml",
        ],
    )


def example_rows(warehouse, ds: str) -> pa.Table:
    """The first sample rows of day `ds`, the logged model's input example (only the row
    groups that hold them are read)."""
    return warehouse.read_range("samples", ds, 0, EXAMPLE_ROWS, layout="clustered")
