"""A progressive-distillation round's settings (ELF_SPEC §8): :class:`DistillConfig`, and the
curriculum of rounds (:data:`ROUNDS`, :func:`parse_rounds`), with their one-line checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from elflow.config.objective_config import ObjectiveConfig
from elflow.errors import ELFError, require

ROUNDS = "16/4,8/8,4/16,2/32,1/64"
"""The paper's curriculum (student steps / teacher sub-steps per student step)."""


@dataclass(frozen=True)
class DistillConfig:
    """One distillation round (ELF_SPEC §8). The settings shared with §3 (t_eps, noise scale, time
    distribution, decoder branch, self-conditioning probability, w range, label drop, padding) are
    the nested :class:`ObjectiveConfig`, so a teacher's objective config is reused unchanged."""

    student_steps: int = 16
    """N: the student's sampling steps; its step size is delta = 1 / N."""
    teacher_substeps: int = 4
    """K: teacher Euler sub-steps per student step (the paper keeps N * K = 64)."""
    teacher_steps: int | None = 64
    """N * K must equal this (teacher sub-steps of 1/64 on average); None allows any N, K."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The §3 settings shared by the decoder rows and the student-step rows."""
    project_from: float = 1.0
    """elflow addition (1 = off, the paper): the teacher's x-predictions at t >= project_from
    (its sub-steps' and the self-conditioning half's) are replaced by the encoder's latents of
    their decoded text, as in projected sampling, so that the student learns the projected
    trajectory. Unconditional teachers with one text per row only."""

    def __post_init__(self) -> None:
        _check_round(self.student_steps, self.teacher_substeps, self.teacher_steps)
        check_project_from(self.project_from, "distill.project_from")

    @property
    def delta(self) -> float:
        """The student's step size 1 / N."""
        return 1.0 / self.student_steps


def _check_round(
    n: int,
    k: int,
    teacher_steps: int | None,
    where: str = "",
    steps_name: str = "teacher_steps",
    allow: str = "set teacher_steps to None",
) -> None:
    """N and K positive and, unless ``teacher_steps`` is None (or 0), N x K == teacher_steps.
    ``where``, ``steps_name`` and ``allow`` word the error (the caller's keys or arguments)."""
    for name, v in (("student_steps", n), ("teacher_substeps", k)):
        require(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            f"distill.{name} must be a positive integer, got {v!r}",
        )
    require(
        not teacher_steps or n * k == teacher_steps,
        f"round {n}/{k}{where} has N x K = {n * k}, but {steps_name} is {teacher_steps} "
        f"(teacher sub-step 1/{teacher_steps}); change the round so that N x K matches, or "
        f"{allow} to allow any N x K",
    )


def check_project_from(value: object, name: str) -> None:
    """A projection start is a number in [0, 1]; ``name`` words the error (a key or argument)."""
    require(
        isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0,
        f"{name} must be a number in [0, 1] (1 = off), got {value!r}",
    )


def parse_rounds(spec: str = ROUNDS, teacher_steps: int | None = 64) -> list[tuple[int, int]]:
    """``"16/4,8/8"`` -> ``[(16, 4), (8, 8)]``: (student steps N, teacher sub-steps K) per round.

    Each round must have N * K == ``teacher_steps`` (ELF_SPEC §8's sub-step size 1/64) unless
    ``teacher_steps`` is None or 0. The two arguments are
    :func:`elflow.distill.curriculum.distill`'s ``rounds`` and ``teacher_steps``, and the errors
    name them so (``rounds=``).
    """
    if teacher_steps is not None and not (type(teacher_steps) is int and teacher_steps >= 0):
        raise ELFError(
            f"teacher_steps= must be a positive integer (or 0 to allow any N x K), "
            f"got {teacher_steps!r}"
        )
    rounds = []
    for item in spec.split(","):
        parts = item.strip().split("/")
        if len(parts) != 2 or not all(p.strip().isdecimal() and int(p) > 0 for p in parts):
            raise ELFError(
                f"bad round {item.strip()!r} in rounds={spec!r}: write rounds as N/K pairs of "
                "positive integers separated by commas, e.g. 16/4,8/8"
            )
        n, k = int(parts[0]), int(parts[1])
        _check_round(n, k, teacher_steps, " in rounds=", "teacher_steps=", "pass teacher_steps=0")
        rounds.append((n, k))
    return rounds
