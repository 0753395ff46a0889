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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elflow.runtime.distributed import DistInfo, control_group


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
        self._watch: tuple[float, Callable[[float], str] | None] | None = None
        self._timer: threading.Timer | None = None
        self._wakeup: tuple[int, int] | None = None
        self._seen = 0  # the first signal as the watcher thread saw it
        self.flag = torch.zeros(1, dtype=torch.int32)
        """The CPU tensor the ranks all-reduce to agree (a host tensor on a GPU run too)."""

    @property
    def _signum(self) -> int:
        return self.number if self.number > 0 else self._seen

    @property
    def name(self) -> str:
        return signal.Signals(self._signum).name if self._signum > 0 else "a signal on another rank"

    @property
    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention (SIGTERM's when another rank got it)."""
        return 128 + (self._signum if self._signum > 0 else int(signal.SIGTERM))

    def install(
        self,
        info: DistInfo | None = None,
        stop_timeout: float = 0.0,
        stuck_line: Callable[[float], str] | None = None,
    ) -> None:
        """Catch SIGINT/SIGTERM. With several processes (``info``) and ``stop_timeout`` > 0, a
        signal also starts a timer: a process whose step has not ended ``stop_timeout`` seconds
        later (blocked in a collective with a process that is gone) writes ``stuck_line`` and
        exits without saving.

        NOTE: Python runs signal handlers on the main thread between bytecodes, never while it
        waits inside a collective; the signal's wake-up byte (``signal.set_wakeup_fd``) reaches
        a watcher thread instead, which starts the timer.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._SIGNALS:
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                self._previous[sig] = signal.signal(sig, self._handle)
        distributed = info is not None and info.world_size > 1
        if distributed and stop_timeout > 0 and self._previous:
            self._watch = (stop_timeout, stuck_line)
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = (write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self._watcher, args=(read,), daemon=True).start()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._wakeup is not None:
            write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the watcher's read returns empty and it ends
            self._wakeup = None

    def _watcher(self, read: int) -> None:
        """Arm the give-up timer at the first signal's wake-up byte (runs on its own thread)."""
        try:
            while True:
                data = os.read(read, 16)
                if not data:
                    return
                caught = [b for b in data if b in (signal.SIGINT, signal.SIGTERM)]
                if caught and self._timer is None:
                    self._seen = caught[0]
                    wait, line = self._watch
                    self._timer = threading.Timer(wait, self._give_up, args=(wait, line))
                    self._timer.daemon = True
                    self._timer.start()
        finally:
            os.close(read)

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

    def _give_up(self, wait: float, line: Callable[[float], str] | None) -> None:
        """The step never ended: say so in one line and exit (the last checkpoint stands)."""
        text = line(wait) if line is not None else f"elflow: error: step not done in {wait} s"
        os.write(2, f"\n{text}\n".encode())
        os._exit(self.exit_code)

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
