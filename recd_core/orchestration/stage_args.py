"""A stage's arguments, declared once: `StageArgs`, whose fields (type, default, help) are the
options of `recd <stage>`, the components' `--flags`, and the parameters of the Kubeflow and
Airflow pipelines, all generated from it (`stage_options`).

Common arguments (where the warehouse is, which days, the config) every stage takes; a
stage's own (`arg(stages=(...))`, its `ArgSpec`) only that stage, and another's is refused,
so a misdirected flag fails instead of doing nothing. Unset, an argument leaves the
config's value; set, it is laid over the config (orchestration/overlay.py)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from recd_core.config import Sharding
from recd_core.errors import BadInput
from recd_core.orchestration.graph import STAGES
from recd_core.warehouse import validate_ds

# what an orchestrator wires between stages (the MLflow run, the pipeline's name): not typed
# by a person at `recd <stage>`, whose tracking URI and experiment are `recd`'s own options
WIRING = ("tracking_uri", "experiment", "parent_run_id", "pipeline", "register_run_id")


@dataclass(frozen=True)
class ArgSpec:
    """What a `StageArgs` field is beyond its type and help: the stages that take it as
    their own (empty: every stage takes it; another stage refuses it), the config paths it
    overrides when set ("train.sharding"), and what a flag set writes there (`when_set`).
    Pydantic calls it to add the stages to the field's JSON schema (`x-stages`)."""

    stages: tuple[str, ...] = ()
    config: tuple[str, ...] = ()
    when_set: Any = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ValueError(f"arg(stages=...): no stage {', '.join(unknown)}")
        paths = [c for c in self.config if c.count(".") != 1]
        if paths:
            raise ValueError(f"arg(config=...): {', '.join(paths)} is not <section>.<key>")

    def __call__(self, schema: dict[str, Any]) -> None:
        if self.stages:
            schema["x-stages"] = list(self.stages)


def arg(
    description: str,
    *,
    stages: tuple[str, ...] = (),
    config: tuple[str, ...] = (),
    when_set: Any = True,
    **field: Any,
) -> Any:
    """A `StageArgs` field, declared once: its help (`description`), its `ArgSpec` and its
    pydantic constraints (`default`, `ge`, ...; unset by default: None, and a flag left off,
    leave the config's value). From this come the stage's options on every runner
    (`stage_options`), the config overlay (orchestration/overlay.py), `recd run`'s options
    and the Airflow and Kubeflow pipelines' override inputs (`override_fields`)."""
    field.setdefault("default", None)
    spec = ArgSpec(tuple(stages), tuple(config), when_set)
    return Field(description=description, json_schema_extra=spec, **field)


