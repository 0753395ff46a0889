"""The full configuration of a training run and its overrides (ELF_SPEC §3, §4).

:class:`RunConfig` nests one frozen dataclass per concern (model, objective, sampler, data, optim,
train, encoder); the named starting points are in :mod:`elflow.config.run_presets`.
``--config FILE`` and ``--set a.b=value`` go through :func:`apply_overrides`: unknown keys and
wrong types are one-line errors. The network's E and V always come from the encoder and
tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from elflow.config.data_config import DataConfig
from elflow.config.encoder_config import EncoderConfig
from elflow.config.model_config import ModelConfig, elf_b
from elflow.config.objective_config import ObjectiveConfig
from elflow.config.optim_config import OptimConfig
from elflow.config.sampler_config import SamplerConfig, check_guidance, check_task
from elflow.config.serialise import coerce_field, from_dict, to_dict
from elflow.config.train_loop_config import TrainConfig
from elflow.errors import ELFError, first_line, note_once


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; written as ``config.json`` next to every checkpoint."""

    model: ModelConfig = field(default_factory=elf_b)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    task: str = "unconditional"
    """'unconditional' or 'conditional'."""
    max_input_length: int = 0
    """Conditional tasks: source tokens kept; the target gets max_length - max_input_length."""
    preset: str = ""
    """The preset this config started from (informational)."""

    def __post_init__(self) -> None:
        check_task(self.task, self.max_input_length, self.model.max_length)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "objective": ObjectiveConfig,
    "sampler": SamplerConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "encoder": EncoderConfig,
}
_SCALARS = ("task", "max_input_length", "preset")


