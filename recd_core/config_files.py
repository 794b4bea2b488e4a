"""Configs read from files: a YAML file bounded (`MAX_CONFIG_BYTES`, refused unread past it)
and parsed safely, laid over the built-in values (`merged`: a file names only what it
changes), and validated into the typed configs of config.py; a bad file is one
`ConfigError` naming the file and the dotted path of every offending field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from recd_core.config import (
    PACKAGE_CONFIGS,
    SYNTH_PRESETS,
    ConfigError,
    FeatureSet,
    PipelineConfig,
    SynthConfig,
)

M = TypeVar("M", bound=BaseModel)


def _format_validation_error(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        got = e.get("input")
        got_txt = "" if isinstance(got, dict | list) else f" (got {got!r})"
        lines.append(f"  {loc}: {e['msg']}{got_txt}")
    return f"invalid config in {where}:\n" + "\n".join(lines)


MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML; past this it is refused unread


# libyaml's loader where PyYAML was built with it (a 10 MB file: seconds, not minutes)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping; refused in one line when it is missing, larger than
    `MAX_CONFIG_BYTES` (before a byte is parsed), not YAML, or not a mapping."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {path} is larger than {MAX_CONFIG_BYTES:,} bytes: "
                "not a recd config (refused unread)"
            )
        data = yaml.load(raw.decode("utf-8"), Loader=YAML_LOADER)  # noqa: S506 - a safe loader
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def parse_config(model: type[M], data: dict[str, Any], where: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, where)) from None


def load_feature_set(name_or_path: str | Path) -> FeatureSet:
    """A built-in feature set by name (`synthetic`, `movielens`) or a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PACKAGE_CONFIGS / f"{name_or_path}.yaml"
    data = load_yaml(path)
    # Either a bare feature set (name, features, …) or a file holding one under `features:`.
    if "name" not in data and isinstance(data.get("features"), dict):
        data = data["features"]
    return parse_config(FeatureSet, data, str(path))


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`: mappings merge key by key (at any depth), anything else
    replaces. A config names only what it changes."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def pipeline_defaults() -> dict[str, Any]:
    """The sections' built-in values, as a config file would write them: only what each
    default sets (`train: {batch_size: 512}`), so a class default still applies where the
    pipeline sets nothing."""
    out = {}
    for name, f in PipelineConfig.model_fields.items():
        if isinstance(f.default, BaseModel):
            out[name] = f.default.model_dump(mode="json", exclude_unset=True)
    return out


def load_pipeline_config(
    path: str | Path | None = None, *, dataset: str = "synthetic"
) -> PipelineConfig:
    """The pipeline config from a YAML file, or the built-in one for `dataset` (its feature
    set, and the settings its file gives beside it: MovieLens' training). A file changes
    only the fields it names: it is laid over the built-in config of the feature set it
    names (`features: movielens` -> configs/movielens.yaml), which is laid over the
    pipeline's defaults; `train: {cooccurrence_weight: 0}` keeps every other training field."""
    if path is None:
        builtin = PACKAGE_CONFIGS / f"{dataset}.yaml"
        data = merged(pipeline_defaults(), load_yaml(builtin))
        return parse_config(PipelineConfig, data, str(builtin))
    data = load_yaml(path)
    base = pipeline_defaults()
    named = data.get("features")
    if isinstance(named, str):
        builtin = PACKAGE_CONFIGS / f"{named}.yaml"
        if not Path(named).suffix and builtin.exists():
            base = merged(base, {k: v for k, v in load_yaml(builtin).items() if k != "features"})
        data["features"] = load_feature_set(named).model_dump()
    return parse_config(PipelineConfig, merged(base, data), str(path))


def synth_config(preset: str, **overrides: Any) -> SynthConfig:
    if preset not in SYNTH_PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(SYNTH_PRESETS)}")
    values = {**SYNTH_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return parse_config(SynthConfig, values, f"preset {preset!r}")
