"""The config a stage runs with: the pipeline config (a file, or the built-in one) with the
stage arguments that override it laid over it (`ArgSpec.config`); an argument left unset,
and a flag left off, leaves the config's value.

    config file / built-in ──┐
    --train-config (train) ──┼──> PipelineConfig the stage runs with
    --preset (synth)         │
    --batch-size, --nproc … ─┘    (`overrides`: {"train": {"nproc": 2}, ...})
"""

from __future__ import annotations

from typing import Any

from recd_core.config import SYNTH_PRESETS, PipelineConfig, SynthConfig, TrainConfig
from recd_core.config_files import (
    load_feature_set,
    load_pipeline_config,
    load_yaml,
    merged,
    parse_config,
)
from recd_core.orchestration.stage_args import StageArgs, arg_spec, override_fields

SECTIONS = ("ingest", "generate", "preprocess", "train", "registry")  # laid over as they are


def overrides(args: StageArgs) -> dict[str, dict[str, Any]]:
    """The config values `args` sets, by section: {"train": {"sharding": "auto"}, ...}
    (an unset argument and a flag left off set nothing)."""
    out: dict[str, dict[str, Any]] = {}
    for name in override_fields():
        value = getattr(args, name)
        if value is None or value is False:
            continue
        spec = arg_spec(name)
        value = spec.when_set if value is True else value
        for path in spec.config:
            section, key = path.split(".")
            out.setdefault(section, {})[key] = value
    return out


def pipeline_config(args: StageArgs) -> PipelineConfig:
    """The config file (or the built-in one: MovieLens' for `format: movielens`) with the
    arguments that override it applied; unset arguments leave the config's values."""
    dataset = "movielens" if args.format == "movielens" else "synthetic"
    cfg = load_pipeline_config(args.config, dataset=dataset)
    sections = {name: getattr(cfg, name) for name in SECTIONS}
    if args.train_config:  # laid over the config's training: it names what it changes
        over = merged(cfg.train.model_dump(mode="json"), load_yaml(args.train_config))
        sections["train"] = parse_config(TrainConfig, over, args.train_config)
    over = overrides(args)
    if args.format:
        over.setdefault("ingest", {})["format"] = args.format
    update = {
        name: type(section).model_validate({**section.model_dump(), **over.get(name, {})})
        for name, section in sections.items()
    }
    preset = SYNTH_PRESETS[args.preset] if args.preset else {}
    update["synth"] = SynthConfig.model_validate(
        {**cfg.synth.model_dump(), **preset, **over.get("synth", {})}
    )
    if args.features:
        update["features"] = load_feature_set(args.features)
    return cfg.model_copy(update=update)


def config_words(name: str, cfg: PipelineConfig) -> str:
    """What the config says where argument `name` would override it, as a person reads it:
    the value a run uses when the argument is left unset ("512", or "generate 4096,
    train 512" where its paths differ)."""
    shown = {}
    for path in arg_spec(name).config:
        section, key = path.split(".")
        value = getattr(getattr(cfg, section), key)
        shown[path] = getattr(value, "value", value)  # an enum as its value
    if len({repr(v) for v in shown.values()}) <= 1:
        return str(next(iter(shown.values()), ""))
    return ", ".join(f"{path.split('.')[0]} {v}" for path, v in shown.items())
