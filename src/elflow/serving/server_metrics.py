"""The server's counters, in the Prometheus text format (``GET /metrics``)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Histogram:
    """Cumulative buckets, a sum and a count (one Prometheus histogram)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [
            f'{name}_bucket{{le="{b:g}"}} {c}'
            for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        return [*out, f"{name}_sum {self.total:.6f}", f"{name}_count {self.count}"]


class Metrics:
    """What ``/metrics`` reports; safe to update from the batching thread and the event loop."""

    def __init__(self, queue_depth: Callable[[], int]) -> None:
        self._lock = threading.Lock()
        self._queue_depth = queue_depth
        self.requests: Counter[str] = Counter()  # by HTTP status
        self.samples = 0
        self.cancelled = 0
        self.batches = Histogram(BATCH_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def request(self, status: int, seconds: float | None = None) -> None:
        with self._lock:
            self.requests[str(status)] += 1
            if seconds is not None:
                self.latency.observe(seconds)

    def batch(self, rows: int) -> None:
        with self._lock:
            self.batches.observe(rows)
            self.samples += rows

    def cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP elflow_requests_total Completion requests answered, by HTTP status.",
                "# TYPE elflow_requests_total counter",
                *(
                    f'elflow_requests_total{{status="{s}"}} {n}'
                    for s, n in sorted(self.requests.items())
                ),
                "# HELP elflow_queue_depth Requests waiting for a batch.",
                "# TYPE elflow_queue_depth gauge",
                f"elflow_queue_depth {self._queue_depth()}",
                "# HELP elflow_samples_total Samples generated.",
                "# TYPE elflow_samples_total counter",
                f"elflow_samples_total {self.samples}",
                "# HELP elflow_cancelled_total Requests cancelled (client gone or timed out).",
                "# TYPE elflow_cancelled_total counter",
                f"elflow_cancelled_total {self.cancelled}",
                "# HELP elflow_batch_size Samples per batch run.",
                "# TYPE elflow_batch_size histogram",
                *self.batches.lines("elflow_batch_size"),
                "# HELP elflow_request_latency_seconds Time from arrival to the last byte.",
                "# TYPE elflow_request_latency_seconds histogram",
                *self.latency.lines("elflow_request_latency_seconds"),
            ]
        return "\n".join(lines) + "\n"
