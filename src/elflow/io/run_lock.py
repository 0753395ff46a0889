"""One training run per run folder at a time: a lock that names its holder.

Two runs writing one folder would interleave their checkpoints and metrics (and prune each
other's). Process 0 of a run takes ``OUT/.elflow-lock`` (an OS file lock, released when the
process ends, however it ends) and writes who holds it beside it; a second run on the folder is
refused at start in one line naming the holder.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from filelock import FileLock, Timeout

from elflow.errors import ELFError

LOCK = ".elflow-lock"
HOLDER = ".elflow-lock.json"


class RunLock:
    """The lock of run folder ``out`` (acquire once; release when the run ends)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self._lock = FileLock(str(self.out / LOCK))
        self.created = False

    def acquire(self) -> None:
        self.created = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise ELFError(
                f"out={self.out} is in use by another run ({self.holder()}); wait for it to end "
                "or give another out="
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        (self.out / HOLDER).write_text(json.dumps(info) + "\n")

    def holder(self) -> str:
        """Who holds the lock, as its holder file says."""
        try:
            h = json.loads((self.out / HOLDER).read_text())
            return f"process {h['pid']} on {h['host']} since {h['since']}: {h['command']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "a process that left no name"

    def release(self, failed_start: bool = False) -> None:
        """Release the lock; after a ``failed_start``, a run folder this lock made goes too if
        nothing else is in it (a refused config leaves no trace)."""
        if self._lock.is_locked:
            (self.out / HOLDER).unlink(missing_ok=True)
            self._lock.release()
            if failed_start and self.created and [p.name for p in self.out.iterdir()] == [LOCK]:
                (self.out / LOCK).unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # something arrived meanwhile: keep it
                    self.out.rmdir()
