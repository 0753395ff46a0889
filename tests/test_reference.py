"""Number-for-number parity with the authors' code through the reference fixture shipped with
elflow."""

import hashlib

import pytest

from elflow.testing.reference import check_fixture

from .conftest import REFERENCE_FIXTURE, SHARED_FIXTURES


@pytest.fixture(scope="module")
def report():
    return check_fixture(REFERENCE_FIXTURE)


def test_every_entry_within_tolerance(report):
    bad = {k: v for k, v in report.items() if v > 1e-4}
    assert not bad


def test_report_covers_every_case(report):
    import json

    from safetensors import safe_open

    meta = json.loads(REFERENCE_FIXTURE.with_suffix(".json").read_text())
    with safe_open(str(REFERENCE_FIXTURE), "pt") as f:
        params = [k for k in f.keys() if k.startswith("param/")]  # noqa: SIM118
    for case in meta["steps"]:
        assert f"step/{case}/z_next" in report and f"step/{case}/x_pred" in report
    for key in ("fwd/case1_out", "fwd/case2_logits", "fwd/case3_logits", "fwd/case4_out"):
        assert key in report
    for case in ("train_uncond", "train_cond"):
        for name in ("loss", "l2_loss", "ce_loss"):
            assert f"{case}/{name}" in report
        grads = [k for k in report if k.startswith(f"{case}/grad/")]
        assert len(grads) == len(params)  # every official parameter
    assert report["decode/tokens"] == 0


def test_tokens_exact(report):
    assert report["decode/tokens"] == 0.0


def test_cli_check_fixture(capsys):
    from elflow.__main__ import main

    assert main(["check-fixture", str(REFERENCE_FIXTURE)]) == 0
    named = capsys.readouterr().out
    assert "0 over 1e-4" in named
    assert main(["check-fixture"]) == 0  # no argument: the bundled fixture, the same report
    assert capsys.readouterr().out == named


def test_the_bundled_fixture_is_the_authors_file():
    """The copy shipped with elflow equals its source, where that source is present (CI)."""
    if not SHARED_FIXTURES.is_dir():
        pytest.skip(f"{SHARED_FIXTURES} is absent: nothing to compare the bundled copy with")
    for suffix in (".safetensors", ".json"):
        ours = REFERENCE_FIXTURE.with_suffix(suffix)
        theirs = SHARED_FIXTURES / ours.name
        assert hashlib.sha256(ours.read_bytes()).digest() == (
            hashlib.sha256(theirs.read_bytes()).digest()
        ), ours.name
