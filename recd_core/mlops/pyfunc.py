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
from pathlib import Path
from types import SimpleNamespace

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pyarrow as pa

import recd_core
from recd_core.config import ENVELOPE_COLUMNS
from recd_core.schema import events_schema

EXAMPLE_ROWS = 5
CANDIDATES = "candidates"  # a ranking request's column (scoring/ranking.py)
MAX_CANDIDATES = 100_000  # candidates in one pyfunc call (`recd serve` has serve.max_rows)
NON_FEATURE_COLUMNS = tuple(ENVELOPE_COLUMNS)  # never trusted from a request: filled in


class SampleScorer(mlflow.pyfunc.PythonModel):
    """Click probabilities for sample rows (one DataFrame row per impression).

    Served input is checked as ingest checks events (finite dense values of the right
    width, ids in range, list lengths): a bad request is refused whole, a 400 naming the row
    and the field, and no response ever carries a stack trace (an unexpected failure is a
    500 that says to look in the server's log, where the traceback goes)."""

    def load_context(self, context) -> None:
        from recd_core.modeling.saved import load_model
        from recd_core.scoring.ranking import prepared_of

        # a server's: its own copies of any shard files, whatever becomes of the artifacts
        self.model, self.meta = load_model(context.artifacts["dlrm"], private=True)
        self.features = samples_features(self.meta)
        self.schema = events_schema(self.features)
        self.prep = prepared_of(self.meta)  # a ranking request's transforms and groups

    def predict(self, context, model_input: pd.DataFrame, params=None) -> np.ndarray:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE

        from recd_core.data.checks import first_failure, semantic_checks
        from recd_core.modeling.saved import predict

        if CANDIDATES in model_input.columns:
            return self._rank(model_input)
        try:
            table = rows_table(model_input, self.schema)
        except ValueError as e:
            raise MlflowException(str(e), INVALID_PARAMETER_VALUE) from None
        bad, fields, reasons = first_failure(table.num_rows, semantic_checks(table, self.features))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise MlflowException(f"scoring input row {row}: {reasons[row].as_py()} "
                                  f"({int(bad.sum())} row(s) refused)", INVALID_PARAMETER_VALUE)  # fmt: skip
        try:
            return predict(self.model, self.meta, table, trust_sessions=False).astype(np.float64)
        except Exception as e:  # noqa: BLE001 - the traceback to the log, not to the client
            logging.getLogger("recd.serving").exception("scoring failed")
            raise MlflowException(f"scoring failed ({type(e).__name__}); the server log has "
                                  "the details", INTERNAL_ERROR) from None  # fmt: skip

    def _rank(self, frame: pd.DataFrame) -> np.ndarray:
        """Ranking requests (scoring/ranking.py): each row's candidates scored, in order."""
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE

        from recd_core.scoring.ranking import ranking_requests, score_rankings
        from recd_core.scoring.request import RequestError

        columns = {c: [_plain(v) for v in frame[c]] for c in frame.columns}
        try:
            requests = ranking_requests(columns, len(frame), self.schema, self.features,
                                        max_rows=MAX_CANDIDATES)  # fmt: skip
        except RequestError as e:
            raise MlflowException(f"scoring input {e}", INVALID_PARAMETER_VALUE) from None
        try:
            return score_rankings(self.model, self.prep, requests)
        except Exception as e:  # noqa: BLE001 - the traceback to the log, not to the client
            logging.getLogger("recd.serving").exception("scoring failed")
            raise MlflowException(f"scoring failed ({type(e).__name__}); the server log has "
                                  "the details", INTERNAL_ERROR) from None  # fmt: skip


def _plain(value):
    """A DataFrame cell as JSON gave it: numpy arrays (MLflow's typed lists) as lists."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def rows_table(frame: pd.DataFrame, schema: pa.Schema) -> pa.Table:
    """A scoring DataFrame as a samples table: the model's feature columns, typed as in the
    warehouse; columns it does not use are ignored; a missing one is an error naming it."""
    missing = [
        f.name for f in schema if f.name not in frame.columns and f.name not in NON_FEATURE_COLUMNS
    ]
    if missing:
        raise ValueError(f"scoring input lacks feature column(s): {', '.join(missing)}")
    n = len(frame)
    cols = {}
    for f in schema:
        if f.name in frame.columns:
            cols[f.name] = _column(frame[f.name], f)
        elif f.name == "label":
            cols[f.name] = pa.array(np.zeros(n, np.int8), type=f.type)
        else:  # event_id, ts, and a session id that scoring never trusts
            cols[f.name] = pa.array(np.arange(n), type=f.type)
    return pa.table(cols, schema=schema)


def _column(values: pd.Series, field: pa.Field) -> pa.Array:
    """One scoring column typed as in the warehouse; float64 input (JSON numbers) is narrowed
    to the warehouse's float32, any other mismatch is an error naming the column."""
    try:
        if field.type == pa.float32() or (
            pa.types.is_list(field.type) and field.type.value_type == pa.float32()
        ):
            wide = pa.float64() if field.type == pa.float32() else pa.list_(pa.float64())
            return pa.array(list(values), type=wide).cast(field.type)
        return pa.array(list(values), type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
        raise ValueError(f"scoring input column {field.name!r}: {e}") from None


def scoring_example(samples: pa.Table) -> pd.DataFrame:
    """The input example: the first rows of a samples table, features only. Float columns
    are widened to float64 so the signature says `double`: a served request's JSON numbers
    arrive as float64, which MLflow will not narrow to a `float` column (rows_table casts
    them back to the warehouse's float32)."""
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
    from recd_core.scoring.ranking import candidate_side, user_side

    rows = scoring_example(samples)
    request = {c: [_plain(rows[c].iloc[0])] for c in user_side(features)}
    cands = rows[candidate_side(features)]
    request[CANDIDATES] = [[{c: _plain(v) for c, v in rec.items()}
                            for rec in cands.to_dict("records")]]  # fmt: skip
    return pd.DataFrame(request)


def both_formats(rows: pd.DataFrame, request: pd.DataFrame, predicted: np.ndarray):
    """The signature of both formats: every column optional (a request has the user side and
    `candidates`, rows every feature), the candidates' objects typed."""
    from mlflow.models import infer_signature
    from mlflow.types.schema import ColSpec, Schema

    by_rows = infer_signature(rows, predicted)
    by_request = infer_signature(request).inputs.input_dict()[CANDIDATES]
    cols = [ColSpec(c.type, c.name, required=False) for c in by_rows.inputs.inputs]
    cols.append(ColSpec(by_request.type, CANDIDATES, required=False))
    by_rows.inputs = Schema(cols)
    return by_rows


def samples_features(meta: dict):
    """The raw feature set a saved model's rows carry (what a scoring request must hold)."""
    from recd_core.config import FeatureSet

    return FeatureSet.model_validate(meta["prepared"]["raw"])


def save_pyfunc(model_dir: Path, samples: pa.Table, target: Path) -> None:
    """The trained model at `model_dir` as an MLflow pyfunc directory at `target` (model from
    code, signature and input example from `samples`): what `log_model` logs, and what
    `mlflow models serve -m <target>` serves without a tracking server."""
    import torch

    example = scoring_example(samples)
    scorer = SampleScorer()  # loaded as MLflow will load it, to sign what it returns
    scorer.load_context(SimpleNamespace(artifacts={"dlrm": str(model_dir)}))
    request = ranking_example(samples, scorer.features)
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
