"""Stopping a training run cleanly on SIGINT/SIGTERM: finish the step, save, then stop.

Every rank must save the same step, so with N processes the ranks agree each step whether any of
them was signalled (one all-reduce of a CPU flag on a gloo group: the host never waits for the
GPU to agree); the run then raises :class:`elflow.errors.Interrupted` with the
shell's exit code (128 + the signal number) and a resume continues bitwise from the saved step.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from elflow.distributed import DistInfo, control_group


class StopSignal:
    """SIGINT/SIGTERM during training: finish the step, save a checkpoint, then stop.

    A second SIGINT (Ctrl-C twice) stops at once (KeyboardInterrupt; the last checkpoint stays
    intact); a repeated SIGTERM is ignored, since launchers (Slurm, torchrun) often deliver it
    twice. A signal the process ignores (SIGINT under ``nohup ... &``) stays ignored. With N
    processes the ranks agree each step (one all-reduce), so all of them save the same step.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.number = 0
        self._previous: dict[int, Any] = {}
        self.flag = torch.zeros(1, dtype=torch.int32)
        """The CPU tensor the ranks all-reduce to agree (a host tensor on a GPU run too)."""

    @property
    def name(self) -> str:
        return signal.Signals(self.number).name if self.number > 0 else "a signal on another rank"

    @property
    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention (SIGTERM's when another rank got it)."""
        return 128 + (self.number if self.number > 0 else int(signal.SIGTERM))

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._SIGNALS:
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.number:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.number = signum
        # os.write, not print: a handler that prints while the main thread prints would fail.
        name = signal.Signals(signum).name
        again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
        os.write(2, f"\nelflow train: {name}: saving after this step{again}\n".encode())

    def agreed(self, info: DistInfo) -> bool:
        """Whether any process was signalled (every rank gets the same answer)."""
        if info.world_size == 1:
            return self.number != 0
        self.flag.fill_(int(self.number != 0))
        dist.all_reduce(self.flag, group=control_group())
        stop = bool(self.flag.item())
        if stop and not self.number:
            self.number = -1
        return stop
