"""A model folder's ``config.json``: :class:`ArtifactConfig` (ELF_SPEC §10).

Network dims, the encoder (an :class:`~elflow.config.encoder_config.EncoderConfig`, kept in the
file as flat keys), tokenizer, latent normalisation, lengths, task, padding policy, noise scale,
t_eps and sampler defaults: everything needed to sample from a model without guessing. Keys added
after elflow 0.1 are left out of the file at their defaults, so that 0.1 loads it; which they
are is derived from the dataclasses (:data:`SAMPLER_KEYS_SINCE_0_2`, :data:`KEYS_SINCE_0_2`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from elflow.config import (
    PAPER_TASKS,
    T5_SMALL,
    ModelConfig,
    SamplerConfig,
    check_guidance,
    check_task,
    from_dict,
    to_dict,
)
from elflow.config.encoder_config import EncoderConfig
from elflow.errors import ELFError
from elflow.io.model_sources import CONFIG
from elflow.io.official import infer_model_config

FORMAT = "elflow-model"
FORMAT_VERSION = 1

SAMPLER_KEYS_0_1 = (
    "steps",
    "sampler",
    "gamma",
    "w",
    "cfg",
    "time_grid",
    "time_mean",
    "time_std",
    "project_from",
)
"""The sampler keys of elflow 0.1's config.json (a fixed fact about that format, never extended):
every later :class:`SamplerConfig` field is written only when it differs from its default."""

KEYS_0_1 = (
    "model",
    "sampler",
    "encoder",
    "tokenizer",
    "tokenizer_hash",
    "latent_mean",
    "latent_std",
    "task",
    "max_input_length",
    "pad_with_eos",
    "noise_scale",
    "t_eps",
    "origin",
)
"""The top-level keys of elflow 0.1's config.json (fixed, like :data:`SAMPLER_KEYS_0_1`)."""


def _defaults_since_0_1(cls: type, keys_0_1: tuple[str, ...]) -> dict[str, Any]:
    """``cls``'s fields that elflow 0.1 did not know, with their defaults as JSON values."""
    found = {}
    for f in fields(cls):
        if f.name in keys_0_1:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        found[f.name] = list(default) if isinstance(default, tuple | list) else default
    return found


SAMPLER_KEYS_SINCE_0_2 = _defaults_since_0_1(SamplerConfig, SAMPLER_KEYS_0_1)
"""Sampler keys a model's config.json leaves out at their defaults (derived from
:class:`SamplerConfig`), so that elflow 0.1 loads it."""


