"""Deprecated: ``elflow.likelihood`` is :mod:`elflow.likelihood_maths` under an older name.

:mod:`elflow.likelihood_maths` is the probability-flow likelihood's maths (the ODE log-density and
the NLL bound, over a velocity callable); this module still gives its public names, with a
``DeprecationWarning``, and goes in a later version.
"""

import warnings

from elflow.likelihood_maths import (
    DIVERGENCES,
    Velocity,
    gaussian_log_density,
    nll_bound,
    ode_log_density,
    rademacher,
    velocity_and_divergence,
)

warnings.warn(
    "elflow.likelihood is elflow.likelihood_maths under an older name; "
    "import from elflow.likelihood_maths (elflow.likelihood goes in a later version)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "DIVERGENCES",
    "Velocity",
    "gaussian_log_density",
    "nll_bound",
    "ode_log_density",
    "rademacher",
    "velocity_and_divergence",
]
