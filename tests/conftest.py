import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from elflow.testing.reference import BUNDLED_FIXTURE as REFERENCE_FIXTURE  # noqa: F401

SHARED_FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
"""The fixtures' source beside the repository (CI only): the bundled copy must equal it."""


@pytest.fixture(autouse=True, scope="session")
def _elflow_cache(tmp_path_factory):
    """Every test's user cache (judges, latent caches) is a temporary folder, never ~/.cache."""
    saved = os.environ.get("ELFLOW_CACHE")
    os.environ["ELFLOW_CACHE"] = str(tmp_path_factory.mktemp("elflow-cache"))
    yield
    if saved is None:
        os.environ.pop("ELFLOW_CACHE", None)
    else:
        os.environ["ELFLOW_CACHE"] = saved


@pytest.fixture(autouse=True, scope="session")
def _one_thread_for_fixtures():
    """One intra-op thread from the session's start, so module- and session-scoped fixtures (which
    pytest builds before any function fixture) compute with the thread count of the tests that
    compare against them. NOTE: a CPU matrix product with a long inner dimension splits its sums
    over the threads, so its last bits depend on the thread count (with MKL on AVX-512: a run
    trained with 2 threads and resumed with 1 ended 1.8e-5 away from the straight run)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    # Test tensors are tiny: intra-op threads gain nothing, and two OpenMP threads on a loaded
    # 2-core machine can spin-wait a 2 s test into minutes.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def checkpoint_calls(monkeypatch) -> list:
    """One entry per block the network recomputes (``train.activation_checkpointing``)."""
    import elflow.model

    calls: list = []
    real = elflow.model.checkpoint

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(elflow.model, "checkpoint", counted)
    return calls


FULL_TIER_ONLY = ("slow", "dist", "e2e", "docs", "browser")
"""Markers of the tests a bare ``pytest`` (the fast tier) deselects; any ``-m`` (``-m ""``: every
test) or a test named by its node id (``path::name``) brings them back."""


def _fast_tier(config) -> bool:
    """No ``-m`` given and no test named by node id: the default, fast selection."""
    args = config.invocation_params.args
    if config.option.markexpr or any(a.startswith("-m") for a in args):
        return False
    return not any("::" in a for a in config.args)


def _longest_first(item) -> int:
    """0: marked ``slow`` (compiles, whole demos, subprocess races), 1: ``e2e`` or ``docs``
    (whole commands), 2: the rest."""
    if item.get_closest_marker("slow"):
        return 0
    return 1 if item.get_closest_marker("e2e") or item.get_closest_marker("docs") else 2


def pytest_configure(config):
    """Refuse ``--dist loadgroup`` where it is known not to group: pytest 9.2 with pytest-xdist
    up to 3.8 drops the ``xdist_group`` marks silently (pytest-dev/pytest-xdist#1386), and each
    worker would then build the grouped session fixtures (compiled steps, the gloo launch)."""
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "loadgroup":
        return
    from importlib.metadata import version

    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2] if x.isdigit())

    if parts(pytest.__version__) >= (9, 2) and parts(version("pytest-xdist")) <= (3, 8):
        raise pytest.UsageError(
            f"--dist loadgroup does not group tests with pytest {pytest.__version__} and "
            f"pytest-xdist {version('pytest-xdist')} (pytest-dev/pytest-xdist#1386): install "
            "the dev extra's pytest (pip install 'pytest<9.2')"
        )


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):
        # A pytest-xdist worker (the full tier's ``-n 2 --dist loadgroup``): the scheduler deals
        # the tests out one by one in this order, so the longest go first and the many short
        # ones fill in behind them (both workers end together; a 60 s test dealt last would run
        # alone at the end). A stable sort: every worker collects the same order.
        items.sort(key=_longest_first)
    if _fast_tier(config):
        full = [any(i.get_closest_marker(m) for m in FULL_TIER_ONLY) for i in items]
        if any(full):
            config.hook.pytest_deselected(items=[i for i, f in zip(items, full, strict=True) if f])
            items[:] = [i for i, f in zip(items, full, strict=True) if not f]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random BERT encoder (MiniLM vocabulary) and a 40-line JSONL corpus, per module."""
    from tests.train_helpers import build_assets

    return build_assets(tmp_path_factory.mktemp("assets"))


# --- tiny parts built once per session: read them, never change them ---------------------------


@pytest.fixture(scope="session")
def judge():
    """A tiny random GPT-2 judge over a word-level vocabulary (``tests.builders.tiny_judge``)."""
    from tests.builders import tiny_judge

    return tiny_judge()


@pytest.fixture(scope="session")
def tiny_encoder():
    """A tiny random BERT with MiniLM's vocabulary size (30522), wrapped as a FrozenEncoder."""
    from elflow.text.encoder import FrozenEncoder
    from tests.builders import tiny_bert

    torch.manual_seed(0)
    model = tiny_bert(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    model.set_attn_implementation("sdpa")
    return FrozenEncoder(model, latent_std=1.0)


@pytest.fixture(scope="session")
def uncond_model(tmp_path_factory) -> Path:
    """A tiny unconditional model folder (``tests.builders.make_uncond``): 4-step SDE, L 12."""
    from tests.builders import make_uncond

    return make_uncond(tmp_path_factory.mktemp("uncond") / "model")


@pytest.fixture(scope="session")
def infill_model(tmp_path_factory) -> str:
    """A tiny unconditional model with its own width-8 encoder, EOS-padded rows (infilling,
    projection, length control; ``tests.builders.make_infill_model``)."""
    from tests.builders import make_infill_model

    return make_infill_model(tmp_path_factory.mktemp("infill"))


@pytest.fixture(scope="session")
def cond_model(tmp_path_factory) -> Path:
    """A tiny conditional model and its encoder (``tests.builders.make_cond``): 3-step ODE."""
    from tests.builders import make_cond

    return make_cond(tmp_path_factory.mktemp("cond"))


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    """Once-per-process notes count from each test's start, whatever ran before it."""
    from elflow import errors

    monkeypatch.setattr(errors, "_NOTED", set())


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, assets):
    """A 3-step tiny training run's last checkpoint, per module (the distillation tests')."""
    import json

    from elflow.__main__ import main
    from tests.train_helpers import run_config

    root = tmp_path_factory.mktemp("teacher")
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps(run_config(assets, train={"max_steps": 3})))
    argv = ["train", "--preset", "bible-tiny", "--out", str(root / "run"), "--config", str(cfg)]
    assert main(argv) == 0
    return root / "run" / "checkpoint-3"
