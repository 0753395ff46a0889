"""How to sample (ELF_SPEC §5): :class:`SamplerConfig`, the one carrier of sampler settings from
the command line, the server or Python to the sampler, with its checks and the one helper that
changes a sampler's settings (:func:`change_sampler`, shared by the command line and the server).

Which samplers exist is the registry's business (:mod:`elflow.sampling.registry`, torch-free);
a sampler's own settings are the :class:`SamplerConfig` fields its spec names. Nothing here
imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from elflow.errors import ELFError, require
from elflow.sampling.registry import SAMPLERS

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
    """The sampler, by its name in :data:`elflow.config.SAMPLERS` (``elflow sample --help`` lists
    them; the paper's is sde)."""
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
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(SAMPLERS[self.sampler].settings) - fields)
        require(
            not unknown,
            f"sampler {self.sampler!r} names settings SamplerConfig lacks: {', '.join(unknown)}",
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


TIME_GRIDS = ("logit_normal", "uniform")
GAMMA_SCHEDULES = ("constant", "linear", "quadratic", "cosine")
CHOICES: dict[str, Collection[str]] = {
    "sampler": SAMPLERS,
    "time_grid": TIME_GRIDS,
    "gamma_schedule": GAMMA_SCHEDULES,
}
"""The allowed values of the string fields (command-line choices)."""


def change_sampler(base: SamplerConfig, changes: Mapping[str, Any]) -> SamplerConfig:
    """``base`` (a model's defaults) with ``changes`` (field -> value) made: the one way the
    command line and the server change a sampler, so both give the same one-line errors (an
    unknown field, a bad value, or a setting the chosen sampler's spec refuses, such as the SDE
    at gamma 0). Errors name fields ``sampler.<field>``."""
    fields = {f.name for f in dataclasses.fields(SamplerConfig)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ELFError(f"unknown sampler setting(s) {', '.join(unknown)}; valid: {sorted(fields)}")
    changed = dataclasses.replace(base, **changes)
    if "sampler" in changes:
        check = SAMPLERS[changed.sampler].check_choice
        problem = check(base, changes) if check is not None else None
        if problem:
            raise ELFError(problem)
    return changed
