"""Continuous batching for ELF: every request runs the same fixed number of steps, so requests
that arrive within a short window and share a sampler run as one batch of rows
(:func:`elflow.generation.engine.run_rows`); a request's samples do not depend on the others.

One worker thread owns the model. Requests wait in a bounded queue (full: the caller answers
429); a request whose client has gone is dropped from the queue, and a running batch stops at
its next step once every request in it is gone. :meth:`Batcher.close` (the server stopping)
answers every waiting and running request at once, so open streams end and the server stops.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elflow.errors import ELFError
from elflow.serving.api_schema import Completion, RequestError
from elflow.serving.server_metrics import Metrics

if TYPE_CHECKING:
    from elflow.generation.pipeline import ELFPipeline


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests; ``retry_after`` seconds is a fair wait."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class _Stopped(Exception):
    """Every request of a running batch is gone."""


_SHUTTING_DOWN = RequestError(503, "the server is shutting down; retry on its next start")


def stop_when_gone(jobs: list[Job]) -> Callable[[Any], None]:
    """A step callback that stops a running batch once every one of its requests is gone."""

    def check(state: Any) -> None:
        if all(job.gone.is_set() for job in jobs):
            raise _Stopped

    return check


@dataclass(eq=False)
class Job:
    """One request in flight: its checked completion and where its events go."""

    completion: Completion
    push: Callable[[tuple], None]
    """Called (from the worker thread) with ``("step", k, steps, texts)``, ``("done", texts)``
    or ``("error", RequestError)``."""
    arrived: float = field(default_factory=time.monotonic)
    gone: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def on_loop(cls, completion: Completion, loop: asyncio.AbstractEventLoop) -> tuple[Job, Any]:
        """A job whose events land in an ``asyncio.Queue`` of ``loop`` (returned with it)."""
        events: asyncio.Queue = asyncio.Queue()
        return cls(completion, lambda e: loop.call_soon_threadsafe(events.put_nowait, e)), events


class Batcher:
    """The queue and the worker thread that samples it in batches."""

    def __init__(
        self,
        pipe: ELFPipeline,
        *,
        max_batch: int = 32,
        max_queue: int = 64,
        window_s: float = 0.005,
        bf16: bool = False,
        cuda_graphs: bool | None = None,
    ) -> None:
        if max_batch < 1 or max_queue < 1:
            raise ELFError("max_batch= and max_queue= must be >= 1")
        self.pipe = pipe
        self.cuda_graphs = cuda_graphs
        """Sampling replays CUDA graphs (None: on CUDA; :mod:`elflow.generation.cuda_graphs`)."""
        self.max_batch, self.max_queue, self.window_s, self.bf16 = (
            max_batch,
            max_queue,
            window_s,
            bf16,
        )
        self.metrics = Metrics(self.depth)
        self._queue: list[Job] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._closing = False
        self._current: list[Job] = []
        self._seconds_per_batch = 1.0

    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise :class:`QueueFull`."""
        with self._cond:
            if self._closing:
                job.push(("error", _SHUTTING_DOWN))
                return
            if len(self._queue) >= self.max_queue:
                waves = len(self._queue) / self.max_batch + 1
                raise QueueFull(max(1, round(waves * self._seconds_per_batch)))
            self._queue.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop ``job`` if it waits, or let its batch stop if it runs."""
        if job.gone.is_set():
            return
        job.gone.set()
        self.metrics.cancel()
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)

    def start(self) -> Batcher:
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._work, name="elflow-batcher", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """The server is stopping: every waiting and running request gets a 503 now (a stream
        ends), a running batch stops at its next step, and no new request is queued."""
        with self._cond:
            self._closing = True
            jobs = [*self._queue, *self._current]
            self._queue.clear()
            self._cond.notify_all()
        for job in jobs:
            if not job.gone.is_set():
                job.gone.set()
                job.push(("error", _SHUTTING_DOWN))

    def stop(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _next_batch(self) -> list[Job]:
        """Wait for a request, give others ``window_s`` to arrive, then take the oldest
        request's key's requests, oldest first, up to ``max_batch`` rows."""
        with self._cond:
            while self._running and not self._queue:
                self._cond.wait()
            if not self._running:
                return []
            deadline = time.monotonic() + self.window_s
            while self._running and (left := deadline - time.monotonic()) > 0:
                if sum(len(j.completion.rows) for j in self._queue) >= self.max_batch:
                    break
                self._cond.wait(left)
            if not self._queue:  # all cancelled while waiting
                return []
            key = self._queue[0].completion.key
            batch, rows = [], 0
            for job in list(self._queue):
                n = len(job.completion.rows)
                if job.completion.key == key and (not batch or rows + n <= self.max_batch):
                    batch.append(job)
                    rows += n
                    self._queue.remove(job)
            return batch

    def alive(self) -> bool:
        """Whether the worker runs (or has not been started yet)."""
        return self._thread is None or self._thread.is_alive()

    def _work(self) -> None:
        while self._running:
            batch = self._next_batch()
            try:
                self.run(batch)
            except Exception as e:  # the worker goes on; the batch learns why it failed
                for job in batch:
                    job.push(("error", RequestError(500, f"sampling failed: {e!r}")))

    def run(self, batch: list[Job]) -> None:
        """Sample ``batch`` (jobs of one key) as one batch of rows and hand each its events."""
        jobs = [j for j in batch if not j.gone.is_set()]
        if not jobs:
            return
        with self._cond:
            self._current = jobs
        try:
            self._run(jobs)
        finally:
            with self._cond:
                self._current = []

    def _run(self, jobs: list[Job]) -> None:
        from elflow.generation.engine import run_rows
        from elflow.runtime.hardware import bf16_autocast

        rows = [row for job in jobs for row in job.completion.rows]
        spans, at = [], 0
        for job in jobs:
            spans.append((job, at, at + len(job.completion.rows)))
            at += len(job.completion.rows)
        streaming = any(job.completion.stream for job in jobs)

        def on_step(k: int, texts: list[str]) -> None:
            for job, a, b in spans:
                if job.completion.stream and not job.gone.is_set():
                    job.push(("step", k, job.completion.sampler.steps, texts[a:b]))

        sampler = jobs[0].completion.sampler
        started = time.monotonic()
        try:
            projection = None
            if sampler.project_from < 1.0 and rows[0].infill is None:
                projection = self.pipe.projection()
            with bf16_autocast(self.bf16, self.pipe.device):
                out = run_rows(
                    self.pipe,
                    rows,
                    sampler,
                    projection=projection,
                    on_step=on_step if streaming else None,
                    callback_on_step_end=stop_when_gone(jobs),
                    cuda_graphs=self.cuda_graphs,
                )
        except _Stopped:
            return
        except ELFError as e:
            for job in jobs:
                job.push(("error", RequestError(422, str(e).splitlines()[0])))
            return
        except Exception as e:  # the server goes on; the requests learn why they failed
            for job in jobs:
                job.push(("error", RequestError(500, f"sampling failed: {type(e).__name__}: {e}")))
            return
        self._seconds_per_batch = time.monotonic() - started
        self.metrics.batch(len(rows))
        for job, a, b in spans:
            if not job.gone.is_set():
                job.push(("done", out.texts[a:b]))
