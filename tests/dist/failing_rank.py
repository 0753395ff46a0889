"""``elflow train`` under torchrun with one process failing, for the failure-handling tests.

Run as ``python -m torch.distributed.run ... tests/dist/failing_rank.py RANK STEP MODE ARGV...``: at
optimizer step STEP, process RANK either dies (``die``: exits at once, as a crash would) or hangs
(``hang``: sleeps, as a process stuck in I/O would) while the others go on; with ``hang`` the other
processes send themselves SIGTERM two seconds later (as torchrun's agent or a scheduler would). A
process that saw a collective fail waits 0.5 s, not 5, for the others to say they are alive (the one
that failed never does). ``blind``: process RANK cannot see the run folder (as on a node without the
shared file system).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from elflow.__main__ import main as elflow
from elflow.runtime import distributed
from elflow.train import loop


def main() -> int:
    rank, step, mode, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    real = loop.Trainer.step

    def failing(trainer, k):
        if k == step and trainer.run.info.rank == rank:
            if mode == "die":
                os._exit(1)
            time.sleep(600)
        elif k == step and mode == "hang":
            threading.Timer(2.0, os.kill, args=(os.getpid(), signal.SIGTERM)).start()
        return real(trainer, k)

    loop.Trainer.step = failing
    distributed.ALIVE_WAIT_S = 0.5
    if mode == "blind" and int(os.environ["RANK"]) == rank:
        from elflow.train import setup

        setup.folder_sees = lambda marker: False
    return elflow(argv)


if __name__ == "__main__":
    sys.exit(main())
