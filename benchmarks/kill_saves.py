"""Kill a training run at random moments while it saves, then check that nothing saved is lost.

Usage:
    python benchmarks/kill_saves.py                    # 20 kills, one process
    python benchmarks/kill_saves.py --trials 5 --nproc 2

A tiny run (the T5-shaped random encoder and Bible verses of ``step_profile.py``) checkpoints
every 2 steps. Each trial starts ``elflow train`` (resuming the same run folder), waits until a
save has begun (its ``.tmp-checkpoint-*`` folder appears; 0 to 2 saves are let through first),
waits a random 0-50 ms more and kills the process (SIGKILL: no handler runs). After each kill
every ``checkpoint-*`` folder must be complete and load as a model, and the latest must be at
least the one before the kill. At the end the run is finished without kills and its final
weights are compared with an uninterrupted run's (bitwise on one process: the resume is exact).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_profile import build_assets  # benchmarks/step_profile.py

STEPS = 100


def config(assets: dict, tmp: Path) -> Path:
    cfg = {
        "model": {"depth": 2, "hidden_size": 32, "num_heads": 2, "bottleneck_dim": 8},
        "data": {"path": f"{assets['data']}/train.jsonl", "valid_path": "", "format": "jsonl"},
        "encoder": {"name": assets["encoder"], "tokenizer": assets["tokenizer"], "latent_std": 0.5},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "muon_ns_dtype": "float32"},
        "train": {
            "global_batch": 8,
            "max_steps": STEPS,
            "save_every": 2,
            "keep_last": 2,
            "log_every": 1,
            "precision": "fp32",
            "tensorboard": False,
            "sample_every": 0,
            "eval_every": 0,
        },
    }
    path = tmp / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


def command(cfg: Path, out: Path, nproc: int) -> list[str]:
    argv = ["train", "--preset", "bible-tiny", "--out", str(out), "--config", str(cfg)]
    argv += ["--set", "model.max_length=32", "--set", "data.max_rows=400"]
    if nproc == 1:
        return [sys.executable, "-m", "elflow", *argv]
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    return [*run, "--master_port", str(random.randint(20000, 40000)), "-m", "elflow", *argv]


def checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


def intact(out: Path) -> bool:
    """Every checkpoint folder complete and loadable as a model."""
    from elflow.io.artifact import load_model

    for step in checkpoints(out):
        folder = out / f"checkpoint-{step}"
        needed = ("state.json", "config.json", "model.safetensors", "train-state/.metadata")
        if not all((folder / f).is_file() for f in needed):
            return False
        load_model(folder)
    return True


def trial(cmd: list[str], out: Path, rng: random.Random, env: dict) -> dict:
    """Start the run, kill it during a save; what the folder holds before and after."""
    before = checkpoints(out)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    during, skip, saving = False, rng.randint(0, 2), False  # let 0-2 saves finish first
    while proc.poll() is None and time.monotonic() < deadline:
        now_saving = bool(list(out.glob(".tmp-checkpoint-*")))
        if now_saving and not saving and skip == 0:
            time.sleep(rng.uniform(0, 0.05))
            during = bool(list(out.glob(".tmp-checkpoint-*")))
            os.killpg(proc.pid, signal.SIGKILL)
            break
        if saving and not now_saving:
            skip -= 1
        saving = now_saving
        time.sleep(0.001)
    proc.wait()
    after = checkpoints(out)
    return {
        "killed_during_save": during,
        "finished": not after or (after[-1] == STEPS and proc.returncode == 0),
        "intact": intact(out),
        "kept": not before or (bool(after) and after[-1] >= before[-1]),
        "latest": after[-1] if after else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun above 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every trial's figures here")
    args = p.parse_args(argv)
    if args.trials < 1 or args.nproc < 1:
        p.error("--trials and --nproc must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="elflow-kills-"))
    assets = build_assets(tmp, 32, 1, data="text")
    cfg = config(assets, tmp)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp / "killed"
    rows = []
    print(f"{'trial':>5} {'during a save':>13} {'intact':>6} {'kept':>4} {'latest':>6}")
    for k in range(args.trials):
        if checkpoints(out) and checkpoints(out)[-1] >= STEPS - 2:
            break  # too close to the end for another save to kill
        r = trial(command(cfg, out, args.nproc), out, rng, env)
        rows.append(r)
        print(
            f"{k + 1:>5} {r['killed_during_save']!s:>13} {r['intact']!s:>6} "
            f"{r['kept']!s:>4} {r['latest']!s:>6}",
            flush=True,
        )
    # Finish without kills, and against a run never killed.
    straight = tmp / "straight"
    for folder in (out, straight):
        done = subprocess.run(command(cfg, folder, args.nproc), env=env, capture_output=True)
        if done.returncode != 0:
            print(done.stderr.decode()[-2000:])
            return 1
    from safetensors.torch import load_file

    a = load_file(str(out / f"checkpoint-{STEPS}" / "model.safetensors"))
    b = load_file(str(straight / f"checkpoint-{STEPS}" / "model.safetensors"))
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    during = sum(r["killed_during_save"] for r in rows)
    ok = all(r["intact"] and r["kept"] for r in rows)
    print(
        f"{len(rows)} kills, {during} during a save: every checkpoint intact and kept: {ok}; "
        f"resumed to the end, max |weight difference| to an uninterrupted run: {diff:.3g}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"trials": rows, "max_weight_diff": diff}))
    return 0 if ok and (args.nproc > 1 or diff == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
