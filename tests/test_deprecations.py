"""Old import paths keep working for one release, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_elflow_score_is_elflow_evaluation_with_a_warning():
    import elflow.evaluation as evaluation

    sys.modules.pop("elflow.score", None)
    with pytest.warns(DeprecationWarning, match="import from elflow.evaluation"):
        score = importlib.import_module("elflow.score")
    for name in score.__all__:
        assert getattr(score, name) is getattr(evaluation, name)
