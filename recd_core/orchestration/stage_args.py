"""A stage's arguments, declared once: `StageArgs`, whose fields (type, default, help) are the
options of `recd <stage>`, the components' `--flags`, and the parameters of the Kubeflow and
Airflow pipelines, all generated from it (`stage_options`).

Common arguments (where the warehouse is, which days, the config) every stage takes; a
stage's own (`graph.Stage.options`) only that stage, and another's is refused, so a
misdirected flag fails instead of doing nothing. Unset, an argument leaves the config's
value."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from recd_core.config import PipelineConfig, Sharding, load_feature_set, load_pipeline_config
from recd_core.errors import BadInput
from recd_core.mlops.tracking import Tracker
from recd_core.orchestration.graph import STAGES
from recd_core.warehouse import Warehouse, validate_ds

OPTIONS = {o for s in STAGES.values() for o in s.options}  # the stages' own arguments
# what an orchestrator wires between stages (the MLflow run, the pipeline's name): not typed
# by a person at `recd <stage>`, whose tracking URI and experiment are `recd`'s own options
WIRING = ("tracking_uri", "experiment", "parent_run_id", "pipeline", "register_run_id")


class StageArgs(BaseModel):
    """One stage invocation. Strings from templates are coerced (`days: "2"` -> 2); the
    descriptions are the components' `--help`."""

    model_config = ConfigDict(extra="forbid")

    warehouse: str | None = Field(
        default=None,
        description="warehouse root: a directory or a URI (s3://...); every stage but synth",
    )
    ds: str = Field(description="the (first) training day, YYYY-MM-DD")
    days: int = Field(default=1, ge=1, le=31, description="consecutive training days")
    eval_ds: str | None = Field(
        default=None,
        description="the evaluation day of a one-day run (default: the day after each training day)",
    )
    logs: str | None = Field(
        default=None, description="raw JSON-lines logs root (<logs>/ds=YYYY-MM-DD/)"
    )
    synthesize: bool = Field(
        default=True, description="synthesize logs for days without any (embedded default)"
    )
    config: str | None = Field(
        default=None, description="pipeline config YAML (default: the built-in synthetic one)"
    )
    preset: Literal["small", "default", "standard"] | None = Field(
        default=None, description="synthetic workload size; overrides the config's synth preset"
    )
    batch_size: int | None = Field(
        default=None,
        gt=0,
        description="the batch size of generate's dedup profile, DPP and training (they "
        "must agree)",
    )
    mode: Literal["dedup", "baseline"] = Field(
        default="dedup", description="the training arm: dedup (IKJT) or baseline (KJT)"
    )
    tracking_uri: str | None = Field(default=None, description="MLflow tracking URI; off if unset")
    experiment: str = Field(default="recd", description="MLflow experiment")
    parent_run_id: str | None = Field(
        default=None, description="the pipeline's MLflow run (start's mlflow.run_id)"
    )
    pipeline: str = Field(default="recd", description="the pipeline run's name in MLflow")
    # the stages' own arguments (`graph.Stage.options`): unset, the config's value holds
    days_of: Literal["training", "evaluation", "run"] = Field(
        default="training",
        description="synth, ingest, generate: the run's training days (--ds and --days), its "
        "evaluation days that are not training days (the day after each, or --eval-ds), or "
        "both; generate writes evaluation days clustered, the layout every arm is scored on",
    )
    samples_per_day: int | None = Field(default=None, ge=1, description="synth: impressions a day")
    users: int | None = Field(default=None, ge=1, description="synth: users")
    items: int | None = Field(default=None, ge=2, description="synth: items")
    mean_session_length: float | None = Field(
        default=None, ge=1.0, description="synth: mean impressions a session"
    )
    seed: int | None = Field(default=None, description="synth: the workload's seed")
    features: str | None = Field(
        default=None, description="synth: a feature set (name or YAML) in place of the config's"
    )
    source: str | None = Field(
        default=None,
        description="ingest: a log file or a directory of them, ingested as the one day --ds "
        "(instead of <logs>/ds=<day>/)",
    )
    format: Literal["events", "movielens"] | None = Field(
        default=None, description="ingest: the raw logs' format (movielens: ml-100k's files)"
    )
    max_quarantine_fraction: float | None = Field(
        default=None, ge=0.0, le=1.0, description="ingest: the share of bad rows that fails the day"
    )
    engine: Literal["local", "ray"] | None = Field(
        default=None, description="ingest, generate, preprocess: work here or as Ray Data tasks"
    )
    workers: int | None = Field(
        default=None, ge=1, description="ingest, generate, preprocess: parallel workers"
    )
    layout: Literal["clustered", "shuffled", "both"] | None = Field(
        default=None,
        description="generate: the samples layout(s) written (default: both for training "
        "days, clustered for evaluation days)",
    )
    row_group_size: int | None = Field(default=None, ge=1, description="generate: Parquet rows")
    threads: bool = Field(
        default=False, description="preprocess: local workers as threads instead of processes"
    )
    stats_from: str | None = Field(
        default=None,
        description="preprocess: the standardization statistics of this preprocessed day",
    )
    init_from: str | None = Field(
        default=None,
        description="train: the model to start from (a model directory, <warehouse>/models/<run> "
        "or models:/<name>@<alias>); default: the champion when the config's train.warm_start",
    )
    device: Literal["auto", "cpu", "cuda"] | None = Field(
        default=None, description="train: where to train (auto: CUDA where there is one)"
    )
    nproc: int | None = Field(
        default=None, ge=1, description="train: processes (gloo on CPU, nccl on GPU)"
    )
    sharding: Sharding | None = Field(
        default=None,
        description="train: shard the tables across the --nproc processes (TorchRec) "
        "instead of a copy in each",
    )
    memory_budget_mb: int | None = Field(
        default=None, ge=1, description="train: MB a process may hold of the sharded tables"
    )
    epochs: int | None = Field(default=None, ge=1, description="train: passes at most")
    max_steps: int | None = Field(default=None, ge=1, description="train: steps at most")
    checkpoint_every: int | None = Field(
        default=None, ge=1, description="train: steps between checkpoints"
    )
    amp: bool = Field(default=False, description="train: bf16 autocast on CUDA")
    train_config: str | None = Field(
        default=None, description="train: a TrainConfig YAML in place of the config's train part"
    )
    model_uri: str | None = Field(
        default=None, description="evaluate, register: the trained model(s), ';'-joined over days"
    )
    eval_batch_size: int | None = Field(default=None, ge=1, description="evaluate: rows a batch")
    register_run_id: str | None = Field(
        default=None, description="register: the train stage's MLflow run, which logs the model"
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

    def pipeline_config(self) -> PipelineConfig:
        """The config file (or the built-in one: MovieLens' for `format: movielens`) with
        the arguments that override it applied; unset arguments leave the config's values."""
        from recd_core.config import (
            SYNTH_PRESETS,
            SynthConfig,
            TrainConfig,
            load_yaml,
            merged,
            parse_config,
        )

        dataset = "movielens" if self.format == "movielens" else "synthetic"
        cfg = load_pipeline_config(self.config, dataset=dataset)
        train = cfg.train
        if self.train_config:  # laid over the config's training: it names what it changes
            over = merged(train.model_dump(mode="json"), load_yaml(self.train_config))
            train = parse_config(TrainConfig, over, self.train_config)
        sections = {
            "ingest": (cfg.ingest, {"format": self.format, "engine": self.engine,
                                    "workers": self.workers,
                                    "max_quarantine_fraction": self.max_quarantine_fraction}),
            "generate": (cfg.generate, {"batch_size": self.batch_size, "engine": self.engine,
                                        "workers": self.workers,
                                        "row_group_size": self.row_group_size}),
            "preprocess": (cfg.preprocess, {"mode": self.mode, "batch_size": self.batch_size,
                                            "engine": self.engine, "workers": self.workers,
                                            "executor": "thread" if self.threads else None}),
            "train": (train, {"mode": self.mode, "batch_size": self.batch_size,
                              "device": self.device, "epochs": self.epochs,
                              "max_steps": self.max_steps, "amp": self.amp or None,
                              "checkpoint_every": self.checkpoint_every,
                              "nproc": self.nproc, "sharding": self.sharding,
                              "memory_budget_mb": self.memory_budget_mb}),
            "registry": (cfg.registry, {"eval_batch_size": self.eval_batch_size}),
        }  # fmt: skip
        update = {
            name: type(section).model_validate(
                {**section.model_dump(), **{k: v for k, v in over.items() if v is not None}}
            )
            for name, (section, over) in sections.items()
        }
        sizes = {"samples_per_day": self.samples_per_day, "users": self.users,
                 "items": self.items, "mean_session_length": self.mean_session_length,
                 "seed": self.seed}  # fmt: skip
        update["synth"] = SynthConfig.model_validate(
            {
                **cfg.synth.model_dump(),
                **(SYNTH_PRESETS[self.preset] if self.preset else {}),
                **{k: v for k, v in sizes.items() if v is not None},
            }  # fmt: skip
        )
        if self.features:
            update["features"] = load_feature_set(self.features)
        return cfg.model_copy(update=update)

    def store(self) -> Warehouse:
        if not self.warehouse:
            raise BadInput("no --warehouse given")
        return Warehouse(self.warehouse)

    def tracker(self) -> Tracker | None:
        return Tracker(self.tracking_uri, self.experiment) if self.tracking_uri else None


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
    (`graph.Stage.options`) is refused, so a misdirected flag fails instead of doing
    nothing."""
    if isinstance(args, dict):
        args = parse_args(args)
    foreign = sorted(args.model_fields_set & (OPTIONS - set(STAGES[name].options)))
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
    with `wiring`, what orchestrators wire). A stage's own argument is described with the
    stage's name in front ("train: passes at most"); that prefix is left out here."""
    own = set(STAGES[stage].options)
    out = []
    for name, field in StageArgs.model_fields.items():
        if (name in OPTIONS and name not in own) or (not wiring and name in WIRING):
            continue
        text = field.description or ""
        head, sep, rest = text.partition(": ")
        if sep and stage in head.split(", "):
            text = rest
        required = field.is_required()
        if required:
            text += " (required)"
        elif "(default" not in text and field.default is not None:
            text += f" (default: {field.default})"
        default = None if required else field.default
        out.append(Option(name, field.annotation, default, required, text))
    return out


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
    if nullable:
        out["type"] = ["null", out["type"]]
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
