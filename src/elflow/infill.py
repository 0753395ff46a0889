"""Deprecated: ``elflow.infill`` is :mod:`elflow.infill_maths` under an older name.

:mod:`elflow.infill_maths` is infilling's maths (kept latents held clean, the refresh denoiser,
constrained decoding, over callables); this module still gives its public names, with a
``DeprecationWarning``, and goes in a later version.
"""

import warnings

from elflow.infill_maths import (
    EncodeRows,
    FillVocabulary,
    Logits,
    Template,
    constrained_tokens,
    initial_condition,
    refresh_denoiser,
)

warnings.warn(
    "elflow.infill is elflow.infill_maths under an older name; "
    "import from elflow.infill_maths (elflow.infill goes in a later version)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "EncodeRows",
    "FillVocabulary",
    "Logits",
    "Template",
    "constrained_tokens",
    "initial_condition",
    "refresh_denoiser",
]
