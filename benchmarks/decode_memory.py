"""Peak memory of one decode to tokens, with the decoder head's row chunks and without them.

Usage:
    python benchmarks/decode_memory.py                          # ELF-B, batch 256, L 128, V 32,100
    python benchmarks/decode_memory.py --preset elf-small --batch 64

Each setting runs in a fresh process: the network (fp32, random weights) is built, the peak resident
set is reset (``/proc/self/clear_refs``), one ``elflow.sampling.denoiser.decode_tokens`` call runs,
and the peak resident set during it, less the resident set before it, is printed with the time.
``unchunked`` decodes the whole batch at once, as elflow did before the chunks
(``DECODE_CHUNK_BYTES`` set beyond any batch).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def child(args) -> dict:
    import torch

    from elflow.config import model_preset
    from elflow.model import build_model
    from elflow.sampling import denoiser as wiring

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = model_preset(args.preset, encoder_dim=512, vocab_size=args.vocab, max_length=args.length)
    model = build_model(cfg).eval()
    z = torch.randn(args.batch, args.length, cfg.encoder_dim)
    if args.mode == "unchunked":
        wiring.DECODE_CHUNK_BYTES = 1 << 62
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again here
    before = _status("VmRSS")
    t0 = time.perf_counter()
    tokens = wiring.decode_tokens(model, z, 3.0)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    assert tokens.shape == (args.batch, args.length)
    rows = wiring.decode_rows(args.length, args.vocab) if args.mode == "chunked" else args.batch
    return {"mode": args.mode, "peak_gb": (peak - before) / 1e9, "seconds": seconds, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="elf-b", help="model preset (elf-b, elf-small, ...)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32100, help="V (T5-small's tokenizer: 32,100)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", choices=("chunked", "unchunked"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(child(args)))
        return
    print(f"{args.preset}, batch {args.batch}, L {args.length}, V {args.vocab}: one decode")
    print(f"{'mode':<10} {'rows a chunk':>12} {'peak GB':>8} {'seconds':>8}")
    results = {}
    for mode in ("unchunked", "chunked"):
        cmd = [sys.executable, __file__, "--mode", mode, *(argv or sys.argv[1:])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        r = results[mode] = json.loads(out.strip().splitlines()[-1])
        print(f"{mode:<10} {r['rows']:>12} {r['peak_gb']:>8.2f} {r['seconds']:>8.1f}")
    ratio = results["chunked"]["peak_gb"] / max(results["unchunked"]["peak_gb"], 1e-9)
    print(f"chunked / unchunked peak: {ratio:.2f}")


if __name__ == "__main__":
    main()