@dataclass(frozen=True)
class ArtifactConfig:
    """Everything needed to sample from a model without guessing (ELF_SPEC §10)."""

    model: ModelConfig
    """Network dims and token counts."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Sampler defaults for this model."""
    encoder: str = T5_SMALL
    """Hub id or local folder of the frozen encoder (:attr:`encoder_config`'s ``name``)."""
    encoder_layer: int = 0
    """0 = the encoder's output; k = the output of its block k (``EncoderConfig.layer``)."""
    tokenizer: str = T5_SMALL
    """Hub id or local folder of the tokenizer (a ``tokenizer/`` subfolder of the model wins)."""
    tokenizer_hash: str | None = None
    """sha256 of the tokenizer vocabulary (checked when the tokenizer is loaded)."""
    latent_mean: float = 0.0
    """Latents are (encoder output - latent_mean) / latent_std."""
    latent_std: float = 0.2
    """See ``latent_mean``; 0.2 for T5-small (the paper's)."""
    task: str = "unconditional"
    """'unconditional' or 'conditional' (source -> target)."""
    max_input_length: int = 0
    """Conditional tasks: source tokens kept (the target gets max_length - max_input_length)."""
    pad_with_eos: bool = False
    """True when the task pads with EOS (seq2seq)."""
    packed: bool = False
    """True when trained on packed rows (several texts a row: ``data.packing``); projected
    sampling, which re-encodes one text per row, does not apply."""
    noise_scale: float = 2.0
    """s: the path's noise scale."""
    t_eps: float = 0.05
    """Velocity denominators are max(1 - t, t_eps)."""
    length_histogram: tuple[int, ...] = ()
    """How many training texts had 0, 1, 2, ... tokens (special tokens not counted): the lengths
    ``length_range=data`` draws from; empty for models trained before it was recorded."""
    tokens_per_word: float = 0.0
    """Mean tokens per word of the training texts (``length_range=A:Bw``; 0: not recorded)."""
    origin: str = ""
    """Free-text provenance (e.g. the imported checkpoint)."""
    data: str = ""
    """The training data as the run named it (``data.path``: a Hub dataset or a local path); a
    training checkpoint's is read from its run config; empty: not recorded."""
    license: str = ""
    """The weights' licence as the Hub names it (e.g. ``apache-2.0``); empty: not stated."""

    def __post_init__(self) -> None:
        check_task(self.task, self.max_input_length, self.model.max_length)
        if not (math.isfinite(self.latent_std) and self.latent_std > 0):
            raise ELFError(f"latent_std must be a positive number, got {self.latent_std}")
        if not math.isfinite(self.latent_mean):
            raise ELFError(f"latent_mean must be a finite number, got {self.latent_mean}")
        if not self.conditional and self.max_input_length != 0:
            raise ELFError(
                f"max_input_length {self.max_input_length} applies to conditional models; "
                "an unconditional model has 0"
            )
        if not (math.isfinite(self.noise_scale) and self.noise_scale > 0):
            raise ELFError(f"noise_scale must be positive, got {self.noise_scale}")
        if not 0 < self.t_eps <= 1:
            raise ELFError(f"t_eps must be in (0, 1], got {self.t_eps}")
        if self.encoder_layer < 0:
            raise ELFError(f"encoder_layer must be >= 0 (0: the output), got {self.encoder_layer}")

    @property
    def conditional(self) -> bool:
        return self.task == "conditional"

    @property
    def encoder_config(self) -> EncoderConfig:
        """The model's frozen encoder as the one description of an encoder: its name, layer,
        tokenizer and latent normalisation (what :func:`elflow.text.encoder.load_encoder`
        builds)."""
        return EncoderConfig(
            name=self.encoder,
            tokenizer=self.tokenizer,
            latent_mean=self.latent_mean,
            latent_std=self.latent_std,
            layer=self.encoder_layer,
        )

    @staticmethod
    def encoder_fields(encoder: EncoderConfig) -> dict[str, Any]:
        """The keyword arguments of an :class:`ArtifactConfig` that describe ``encoder``
        (``ArtifactConfig(model=..., **ArtifactConfig.encoder_fields(encoder))``)."""
        return {
            "encoder": encoder.name,
            "encoder_layer": encoder.layer,
            "tokenizer": encoder.tokenizer_name,
            "latent_mean": encoder.latent_mean,
            "latent_std": encoder.latent_std,
        }

    def check_sampler(self, sampler: SamplerConfig) -> None:
        """One-line errors for sampler settings this model cannot honour: guidance and
        projection on the wrong kind of model, a length it cannot give, and an SDE whose gamma
        left at an ODE model's gamma 0 is caught where the settings are given
        (:func:`elflow.cli.common.sampler_from_args`)."""
        check_guidance(self.task, sampler)
        if sampler.length and self.conditional:
            raise ELFError(
                "sampler.length applies to unconditional models; a conditional model writes its "
                "max_length - max_input_length target tokens"
            )
        if sampler.length > self.model.max_length:
            raise ELFError(
                f"sampler.length {sampler.length} exceeds the model's max_length "
                f"{self.model.max_length}"
            )
        if sampler.project_from < 1.0:
            self.check_projectable(f"sampler.project_from {sampler.project_from}")
        if sampler.length_range == "data" and not self.length_histogram:
            raise ELFError(
                "sampler.length_range data draws lengths from the histogram a model records of "
                "its training texts, and this one has none (trained before it was recorded); "
                "give a range, e.g. 10:30"
            )
        if sampler.length_range and self.model.max_length < 3:
            raise ELFError("sampler.length_range needs rows of at least 3 tokens")

    def check_projectable(self, what: str) -> None:
        """Projected sampling re-encodes one unconditional text per row: not for a conditional
        model, nor for one trained on packed rows (``what`` names the setting asking for it)."""
        if self.conditional or self.packed:
            why = "is conditional" if self.conditional else "was trained on packed rows"
            raise ELFError(
                f"{what} (projected sampling) re-encodes one unconditional text per row, but "
                f"this model {why}; turn it off (sampler.project_from 1)"
            )

    def sample_length(self, sampler: SamplerConfig) -> int:
        """The rows' length L a sample is drawn at (a conditional model: its max_length)."""
        return sampler.length or self.model.max_length

    def to_json(self) -> dict[str, Any]:
        data = to_dict(self)
        for key, default in KEYS_SINCE_0_2.items():  # at their defaults: elflow 0.1 loads it
            value = data[key]
            if (list(value) if isinstance(value, tuple) else value) == default:
                del data[key]
        for key, default in SAMPLER_KEYS_SINCE_0_2.items():
            if data["sampler"][key] == default:
                del data["sampler"][key]
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArtifactConfig:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ELFError(
                "config.json is not an elflow model config (no 'format': 'elflow-model')"
            )
        data = dict(data)
        del data["format"]
        if "format_version" not in data:
            raise ELFError("config.json has no 'format_version'; it was not written by elflow")
        version = data.pop("format_version")
        if version != FORMAT_VERSION:
            raise ELFError(f"unsupported elflow model format_version {version}; upgrade elflow")
        run = data.pop("run", None)  # a training checkpoint's full run config (checkpoint.py)
        if "packed" not in data and isinstance(run, dict):  # saved before configs recorded it
            data["packed"] = bool(run.get("data", {}).get("packing", False))
        if "data" not in data and isinstance(run, dict):  # a training checkpoint's run config
            data["data"] = str(run.get("data", {}).get("path", ""))
        if data.get("task", "unconditional") == "unconditional":
            data["max_input_length"] = 0  # saved by earlier versions from an ignored setting
        counts = data.get("length_histogram", ())
        if not isinstance(counts, list | tuple) or not all(
            isinstance(c, int) and c >= 0 for c in counts
        ):
            raise ELFError("config.json's length_histogram must be a list of counts (ints >= 0)")
        data["length_histogram"] = tuple(counts)
        data["model"] = from_dict(ModelConfig, data.get("model", {}), "model")
        data["sampler"] = from_dict(SamplerConfig, data.get("sampler", {}), "sampler")
        return from_dict(cls, data)


