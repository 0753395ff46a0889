"""Start-up times: ``elflow --help``, ``elflow sample --help``, and a second training run's set-up
with the shared latent cache (the first run builds the cache, the second reuses it).

    python benchmarks/startup.py
    python benchmarks/startup.py --train-preset bible-tiny

Help times are the wall time of a fresh ``python -m elflow ... --help`` process (best and median
of ``--repeat``). With ``--train-preset``, two one-step runs of that preset train in a scratch
folder with a fresh ``ELFLOW_CACHE`` (or ``--cache``): for each, the seconds from the command to
the start of its first step (when the trainer prints its summary line) and to the end of the run
(that step and its checkpoint). Extra ``--set`` keys go to both runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def time_command(argv: list[str], repeat: int, env: dict[str, str] | None = None) -> list[float]:
    """Wall seconds of ``repeat`` fresh processes running ``argv``."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
    return times


def train_once(preset: str, out: Path, cache: Path, sets: list[str]) -> tuple[float, float]:
    """(seconds from the command to the start of its first step, to its end) of a one-step run
    of ``preset``: the first step starts when the trainer prints its summary line."""
    argv = [sys.executable, "-m", "elflow", "train", "--preset", preset, "--out", str(out)]
    for key in ("train.max_steps=1", "train.sample_every=0", "train.eval_every=0", *sets):
        argv += ["--set", key]
    env = {**os.environ, "ELFLOW_CACHE": str(cache)}
    t0 = time.perf_counter()
    started = float("nan")
    with tempfile.TemporaryFile("w+") as err:  # the progress bar, and any error
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
            for line in proc.stdout:
                if line.startswith("elflow train:") and "set-up" in line:
                    started = time.perf_counter() - t0
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {err.read()[-2000:]}")
    return started, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5, help="processes per help command")
    p.add_argument("--train-preset", help="also time two one-step runs of this preset")
    p.add_argument("--cache", help="latent cache folder (default: a fresh temporary one)")
    p.add_argument("--set", action="append", default=[], help="extra config key for both runs")
    args = p.parse_args()
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    print(f"{'command':<32} {'best s':>7} {'median s':>9}")
    for command in (["--help"], ["sample", "--help"]):
        times = time_command([sys.executable, "-m", "elflow", *command], args.repeat)
        name = " ".join(["elflow", *command])
        print(f"{name:<32} {min(times):>7.3f} {statistics.median(times):>9.3f}")
    if not args.train_preset:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(args.cache) if args.cache else Path(tmp) / "cache"
        print(f"\n{args.train_preset}: one-step runs, latent cache in {cache}")
        print(f"{'run':<8} {'step 1 starts s':>16} {'step 1 ends s':>14}")
        for k in (1, 2):
            start, end = train_once(args.train_preset, Path(tmp) / f"run{k}", cache, args.set)
            print(f"{k:<8} {start:>16.1f} {end:>14.1f}")


if __name__ == "__main__":
    main()
