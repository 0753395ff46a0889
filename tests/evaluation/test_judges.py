"""Judge names that cannot load fail fast, in one line, without the Hub's retries."""

from __future__ import annotations

import logging
import time

import huggingface_hub
import pytest
from huggingface_hub import constants

from elflow.errors import ELFError
from elflow.evaluation import judge as judge_mod
from elflow.evaluation.judge import load_judge

CLOSED = "http://127.0.0.1:9"  # the discard port: connections are refused at once


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty local cache, and a Hub that cannot be reached (offline mode off)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    template = CLOSED + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    return tmp_path / "hub"


def test_unreachable_hub_fails_in_one_line_within_two_seconds(hub, caplog):
    # Before the fix: transformers' two file requests, each retried 5 times with backoff.
    caplog.set_level(logging.WARNING)
    start = time.perf_counter()
    with pytest.raises(ELFError, match="Hub cannot be reached") as e:
        load_judge("someone/uncached-judge")
    assert time.perf_counter() - start < 2.0
    assert "\n" not in str(e.value) and "smollm2-135m" in str(e.value)
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]


def test_offline_mode_fails_without_a_request(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(judge_mod, "_hub_problem", lambda name: pytest.fail("asked the Hub"))
    with pytest.raises(ELFError, match="HF_HUB_OFFLINE is set"):
        load_judge("someone/uncached-judge")


def test_an_unknown_alias_lists_the_known_names_without_a_request(hub, monkeypatch):
    monkeypatch.setattr(judge_mod, "_hub_problem", lambda name: pytest.fail("asked the Hub"))
    with pytest.raises(ELFError, match=r"did you mean smollm2-135m\? known names: smollm2-135m"):
        load_judge("smollm2")
    with pytest.raises(ELFError, match="did you mean gpt2-large") as e:
        load_judge("GPT2-larg")
    assert "gpt2-xl" in str(e.value) and "org/name" in str(e.value)
    with pytest.raises(ELFError, match=r"judge folder '\./no/such/folder' does not exist"):
        load_judge("./no/such/folder")


def test_a_cached_hub_judge_loads_without_asking_the_hub(hub, monkeypatch, judge):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "models--someone--judge"
    judge.model.save_pretrained(repo / "snapshots" / commit)
    judge.tokenizer.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    def no_request(*args, **kwargs):
        raise AssertionError("asked the Hub")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_request)
    start = time.perf_counter()
    loaded = load_judge("someone/judge")  # the Hub is unreachable: the cache serves it
    assert loaded.revision == commit and time.perf_counter() - start < 2.0
