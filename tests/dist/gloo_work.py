"""The gloo checks of tests/dist in one launch: muon_work's and fsdp_muon's work, in turn, on the
same 2 forked processes (:mod:`tests.dist.fork_ranks`).

Run as ``python -m tests.dist.gloo_work OUT.pt`` from the repository root; rank 0 writes
``{"muon_work": ..., "fsdp_muon": ...}``, each what that module's own launch writes.
"""

from __future__ import annotations

import sys

from tests.dist import fsdp_muon, muon_work
from tests.dist.fork_ranks import fork_gloo

WORLD_SIZE = 2
assert WORLD_SIZE == muon_work.WORLD_SIZE == fsdp_muon.WORLD_SIZE


def _work(rank: int) -> dict:
    return {"muon_work": muon_work._work(rank), "fsdp_muon": fsdp_muon._work(rank)}


def main(out: str) -> None:
    fork_gloo(_work, WORLD_SIZE, out)


if __name__ == "__main__":
    main(sys.argv[1])
