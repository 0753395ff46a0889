"""What the training tests share: tiny training assets, a run config over them, the command
line in-process, and comparisons of checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from elflow.__main__ import main
from tests.dist.launch import run_elflow

WORDS = (
    "in the beginning god created the heavens and the earth now the earth was formless and "
    "empty darkness was on the surface of the deep and the spirit of god was hovering over the "
    "waters god said let there be light and there was light"
).split()


def build_assets(root: Path) -> Path:
    """A tiny random BERT encoder (MiniLM vocabulary) and a 40-line JSONL corpus in ``root``
    (the ``assets`` fixture of tests/conftest.py)."""
    from tests.builders import tiny_bert

    torch.manual_seed(0)
    tiny_bert(max_position_embeddings=64).save_pretrained(root / "encoder")
    g = torch.Generator().manual_seed(0)
    with (root / "train.jsonl").open("w") as f:
        for _ in range(40):
            n = int(torch.randint(3, 10, (1,), generator=g))
            idx = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(WORDS[i] for i in idx)}) + "\n")
    return root


def run_config(assets: Path, **sections) -> dict:
    """A JSON config for `elflow train --preset bible-tiny --config FILE` on the tiny assets."""
    cfg = {
        "model": {
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 2,
            "bottleneck_dim": 8,
            "max_length": 12,
        },
        "data": {
            "path": str(assets / "train.jsonl"),
            "valid_path": "",
            "format": "jsonl",
            "latent_cache": False,
        },
        "encoder": {"name": str(assets / "encoder"), "tokenizer": "minilm", "latent_std": 0.5},
        "optim": {
            "lr": 3e-3,
            "warmup_steps": 2,
            "muon_ns_dtype": "float32",
            "schedule": "constant",
        },
        "train": {
            "global_batch": 8,
            "max_steps": 6,
            "save_every": 3,
            "log_every": 1,
            "keep_last": 5,
            "precision": "fp32",
            "tensorboard": False,
            "ema_decay": 0.9,
            "ema_warmup": False,
            "sample_every": 0,
            "eval_every": 0,
        },
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def train_argv(tmp: Path, out: Path, cfg: dict, *extra: str) -> list[str]:
    """``elflow train``'s arguments for ``cfg`` (written to ``tmp/cfg-<out's name>.json``) over
    the ``bible-tiny`` preset, into ``out``."""
    path = tmp / f"cfg-{out.name}.json"
    path.write_text(json.dumps(cfg))
    return ["train", "--preset", "bible-tiny", "--out", str(out), "--config", str(path), *extra]


def train_cli(tmp: Path, out: Path, cfg: dict, *extra: str) -> int:
    return main(train_argv(tmp, out, cfg, *extra))


def error_lines(err: str) -> list[str]:
    """The CLI's error lines (stderr also carries the progress bar and library logs)."""
    return [line for line in err.replace("\r", "\n").splitlines() if "elflow: error:" in line]


def heldout_lines(run: Path) -> list[dict]:
    """The held-out loss lines of a run's metrics.jsonl."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "train_rows_loss" in x]


def weights(ckpt: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / name))


def assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, worst


def assert_same_checkpoint(a: Path, b: Path, atol: float = 0.0) -> None:
    """Training and EMA weights of two checkpoint folders agree within ``atol``."""
    for name in ("model.safetensors", "ema.safetensors"):
        assert_same(weights(a, name), weights(b, name), atol=atol)


def saved_weights(ckpt) -> dict:
    """The tensors of a checkpoint's weights file that ``load_model`` reads by default."""
    from safetensors.torch import load_file

    names = [n for n in ("ema.safetensors", "model.safetensors") if (ckpt / n).is_file()]
    return load_file(ckpt / names[0])


def train_processes(
    tmp: Path, out: Path, cfg: dict, nproc: int = 2, *extra: str, torchrun: bool = False
) -> str:
    """``elflow train`` on ``cfg`` with ``nproc`` gloo processes (forked, or under torchrun:
    :func:`tests.dist.launch.run_elflow`); its stdout."""
    return run_elflow(train_argv(tmp, out, cfg, *extra), nproc, torchrun=torchrun).stdout


def distill_cli(
    tmp: Path,
    out: Path,
    assets: Path,
    teacher: Path,
    rounds: str,
    *extra: str,
    optim: dict | None = None,
    **train,
) -> int:
    """``elflow distill`` of ``teacher`` with the tiny assets' config (``train`` and ``optim``
    keys over it), in-process."""
    # ema 0.1: a 2-step round's EMA must not be mostly its starting weights (0.9 ** 2 is refused).
    cfg = run_config(assets, train={"max_steps": 2, "ema_decay": 0.1, **train}, optim=optim or {})
    path = tmp / f"distill-{out.name}.json"
    path.write_text(json.dumps(cfg))
    return main(
        [
            "distill",
            "--teacher",
            str(teacher),
            "--out",
            str(out),
            "--config",
            str(path),
            "--rounds",
            rounds,
            "--teacher-steps",
            "4",
            *extra,
        ]
    )
