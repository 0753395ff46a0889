"""Benchmark a checkpoint's manifest: the cost of writing it and of checking it, per GB.

Every checkpoint carries ``manifest.json`` (each file's size and SHA-256); a resume and a load
check the files they read against it. This writes a folder of random files of the given total
size, then times :func:`elflow.io.manifest.write_manifest` (hash every file, write and fsync the
manifest) and :func:`elflow.io.manifest.damage` (hash them again and compare). The second read
comes from the page cache, as it does for a checkpoint written moments before; a cold read adds
the disk's own read time.

    python benchmarks/manifest.py --mb 512
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from elflow.io.manifest import damage, write_manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=512, help="total size of the files, in MiB")
    p.add_argument("--files", type=int, default=4)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for i in range(args.files):
            data = rng.integers(0, 256, size=(args.mb << 20) // args.files, dtype=np.uint8)
            (folder / f"part-{i}.bin").write_bytes(data.tobytes())
        t = time.perf_counter()
        write_manifest(folder)
        written = time.perf_counter() - t
        t = time.perf_counter()
        assert damage(folder) is None
        checked = time.perf_counter() - t
    gb = args.mb / 1024
    print(
        json.dumps(
            {
                "mib": args.mb,
                "files": args.files,
                "write_s": round(written, 3),
                "check_s": round(checked, 3),
                "write_s_per_gib": round(written / gb, 3),
                "check_s_per_gib": round(checked / gb, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