class StageArgs(BaseModel):
    """One stage invocation. Strings from templates are coerced (`days: "2"` -> 2); the
    descriptions are the components' `--help`."""

    model_config = ConfigDict(extra="forbid")

    warehouse: str | None = arg(
        "warehouse root: a directory or a URI (s3://...); every stage but synth"
    )
    ds: str = arg("the (first) training day, YYYY-MM-DD", default=...)
    days: int = arg("consecutive training days", default=1, ge=1, le=31)
    eval_ds: str | None = arg(
        "the evaluation day of a one-day run (default: the day after each training day)"
    )
    logs: str | None = arg("raw JSON-lines logs root (<logs>/ds=YYYY-MM-DD/)")
    synthesize: bool = arg("synthesize logs for days without any (embedded default)", default=True)
    config: str | None = arg("pipeline config YAML (default: the built-in synthetic one)")
    preset: Literal["small", "default", "standard"] | None = arg(
        "synthetic workload size; overrides the config's synth preset"
    )
    batch_size: int | None = arg(
        "the batch size of generate's dedup profile, DPP and training (they must agree)",
        config=("generate.batch_size", "preprocess.batch_size", "train.batch_size"),
        gt=0,
    )
    mode: Literal["dedup", "baseline"] = arg(
        "the training arm: dedup (IKJT) or baseline (KJT)",
        default="dedup",
        config=("preprocess.mode", "train.mode"),
    )
    tracking_uri: str | None = arg("MLflow tracking URI; off if unset")
    experiment: str = arg("MLflow experiment", default="recd")
    parent_run_id: str | None = arg("the pipeline's MLflow run (start's mlflow.run_id)")
    pipeline: str = arg("the pipeline run's name in MLflow", default="recd")
    # the stages' own arguments: unset, the config's value holds
    days_of: Literal["training", "evaluation", "run"] = arg(
        "the run's training days (--ds and --days), its evaluation days that are not "
        "training days (the day after each, or --eval-ds), or both; generate writes "
        "evaluation days clustered, the layout every arm is scored on",
        stages=("synth", "ingest", "generate"),
        default="training",
    )
    samples_per_day: int | None = arg(
        "impressions a day", stages=("synth",), config=("synth.samples_per_day",), ge=1
    )
    users: int | None = arg("users", stages=("synth",), config=("synth.users",), ge=1)
    items: int | None = arg("items", stages=("synth",), config=("synth.items",), ge=2)
    mean_session_length: float | None = arg(
        "mean impressions a session",
        stages=("synth",),
        config=("synth.mean_session_length",),
        ge=1.0,
    )
    seed: int | None = arg("the workload's seed", stages=("synth",), config=("synth.seed",))
    features: str | None = arg(
        "a feature set (name or YAML) in place of the config's", stages=("synth",)
    )
    source: str | None = arg(
        "a log file or a directory of them, ingested as the one day --ds (instead of "
        "<logs>/ds=<day>/)",
        stages=("ingest",),
    )
    # not a config override of a whole run: it also picks the built-in config (MovieLens'
    # features), which a run's other stages take from --config (pipeline_config)
    format: Literal["events", "movielens"] | None = arg(
        "the raw logs' format (movielens: ml-100k's files)", stages=("ingest",)
    )
    max_quarantine_fraction: float | None = arg(
        "the share of bad rows that fails the day",
        stages=("ingest",),
        config=("ingest.max_quarantine_fraction",),
        ge=0.0,
        le=1.0,
    )
    engine: Literal["local", "ray"] | None = arg(
        "work here, or on Ray (RAY_ADDRESS's cluster): Ray Data tasks, train's --nproc "
        "processes as Ray Train workers",
        stages=("ingest", "generate", "preprocess", "train"),
        config=("ingest.engine", "generate.engine", "preprocess.engine", "train.engine"),
    )
    workers: int | None = arg(
        "parallel workers",
        stages=("ingest", "generate", "preprocess"),
        config=("ingest.workers", "generate.workers", "preprocess.workers"),
        ge=1,
    )
    layout: Literal["clustered", "shuffled", "both"] | None = arg(
        "the samples layout(s) written (default: both for training days, clustered for "
        "evaluation days)",
        stages=("generate",),
    )
    row_group_size: int | None = arg(
        "Parquet rows", stages=("generate",), config=("generate.row_group_size",), ge=1
    )
    threads: bool = arg(
        "local workers as threads instead of processes",
        stages=("preprocess",),
        config=("preprocess.executor",),
        when_set="thread",
        default=False,
    )
    stats_from: str | None = arg(
        "the standardization statistics of this preprocessed day", stages=("preprocess",)
    )
    init_from: str | None = arg(
        "the model to start from (a model directory, <warehouse>/models/<run> or "
        "models:/<name>@<alias>); default: the champion when the config's train.warm_start",
        stages=("train",),
    )
    device: Literal["auto", "cpu", "cuda"] | None = arg(
        "where to train (auto: CUDA where there is one)",
        stages=("train",),
        config=("train.device",),
    )
    nproc: int | None = arg(
        "processes (gloo on CPU, nccl on GPU)", stages=("train",), config=("train.nproc",), ge=1
    )
    sharding: Sharding | None = arg(
        "shard the tables across the --nproc processes (TorchRec) instead of a copy in each",
        stages=("train",),
        config=("train.sharding",),
    )
    memory_budget_mb: int | None = arg(
        "MB a process may hold of the sharded tables",
        stages=("train",),
        config=("train.memory_budget_mb",),
        ge=1,
    )
    epochs: int | None = arg("passes at most", stages=("train",), config=("train.epochs",), ge=1)
    max_steps: int | None = arg(
        "steps at most", stages=("train",), config=("train.max_steps",), ge=1
    )
    checkpoint_every: int | None = arg(
        "steps between checkpoints", stages=("train",), config=("train.checkpoint_every",), ge=1
    )
    amp: bool = arg(
        "bf16 autocast on CUDA", stages=("train",), config=("train.amp",), default=False
    )
    train_config: str | None = arg(
        "a TrainConfig YAML in place of the config's train part", stages=("train",)
    )
    model_uri: str | None = arg(
        "the trained model(s), ';'-joined over days", stages=("evaluate", "register")
    )
    eval_batch_size: int | None = arg(
        "rows a batch", stages=("evaluate",), config=("registry.eval_batch_size",), ge=1
    )
    register_run_id: str | None = arg(
        "the train stage's MLflow run, which logs the model", stages=("register",)
    )

    @field_validator("ds", "eval_ds")
    @classmethod
    def _a_real_day(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        try:
            return validate_ds(value)
        except ValueError:
            flag = "--" + info.field_name.replace("_", "-")
            raise ValueError(f"{flag} must be a date YYYY-MM-DD, got {value!r}") from None

    def training_days(self) -> list[str]:
        return [_day_after(self.ds, k) for k in range(self.days)]

    def eval_day(self, day: str) -> str:
        if self.eval_ds and self.days == 1:
            return self.eval_ds
        return _day_after(day, 1)

    def all_days(self) -> list[str]:
        days = self.training_days()
        return [*days, *(self.eval_day(d) for d in days if self.eval_day(d) not in days)]

    def data_days(self) -> list[str]:
        """The days synth, ingest and generate work on (`days_of`)."""
        if self.days_of == "run":
            return self.all_days()
        training = self.training_days()
        days = [d for d in self.all_days() if (d in training) == (self.days_of == "training")]
        if not days:  # --eval-ds among the training days: no evaluation day of its own
            raise BadInput(f"--days-of {self.days_of}: the run has no such day")
        return days


def arg_spec(name: str) -> ArgSpec:
    """The `ArgSpec` of `StageArgs` field `name`."""
    spec = StageArgs.model_fields[name].json_schema_extra
    assert isinstance(spec, ArgSpec), f"StageArgs.{name} is not declared with arg()"
    return spec


def own_options(stage: str) -> tuple[str, ...]:
    """The arguments `stage` takes as its own (`arg(stages=...)`), in declaration order."""
    return tuple(n for n in StageArgs.model_fields if stage in arg_spec(n).stages)


def stages_options() -> set[str]:
    """Every stage's own arguments (a field outside them is common: every stage takes it)."""
    return {n for n in StageArgs.model_fields if arg_spec(n).stages}


def override_fields() -> tuple[str, ...]:
    """The arguments that override the config (`arg(config=...)`), in declaration order:
    what `recd run` and the pipelines' override inputs offer."""
    return tuple(n for n in StageArgs.model_fields if arg_spec(n).config)


def parse_args(args: dict) -> StageArgs:
    """`args` as an orchestrator renders them, validated: templated values it could not fill
    ("", "None") are unset; what does not validate is `BadInput` with one line."""
    args = {k: v for k, v in args.items() if v not in (None, "", "None")}
    try:
        return StageArgs.model_validate(args)
    except ValidationError as e:
        reasons = "; ".join(
            err["msg"].removeprefix("Value error, ")
            if err["type"] == "value_error"
            else f"--{'.'.join(map(str, err['loc'])).replace('_', '-')}: {err['msg']}"
            for err in e.errors()
        )
        raise BadInput(f"bad arguments: {reasons}") from None


def stage_args(name: str, args: StageArgs | dict) -> StageArgs:
    """`args` validated for stage `name` (`parse_args`); another stage's own argument
    (`arg(stages=...)`) is refused, so a misdirected flag fails instead of doing
    nothing."""
    if isinstance(args, dict):
        args = parse_args(args)
    foreign = sorted(args.model_fields_set & (stages_options() - set(own_options(name))))
    if foreign:
        flags = ", ".join("--" + f.replace("_", "-") for f in foreign)
        raise BadInput(f"stage {name} takes no {flags} (another stage's argument)")
    return args


@dataclass(frozen=True)
class Option:
    """One stage argument as a command line shows it."""

    name: str  # the StageArgs field
    annotation: Any  # its type
    default: Any  # None: unset (the config's value holds)
    required: bool
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def stage_options(stage: str, wiring: bool = True) -> list[Option]:
    """The arguments `stage` takes, in declaration order: the common ones and its own (and,
    with `wiring`, what orchestrators wire)."""
    own, options = set(own_options(stage)), stages_options()
    return [
        field_option(name, stage)
        for name in StageArgs.model_fields
        if not (name in options and name not in own) and not (not wiring and name in WIRING)
    ]


def field_option(name: str, stage: str | None = None) -> Option:
    """A `StageArgs` field as a command line shows it. Where no one stage is meant (`recd
    run`'s options), a stage's own argument is described with its stages in front ("train:
    passes at most")."""
    field = StageArgs.model_fields[name]
    text = field.description or ""
    own = arg_spec(name).stages
    if own and stage is None:
        text = f"{', '.join(own)}: {text}"
    required = field.is_required()
    if required:
        text += " (required)"
    elif "(default" not in text and field.default is not None:
        text += f" (default: {field.default})"
    return Option(name, field.annotation, None if required else field.default, required, text)


def for_stage(stage: str, args: dict) -> dict:
    """A pipeline's shared `args` as `stage` takes them: the common ones and its own (an
    override given to the whole run, `recd run --nproc 2`, is for the stages that take
    it)."""
    foreign = stages_options() - set(own_options(stage))
    return {k: v for k, v in args.items() if k not in foreign}


def param_schema(name: str, nullable: bool = False) -> dict:
    """A `StageArgs` field as JSON schema (type, enum, bounds, description): what Airflow's
    `Param` takes. `nullable`: the value may be left empty (`type: [null, ...]`): Airflow's
    trigger form marks a param required, and keeps Trigger disabled, when its type has no
    null and its value is empty."""
    prop = dict(StageArgs.model_json_schema()["properties"][name])
    branches = [b for b in prop.pop("anyOf", []) if b.get("type") != "null"]
    if branches:
        prop.update(branches[0])
    keys = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "description")
    out = {k: prop[k] for k in keys if k in prop}
    own = arg_spec(name).stages  # a pipeline's input is the whole run's: its stages said
    if own and "description" in out:
        out["description"] = f"{', '.join(own)}: {out['description']}"
    if nullable:
        out["type"] = ["null", out["type"]]
        if "enum" in out:
            out["enum"] = [None, *out["enum"]]
    return out


def _day_after(day: str, k: int) -> str:
    """`day` + `k` days; a run past the calendar's end (`--ds 9999-12-31 --days 2`) is one
    line, not an OverflowError."""
    try:
        return (dt.date.fromisoformat(day) + dt.timedelta(days=k)).isoformat()
    except OverflowError:
        raise BadInput(
            f"--ds {day}: the run's days (and the evaluation day after them) go past 9999-12-31"
        ) from None