def run_config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return to_dict(cfg)


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from nested dicts; unknown sections/keys and wrong types are errors."""
    if not isinstance(data, dict):
        raise ELFError(f"a run config must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SECTIONS) - set(_SCALARS))
    if unknown:
        raise ELFError(
            f"unknown config key(s) {unknown}; valid: {sorted(SECTIONS) + list(_SCALARS)}"
        )
    train = data.get("train", {})
    if isinstance(train, dict):
        # Configs before 'none' | 'blocks' (| 'step') said false | true.
        old = {k: v for k, v in train.items() if k in ("activation_checkpointing", "compile")}
        flags = {k: "blocks" if v else "none" for k, v in old.items() if isinstance(v, bool)}
        if flags:
            data = {**data, "train": {**train, **flags}}
    kwargs: dict[str, Any] = {
        name: from_dict(cls, data.get(name, {}), name) for name, cls in SECTIONS.items()
    }
    for key in _SCALARS:
        if key in data:
            kwargs[key] = coerce_field(RunConfig, key, data[key], key)
    return RunConfig(**kwargs)


def parse_value(text: str) -> Any:
    """Parse a ``key=value`` setting's value: JSON (numbers, true/false, null, lists) or else a
    bare string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(
    cfg: RunConfig, file: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Apply a YAML/JSON config file, then ``key.path=value`` settings, to ``cfg``."""
    data = run_config_to_dict(cfg)
    if file:
        _merge(data, _read_config_file(Path(file)), str(file))
    for item in sets:
        if "=" not in item:
            raise ELFError(f"sets= expects key.path=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                raise ELFError(f"unknown config key {'.'.join(parts[: i + 1])!r} in {item!r}")
            node = node[part]
        if parts[-1] not in node:
            raise ELFError(f"unknown config key {key!r}; valid keys there: {sorted(node)}")
        if isinstance(node[parts[-1]], dict):
            raise ELFError(
                f"{key.strip()}=... names a whole section; set its keys one at a time, "
                f"e.g. {key.strip()}.{sorted(node[parts[-1]])[0]}=VALUE"
            )
        node[parts[-1]] = parse_value(value)
    return check_user_config(run_config_from_dict(data), cfg)


def _unprojectable(cfg: RunConfig) -> str | None:
    """Why projected sampling cannot run on this run's rows (it re-encodes one text per row)."""
    if cfg.task == "conditional":
        return "a conditional task"
    return "data.packing" if cfg.data.packing else None


def check_projection(cfg: RunConfig) -> None:
    """Projected sampling (``sampler.project_from < 1``) only on rows of one unconditional text."""
    why = _unprojectable(cfg)
    if cfg.sampler.project_from < 1.0 and why:
        raise ELFError(
            f"sampler.project_from={cfg.sampler.project_from} (projected sampling) re-encodes "
            f"one text per row and does not apply with {why}; set sampler.project_from=1"
        )


def check_user_config(cfg: RunConfig, base: RunConfig) -> RunConfig:
    """Settings that would be silently ignored, refused: those only a conditional task uses on an
    unconditional one, two warm-up lengths, and schedule settings the schedule does not use
    (those changed from ``base``, the config overridden: a preset's own decay_steps is harmless
    when the user picks another schedule); also an encoder layer left with T5's output's
    latent_std. Checked on what a user asks for, not in :class:`RunConfig` itself, so that runs
    saved before the check still resume (their values were ignored), and so that a model's
    encoder (:class:`EncoderConfig`) is described whatever its values."""
    why = _unprojectable(cfg)
    project_from = cfg.sampler.project_from
    if project_from < 1.0 and why and project_from == base.sampler.project_from:
        # The preset's projection (bible-tiny's), not the user's: off for rows it cannot handle.
        note_once(
            f"elflow: note: the preset samples with projection (sampler.project_from "
            f"{project_from}), which does not apply with {why}: it is off for this run"
        )
        cfg = replace(cfg, sampler=replace(cfg.sampler, project_from=1.0))
    check_projection(cfg)
    check_guidance(cfg.task, cfg.sampler)
    if cfg.encoder.layer and cfg.encoder.latent_std == 0.2:
        raise ELFError(
            f"encoder.layer={cfg.encoder.layer} with latent_std 0.2 (T5's output's): set "
            "encoder.latent_std=0 to measure it for that layer, or give its value"
        )
    if cfg.task == "conditional" and cfg.objective.span_cond_prob > 0:
        raise ELFError(
            "objective.span_cond_prob trains unconditional models to infill; a conditional task "
            "keeps its source as the condition: leave it at 0"
        )
    if cfg.task == "unconditional" and cfg.max_input_length:
        raise ELFError(
            f"max_input_length {cfg.max_input_length} applies to conditional tasks only "
            "(the source's share of each row); leave it at 0, or set task=conditional for "
            "source/target data"
        )
    if (
        cfg.train.eval_every
        and base.data.valid_path
        and cfg.data.path != base.data.path
        and cfg.data.valid_path == base.data.valid_path
    ):
        note_once(
            f"elflow: note: data.path is yours but data.valid_path is still the preset's "
            f"({cfg.data.valid_path}): the held-out 'valid' loss is measured on it; set "
            "data.valid_path to your validation data (empty: none)"
        )
    if cfg.train.epochs != base.train.epochs and cfg.train.max_steps > 0:
        raise ELFError(
            f"train.epochs={cfg.train.epochs} applies when train.max_steps=0 (it is "
            f"{cfg.train.max_steps}); drop it, or set train.max_steps=0 to train by epochs"
        )
    o = cfg.optim
    if cfg.train.warmup_epochs > 0 and o.warmup_steps > 0:
        raise ELFError(
            f"train.warmup_epochs={cfg.train.warmup_epochs} and optim.warmup_steps="
            f"{o.warmup_steps} both set the warm-up; set the other one to 0"
        )
    was = base.optim
    if o.decay_steps != was.decay_steps and o.decay_steps and o.schedule != "wsd":
        raise ELFError(
            f"optim.decay_steps={o.decay_steps} applies to optim.schedule=wsd only (it is "
            f"{o.schedule}); set the schedule or leave decay_steps at 0"
        )
    if o.min_lr_ratio != was.min_lr_ratio and o.min_lr_ratio and o.schedule == "constant":
        raise ELFError(
            f"optim.min_lr_ratio={o.min_lr_ratio} applies to the cosine and wsd schedules only; "
            "set optim.schedule or leave min_lr_ratio at 0"
        )
    return cfg


def override_keys(
    file: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()
) -> set[str]:
    """The dotted keys a config file and ``key.path=value`` settings name (call after
    :func:`apply_overrides` has validated them)."""
    keys: set[str] = set()

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, prefix + key + ".")
            else:
                keys.add(prefix + key)

    if file:
        walk(_read_config_file(Path(file)), "")
    keys.update(item.split("=", 1)[0].strip() for item in sets)
    return keys


def _read_config_file(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ELFError(f"config file {path} is a folder; give a YAML or JSON file")
    if not path.is_file():
        raise ELFError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        where = f"{e.reason} at byte {e.start}"
        raise ELFError(f"config file {path} is not UTF-8 text ({where})") from None
    if path.suffix == ".json":
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as e:
            raise ELFError(f"{path}: invalid JSON ({e})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ELFError("YAML config files need PyYAML: pip install pyyaml") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ELFError(f"{path}: invalid YAML ({first_line(e)})") from None
    if not isinstance(loaded, dict):
        raise ELFError(f"{path} must hold a mapping of config sections")
    return loaded


def _merge(base: dict[str, Any], update: dict[str, Any], where: str, prefix: str = "") -> None:
    for key, value in update.items():
        if key not in base:
            raise ELFError(f"unknown config key {prefix + key!r} in {where}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ELFError(f"config key {prefix + key!r} in {where} must be a mapping")
            _merge(base[key], value, where, prefix + key + ".")
        else:
            base[key] = value
