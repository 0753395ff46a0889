"""Typed configuration for the network, the training objective and the sampler.

One frozen dataclass per concern, validated in ``__post_init__``; defaults are the paper's released
values (ELF_SPEC §2, §3, §5), not the reference code's class defaults. Presets are plain
functions in :data:`MODEL_PRESETS`. :func:`from_dict` rejects unknown keys instead of dropping them.
Each field's docstring is its documentation and its command-line help (:func:`field_docs`).
:class:`SamplerConfig` is the one carrier of sampler settings from the command line or Python to
the sampler. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from elflow.errors import ELFError, require

T = TypeVar("T")

T5_SMALL = "google-t5/t5-small"
"""The paper's frozen encoder and tokenizer (ELF_SPEC §1)."""


@dataclass(frozen=True)
class ModelConfig:
    """The ELF network's shape (ELF_SPEC §2)."""

    encoder_dim: int = 512
    """E: width of the frozen encoder's latents (512 for T5-small)."""
    vocab_size: int = 32100
    """V: size of the decoder head, ``len(tokenizer)``."""
    max_length: int = 1024
    """Longest sequence the network accepts (RoPE table size)."""
    hidden_size: int = 768
    """D: transformer width."""
    depth: int = 12
    """Number of transformer blocks."""
    num_heads: int = 12
    """Attention heads; D must be divisible by it."""
    mlp_ratio: float = 4.0
    """SwiGLU hidden size is int(int(mlp_ratio * D) * 2 / 3)."""
    bottleneck_dim: int = 128
    """Width of the input bottleneck E -> bottleneck -> D."""
    num_time_tokens: int = 4
    """Prefix tokens carrying the time embedding."""
    num_scale_tokens: int = 4
    """Prefix tokens carrying the SC-CFG scale w (0: the model has no scale tokens)."""
    num_mode_tokens: int = 4
    """Prefix tokens switching between denoise (gate 0) and decode (gate 1) mode."""
    self_condition: bool = True
    """Input is [z_t, x_selfcond] (2E wide) and goes through ``self_cond_proj``."""
    dropout: float = 0.0
    """Dropout in the middle half of the blocks (0 in every released config)."""
    rope_theta: float = 10000.0
    """RoPE base."""

    def __post_init__(self) -> None:
        for name in ("encoder_dim", "vocab_size", "max_length", "hidden_size", "depth"):
            require(
                getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}"
            )
        require(self.num_heads > 0, f"model.num_heads must be positive, got {self.num_heads}")
        require(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}",
        )
        require(self.head_dim % 2 == 0, f"model head_dim {self.head_dim} must be even for RoPE")
        require(
            self.bottleneck_dim > 0,
            f"model.bottleneck_dim must be positive, got {self.bottleneck_dim}",
        )
        require(self.mlp_ratio > 0, f"model.mlp_ratio must be positive, got {self.mlp_ratio}")
        for name in ("num_time_tokens", "num_scale_tokens", "num_mode_tokens"):
            require(
                getattr(self, name) >= 0, f"model.{name} must be >= 0, got {getattr(self, name)}"
            )
        require(
            self.num_time_tokens > 0, "model.num_time_tokens must be >= 1 (time must reach the net)"
        )
        require(
            self.num_mode_tokens > 0, "model.num_mode_tokens must be >= 1 (decode mode needs them)"
        )
        require(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        require(self.rope_theta > 0, f"model.rope_theta must be positive, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(int(self.mlp_ratio * self.hidden_size) * 2 / 3)

    @property
    def num_prefix_tokens(self) -> int:
        return self.num_time_tokens + self.num_scale_tokens + self.num_mode_tokens

    @property
    def num_parameters(self) -> int:
        """The network's parameter count, worked out from the shapes alone (no allocation)."""
        D, E, F, B, hd = (
            self.hidden_size,
            self.encoder_dim,
            self.mlp_hidden,
            self.bottleneck_dim,
            self.head_dim,
        )
        embedder = 256 * D + D + D * D + D  # a timestep embedder's two layers
        n = E * B + B * D + D + embedder + (self.num_time_tokens + self.num_mode_tokens) * D
        if self.self_condition:
            n += 2 * E * E + E
        if self.num_scale_tokens:
            n += embedder + self.num_scale_tokens * D
        block = 2 * D + 3 * D * D + 3 * D + 2 * hd + D * D + D + 2 * D * F + 2 * F + F * D + D
        n += self.depth * block
        n += D + D * E + E  # the flow head
        n += D * E + E + E * self.vocab_size + self.vocab_size  # the decoder head
        return n


@dataclass(frozen=True)
class ObjectiveConfig:
    """The training objective's settings (ELF_SPEC §3); defaults are the released OWT values."""

    t_eps: float = 0.05
    """Velocity denominators are max(1 - t, t_eps)."""
    noise_scale: float = 2.0
    """s: the path's noise scale, z_t = t x + (1 - t) s eps."""
    time_mean: float = -1.5
    """t = sigmoid(N(time_mean, time_std))."""
    time_std: float = 0.8
    """See ``time_mean``."""
    decoder_prob: float = 0.2
    """p: probability that an example takes the decoder (cross-entropy) branch."""
    decoder_noise_scale: float = 5.0
    """sigma_d of the decoder branch's corrupted input (5 for OWT, 1 for seq2seq)."""
    decoder_mean: float = 0.8
    """Decoder branch mixing weight lambda = sigmoid(N(decoder_mean, decoder_std)) per token."""
    decoder_std: float = 0.8
    """See ``decoder_mean``."""
    self_cond_prob: float = 0.5
    """Probability that the trained pass receives the self-conditioning prediction."""
    w_min: float = 0.5
    """Smallest SC-CFG scale w (1 + w is log-uniform on [1 + w_min, 1 + w_max])."""
    w_max: float = 5.0
    """Largest SC-CFG scale w."""
    label_drop_prob: float = 0.0
    """Conditional tasks: probability that an example's condition is dropped (0.1 in the paper)."""
    pad_with_eos: bool = False
    """True when the task pads with EOS (seq2seq): padding positions are then trained on."""
    span_cond_prob: float = 0.0
    """Infilling training, an elflow addition (0 = the paper's): the share of unconditional rows
    that keep all but one random span of their text (10-60% of it) as clean condition, as
    infilling samples with it."""

    def __post_init__(self) -> None:
        for name in ("decoder_prob", "self_cond_prob", "label_drop_prob", "span_cond_prob"):
            v = getattr(self, name)
            require(0.0 <= v <= 1.0, f"objective.{name} must be in [0, 1], got {v}")
        require(0.0 < self.t_eps <= 1.0, f"objective.t_eps must be in (0, 1], got {self.t_eps}")
        for name in ("noise_scale", "decoder_noise_scale", "time_std", "decoder_std"):
            require(getattr(self, name) > 0, f"objective.{name} must be positive")
        require(
            -1.0 < self.w_min <= self.w_max,
            f"objective needs -1 < w_min <= w_max, got w_min={self.w_min}, w_max={self.w_max}",
        )


MAX_STEPS = 100_000
"""The most sampler steps accepted: a step count past it is a typo (its time grid alone would
take gigabytes), not a setting."""


@dataclass(frozen=True)
class SamplerConfig:
    """How to sample (ELF_SPEC §5); defaults are ELF-B's 32-step SDE, gamma 1.5, w 3.

    A model's config holds its own defaults (``ELFPipeline.sampler``); change fields with
    ``dataclasses.replace``. Checked against a model by ``ArtifactConfig.check_sampler``.
    """

    steps: int = 32
    """Integration steps N (the time grid has N + 1 points)."""
    sampler: str = "sde"
    """Integrator: ode (Euler), sde (the paper's gamma-SDE), heun (second-order ODE) or pc
    (Euler predictor and a Langevin corrector)."""
    gamma: float = 1.5
    """SDE noise re-injection rate (0 gives the ODE)."""
    gamma_schedule: str = "constant"
    """How the SDE's gamma varies with t (an elflow addition): constant (the paper's), or
    linear, quadratic, cosine, annealing from gamma at t = 0 to 0 at the data."""
    pc_snr: float = 0.1
    """Signal-to-noise ratio that sets the pc sampler's Langevin corrector step."""
    w: float = 3.0
    """Self-conditioning CFG scale fed to the scale tokens."""
    cfg: float = 1.0
    """Classifier-free guidance on the source, conditional models only (1 = off)."""
    time_grid: str = "logit_normal"
    """Time grid: logit_normal (the released configs) or uniform."""
    time_mean: float = -1.5
    """Location of the logit-normal time grid."""
    time_std: float = 0.8
    """Scale of the logit-normal time grid."""
    project_from: float = 1.0
    """Projected sampling, an elflow addition: re-encode the decoded text of every clean estimate
    made at t >= this (unconditional models; 1 = off, the paper's sampler)."""
    length: int = 0
    """Tokens per unconditional sample (0 = the model's max_length)."""
    length_range: str = ""
    """Length control, an elflow addition: N or A:B tokens (exact), A:Bw words (approximate), or
    data (lengths drawn like the training data's); empty: wherever the model ends its text."""
    refresh_from: float = 0.0
    """Infilling and length control: recompute the kept tokens' latents from the current fill at
    t >= this (1 = keep their first encoding, made with a placeholder in the gaps)."""

    def __post_init__(self) -> None:
        names = ("gamma", "w", "cfg", "time_mean", "time_std", "project_from", "pc_snr")
        for name in (*names, "refresh_from"):
            value = getattr(self, name)
            require(math.isfinite(value), f"sampler.{name} must be a finite number, got {value}")
        require(self.steps >= 1, f"sampler.steps must be >= 1, got {self.steps}")
        require(
            self.steps <= MAX_STEPS,
            f"sampler.steps {self.steps} is over {MAX_STEPS}; ELF samples in 1 to a few hundred",
        )
        require(
            self.sampler in SAMPLERS,
            f"sampler.sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}",
        )
        require(
            self.time_grid in TIME_GRIDS,
            f"sampler.time_grid must be one of {', '.join(TIME_GRIDS)}, got {self.time_grid!r}",
        )
        require(self.gamma >= 0, f"sampler.gamma must be >= 0, got {self.gamma}")
        require(
            self.gamma_schedule in GAMMA_SCHEDULES,
            f"sampler.gamma_schedule must be one of {', '.join(GAMMA_SCHEDULES)}, "
            f"got {self.gamma_schedule!r}",
        )
        require(self.pc_snr > 0, f"sampler.pc_snr must be positive, got {self.pc_snr}")
        require(self.w > -1.0, f"sampler.w must be > -1, got {self.w}")
        require(self.cfg >= 0, f"sampler.cfg must be >= 0, got {self.cfg}")
        require(self.time_std > 0, f"sampler.time_std must be positive, got {self.time_std}")
        require(
            0.0 <= self.project_from <= 1.0,
            f"sampler.project_from must be in [0, 1] (1 = off), got {self.project_from}",
        )
        require(
            self.length >= 0, f"sampler.length must be >= 0 (0 = the model's), got {self.length}"
        )
        require(
            0.0 <= self.refresh_from <= 1.0,
            f"sampler.refresh_from must be in [0, 1] (1 = never), got {self.refresh_from}",
        )
        require(
            LENGTH_RANGE.fullmatch(self.length_range) is not None,
            f"sampler.length_range must be N, A:B (tokens), A:Bw (words) or data, "
            f"got {self.length_range!r}",
        )
        require(
            not (self.length and self.length_range),
            "sampler.length sets the rows' length, sampler.length_range the text's: give one",
        )
        if self.length_range not in ("", "data"):
            lo, hi, _ = length_bounds(self.length_range)
            require(1 <= lo <= hi, f"sampler.length_range needs 1 <= A <= B, got {lo}:{hi}")

    @property
    def nfe(self) -> int:
        """Network evaluations per sample (the final decode not counted; a Heun or pc step is two,
        the last step being Euler)."""
        return SAMPLERS[self.sampler].nfe(self.steps)


LENGTH_RANGE = re.compile(r"|data|\d+(:\d+)?w?")


def check_task(task: str, max_input_length: int, max_length: int) -> None:
    """The task, and a conditional row's split between source and target: the one rule a run's
    config and a saved model's both follow."""
    if task not in ("unconditional", "conditional"):
        raise ELFError(f"task must be 'unconditional' or 'conditional', got {task!r}")
    if task == "conditional" and not 0 < max_input_length < max_length:
        raise ELFError(
            f"a conditional task needs 0 < max_input_length ({max_input_length}) < "
            f"model.max_length ({max_length}); set max_input_length, the source's share of each "
            f"row (e.g. {max_length // 2})"
        )


def check_guidance(task: str, sampler: SamplerConfig) -> None:
    """Classifier-free guidance needs a source to guide by (runs and saved models alike)."""
    if task != "conditional" and sampler.cfg != 1.0:
        raise ELFError(
            f"sampler.cfg {sampler.cfg} (classifier-free guidance on the source) applies to "
            "conditional tasks only; leave it at 1"
        )


def length_bounds(length_range: str) -> tuple[int, int, bool]:
    """``"10:20w"`` -> (10, 20, True): the bounds of a numeric ``length_range`` and whether they
    count words."""
    words = length_range.endswith("w")
    lo, _, hi = length_range.removesuffix("w").partition(":")
    return int(lo), int(hi or lo), words


def fewstep_sampler(base: SamplerConfig, steps: int) -> SamplerConfig:
    """``base`` with the distilled students' settings (ELF_SPEC §5 "Distilled few-step"): the SDE
    with gamma 1.5 and w 2.5 up to 8 steps, gamma 2 and w 2 above (9-15 take the 16-32 values)."""
    gamma, w = (1.5, 2.5) if steps <= 8 else (2.0, 2.0)
    return dataclasses.replace(base, steps=steps, sampler="sde", gamma=gamma, w=w)


@dataclass(frozen=True)
class SamplerSpec:
    """What a sampler is, in one place: its name, what the trajectory page says of it, the
    :class:`SamplerConfig` fields only it uses, its network evaluations and its step. Records,
    sweep cells, the trajectory page, the model's sampler check and the command line's
    ``--sampler`` all read :data:`SAMPLERS`; :func:`register_sampler` adds one."""

    name: str
    title: str
    """As the trajectory page names it ("SDE")."""
    description: str
    """One line on what a step does."""
    settings: tuple[str, ...] = ()
    """The SamplerConfig fields only this sampler uses (recorded as null for the others, and
    sweep axes of their own)."""
    evals_per_step: int = 1
    """Network evaluations a step makes (the last step is always one Euler evaluation)."""
    step: Callable[..., Any] | None = None
    """``step(denoise, z, x_prev, t, t_next, ctx) -> (z_next, x_hat)`` with ``ctx`` an
    :class:`elflow.sampling.sample_loop.StepContext`; None for the built-in samplers, whose steps live in
    :mod:`elflow.sampling.sample_loop`."""
    eval_time: Callable[..., Any] | None = None
    """``eval_time(t, t_next, settings) -> t_eval``: the time of a step's (first) network
    evaluation when it is not ``t`` (the SDE's, after stepping back); the trajectory page
    names the projected steps from it."""

    def nfe(self, steps: int) -> int:
        return self.evals_per_step * (steps - 1) + 1


def _sde_eval_time(t: Any, t_next: Any, settings: Any) -> Any:
    from elflow.flow import backtrack_alpha, gamma_at

    rate = gamma_at(settings.get("gamma_schedule") or "constant", float(settings["gamma"]), t)
    return t * backtrack_alpha(t, t_next, rate)


def _renoise_step(*args: Any) -> Any:
    from elflow.distill.consistency import renoise_step  # imported on use: no torch in this module

    return renoise_step(*args)


SAMPLERS: dict[str, SamplerSpec] = {
    s.name: s
    for s in (
        SamplerSpec("ode", "ODE", "deterministic Euler steps along the flow"),
        SamplerSpec(
            "sde",
            "SDE",
            "Euler steps that first put some noise back (the paper's stochastic sampler)",
            settings=("gamma", "gamma_schedule"),
            eval_time=_sde_eval_time,
        ),
        SamplerSpec(
            "heun",
            "Heun",
            "second-order steps: an Euler step corrected by a second network evaluation",
            evals_per_step=2,
        ),
        SamplerSpec(
            "pc",
            "predictor-corrector",
            "an Euler step, then one Langevin correction move",
            settings=("pc_snr",),
            evals_per_step=2,
        ),
        SamplerSpec(
            "renoise",
            "re-noising",
            "takes the clean estimate as the sample and noises it afresh to the next time "
            "(multistep consistency sampling, for consistency-distilled students)",
            step=_renoise_step,
        ),
    )
}
"""The samplers by name (a live mapping: :func:`register_sampler` adds to it)."""


def register_sampler(spec: SamplerSpec) -> SamplerSpec:
    """Make ``spec`` a sampler everywhere (``SamplerConfig(sampler=spec.name)``, ``--sampler``,
    records, sweeps, the trajectory page); its ``step`` is required. Returns it."""
    if spec.step is None:
        raise ELFError(f"sampler {spec.name!r} needs a step function")
    if spec.name in SAMPLERS:
        raise ELFError(f"a sampler named {spec.name!r} is already registered")
    unknown = set(spec.settings) - {f.name for f in dataclasses.fields(SamplerConfig)}
    if unknown:
        raise ELFError(f"sampler {spec.name!r} names settings SamplerConfig lacks: {unknown}")
    SAMPLERS[spec.name] = spec
    return spec


def unregister_sampler(name: str) -> None:
    """Remove a sampler :func:`register_sampler` added (the built-in ones stay)."""
    if SAMPLERS.get(name) is not None and SAMPLERS[name].step is None:
        raise ELFError(f"{name!r} is a built-in sampler")
    SAMPLERS.pop(name, None)


def sampler_own_settings() -> set[str]:
    """The SamplerConfig fields some sampler uses alone (``gamma`` for the SDE, ...)."""
    return {f for s in SAMPLERS.values() for f in s.settings}


def unused_settings(name: str) -> set[str]:
    """The SamplerConfig fields other samplers use alone, which sampler ``name`` ignores."""
    own = SAMPLERS[name].settings
    return {f for s in SAMPLERS.values() for f in s.settings if f not in own}


TIME_GRIDS = ("logit_normal", "uniform")
GAMMA_SCHEDULES = ("constant", "linear", "quadratic", "cosine")
CHOICES: dict[str, tuple[str, ...]] = {
    "sampler": SAMPLERS,
    "time_grid": TIME_GRIDS,
    "gamma_schedule": GAMMA_SCHEDULES,
}
"""The allowed values of the string fields (command-line choices)."""

PAPER_TASKS: dict[str, dict[str, Any]] = {
    "owt": dict(max_length=1024, task="unconditional", max_input_length=0, pad_with_eos=False),
    "de-en": dict(max_length=128, task="conditional", max_input_length=64, pad_with_eos=True),
    "xsum": dict(max_length=1088, task="conditional", max_input_length=1024, pad_with_eos=True),
}
"""The paper's tasks, for the authors' checkpoints, which record none (ELF_SPEC §4, §5)."""


def elf_b(**overrides: Any) -> ModelConfig:
    """ELF-B: depth 12, D 768, 12 heads (ELF_SPEC §2)."""
    return ModelConfig(**{"depth": 12, "hidden_size": 768, "num_heads": 12, **overrides})


def elf_m(**overrides: Any) -> ModelConfig:
    """ELF-M: depth 24, D 1056, 16 heads."""
    return ModelConfig(**{"depth": 24, "hidden_size": 1056, "num_heads": 16, **overrides})


def elf_l(**overrides: Any) -> ModelConfig:
    """ELF-L: depth 32, D 1280, 16 heads."""
    return ModelConfig(**{"depth": 32, "hidden_size": 1280, "num_heads": 16, **overrides})


def elf_small(**overrides: Any) -> ModelConfig:
    """A CPU-sized network: depth 6, D 256, 4 heads (the CPU pilot's size)."""
    return ModelConfig(**{"depth": 6, "hidden_size": 256, "num_heads": 4, **overrides})


def elf_tiny(**overrides: Any) -> ModelConfig:
    """A test-sized network: depth 2, D 64, 4 heads, bottleneck 16."""
    base = {"depth": 2, "hidden_size": 64, "num_heads": 4, "bottleneck_dim": 16}
    return ModelConfig(**{**base, **overrides})


MODEL_PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "elf-b": elf_b,
    "elf-m": elf_m,
    "elf-l": elf_l,
    "elf-small": elf_small,
    "elf-tiny": elf_tiny,
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """Build a registered model preset, e.g. ``model_preset("elf-b", encoder_dim=384)``."""
    if name not in MODEL_PRESETS:
        raise ELFError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name](**overrides)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config dataclass (nested dataclasses included)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build ``cls`` from ``data``; unknown keys and wrong types are one-line errors."""
    if not isinstance(data, dict):
        raise ELFError(f"config section {where or cls.__name__} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ELFError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, fields[name], f"{where}.{name}" if where else name)
    return cls(**kwargs)


def coerce_field(cls: type, name: str, value: Any, where: str) -> Any:
    """``value`` for field ``name`` of dataclass ``cls``, type-checked as :func:`from_dict` does."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _coerce(value, field, where)


def _coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if typ == "bool":
        if isinstance(value, bool):
            return value
        raise ELFError(f"{where} must be true or false, got {value!r}")
    if typ == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ELFError(f"{where} must be an integer, got {value!r}")
    if typ == "float":
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ELFError(f"{where} must be a finite number, got {value!r}")
            return float(value)
        raise ELFError(f"{where} must be a number, got {value!r}")
    if typ == "str":
        if isinstance(value, str):
            return value
        raise ELFError(f"{where} must be a string, got {value!r}")
    return value


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it), whitespace-collapsed: the one
    source of a config key's documentation and command-line help."""
    import ast
    import inspect
    import itertools
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen application): no help text
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
