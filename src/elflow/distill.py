"""Deprecated: ``elflow.distill`` is :mod:`elflow.distill_objective` under an older name.

:mod:`elflow.distill_objective` is the progressive-distillation objective (ELF_SPEC §8); this
module still gives its public names, with a ``DeprecationWarning``, and goes in a later version.
"""

import warnings

from elflow.distill_objective import (
    MIN_SPAN,
    MIN_TS_SCALE,
    ROUNDS,
    DistillConfig,
    DistillDraws,
    DistillLossOutput,
    check_project_from,
    distill_loss,
    distill_targets,
    parse_rounds,
    sample_distill_draws,
    sample_distill_draws_keyed,
)

warnings.warn(
    "elflow.distill is elflow.distill_objective under an older name; "
    "import from elflow.distill_objective (elflow.distill goes in a later version)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "MIN_SPAN",
    "MIN_TS_SCALE",
    "ROUNDS",
    "DistillConfig",
    "DistillDraws",
    "DistillLossOutput",
    "check_project_from",
    "distill_loss",
    "distill_targets",
    "parse_rounds",
    "sample_distill_draws",
    "sample_distill_draws_keyed",
]
