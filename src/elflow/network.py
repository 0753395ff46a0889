"""Deprecated: ``elflow.network`` is :mod:`elflow.wiring` under an older name.

:mod:`elflow.wiring` is the network wired to the maths (make_denoiser, make_decoder, TrainForward,
sample_model); this module still gives its public names, with a ``DeprecationWarning``, and goes in
a later version.
"""

import warnings

from elflow.wiring import (
    DECODE_CHUNK_BYTES,
    TrainForward,
    decode_logits,
    decode_rows,
    decode_tokens,
    make_decoder,
    make_denoiser,
    projector,
    sample_model,
    sampling_w,
)

warnings.warn(
    "elflow.network is elflow.wiring under an older name; "
    "import from elflow.wiring (elflow.network goes in a later version)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "DECODE_CHUNK_BYTES",
    "TrainForward",
    "decode_logits",
    "decode_rows",
    "decode_tokens",
    "make_decoder",
    "make_denoiser",
    "projector",
    "sample_model",
    "sampling_w",
]
