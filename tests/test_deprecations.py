"""Old import paths keep working for one release, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_elflow_score_is_elflow_evaluation_with_a_warning():
    import elflow.evaluation as evaluation

    sys.modules.pop("elflow.score", None)
    with pytest.warns(DeprecationWarning, match="import from elflow.evaluation"):
        score = importlib.import_module("elflow.score")
    for name in score.__all__:
        assert getattr(score, name) is getattr(evaluation, name)


RENAMED = {
    "elflow.infill": "elflow.infill_maths",
    "elflow.likelihood": "elflow.likelihood_maths",
    "elflow.distill": "elflow.distill_objective",
    "elflow.network": "elflow.wiring",
}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_renamed_module_still_imports_with_a_warning_naming_the_new_one(old):
    new = importlib.import_module(RENAMED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"import from {RENAMED[old]} "):
        shim = importlib.import_module(old)
    assert shim.__all__, old
    for name in shim.__all__:  # the names the old module had, the very same objects
        assert getattr(shim, name) is getattr(new, name)


@pytest.mark.slow
def test_the_package_imports_no_old_name():
    """Every module under the new names, and the lazy exports, load with no DeprecationWarning."""
    code = (
        "import importlib, warnings\n"
        "warnings.filterwarnings('error', r'elflow\\.', DeprecationWarning)\n"
        f"for m in {sorted(set(RENAMED.values()))!r} + ['elflow.generation.engine',"
        " 'elflow.generation.infill', 'elflow.generation.likelihood', 'elflow.train.curriculum']:\n"
        "    importlib.import_module(m)\n"
        "import elflow\n"
        "for name in elflow.__all__:\n"
        "    getattr(elflow, name)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
