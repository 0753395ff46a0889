"""elflow serve reads a prompt's gaps with the template parser of ``--infill``: a malformed gap
marker beside a valid one is a 422 naming it, not text kept in the completion."""

from __future__ import annotations

import pytest

from elflow import ELFPipeline
from elflow.serving.api_schema import Limits, RequestError, check_completion, parse_body


@pytest.fixture(scope="module")
def pipe(uncond_model):
    return ELFPipeline.from_pretrained(uncond_model)


@pytest.mark.parametrize(
    ("prompt", "marker"),
    [("a [___2] b [___", "[___"), ("a [__3] b [___2]", "[__3]"), ("only [__4] here", "[__4]")],
)
def test_a_malformed_gap_in_a_prompt_is_a_422_naming_it(pipe, prompt, marker):
    with pytest.raises(RequestError) as e:
        check_completion(pipe, parse_body({"prompt": prompt}), Limits(), "tiny")
    assert (e.value.status, e.value.param) == (422, "prompt")
    assert e.value.message.startswith(f"malformed gap {marker!r} in ")
    assert "\n" not in e.value.message


def test_a_prompt_with_valid_gaps_is_accepted(pipe):
    completion = check_completion(pipe, parse_body({"prompt": "a [___2] b [___1]"}), Limits(), "t")
    assert completion is not None