def official_artifact_config(state: dict, task: str, origin: str = "") -> ArtifactConfig:
    """Config for an authors' checkpoint: dims from shapes, the rest from the paper preset."""
    if task not in PAPER_TASKS:
        raise ELFError(f"unknown paper task {task!r}; choose one of {sorted(PAPER_TASKS)}")
    preset = PAPER_TASKS[task]
    model = infer_model_config(state, max_length=preset["max_length"])
    if preset["task"] == "conditional":
        sampler = SamplerConfig(steps=64, sampler="ode", gamma=0.0, w=1.0, cfg=2.0)
    elif model.depth > 12:  # ELF-M / ELF-L
        sampler = SamplerConfig(steps=64, sampler="sde", gamma=1.0, w=3.0)
    else:
        sampler = SamplerConfig(steps=32, sampler="sde", gamma=1.5, w=3.0)
    return ArtifactConfig(
        model=model,
        sampler=sampler,
        task=preset["task"],
        max_input_length=preset["max_input_length"],
        pad_with_eos=preset["pad_with_eos"],
        origin=origin,
    )


KEYS_SINCE_0_2 = _defaults_since_0_1(ArtifactConfig, KEYS_0_1)
"""Top-level keys a model's config.json leaves out at their defaults (derived from
:class:`ArtifactConfig`), so that elflow 0.1 loads it."""


def read_config(folder: Path) -> ArtifactConfig:
    """Read and validate a model folder's ``config.json``."""
    try:
        data = json.loads((folder / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ELFError(f"cannot read {folder / CONFIG}: {e}") from None
    try:
        return ArtifactConfig.from_json(data)
    except ELFError as e:
        # Named as the file spells them ('sampler.steps'), not as a command's flags: the fix
        # is in the file, not on the command line.
        message = re.sub(r"(?<![\w.'\"])((?:sampler|model)\.\w+)", r"'\1'", str(e))
        raise ELFError(f"{folder / CONFIG}: {message}") from None
