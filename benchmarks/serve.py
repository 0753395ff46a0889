"""Load on ``elflow serve``: C concurrent clients for a bounded time, against a server started
here on a loopback port (its own process), compared with one client sampling in turn.

    python benchmarks/serve.py                      # the demo model, 1 4 16 64 clients, 30 s each
    python benchmarks/serve.py --clients 1 16 --seconds 10 --max-queue 32

Each client sends ``POST /v1/completions`` (one free sample, its own seed) again and again until
the time is up; requests still running then are waited for. Printed per client count: samples/s,
p50 and p95 latency of answered requests, 429s (the queue was full: the server's answer above
``--max-queue``), failed (any other status or a broken connection) and lost (no answer within
the timeout), the speed-up over one client and, for comparison, the samples/s of the model's
own pipeline in batches of that size in this process, with no server.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    import httpx

    cmd = [
        sys.executable,
        "-m",
        "elflow",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--max-queue",
        str(args.max_queue),
        "--max-batch",
        str(args.max_batch),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    end = time.monotonic() + 300
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start within 300 s")


def load(base: str, clients: int, seconds: float, body: dict, timeout: float) -> dict:
    """``clients`` threads sending requests until ``seconds`` have passed."""
    import httpx

    lock = threading.Lock()
    latencies: list[float] = []
    counts = {"ok": 0, "busy": 0, "failed": 0, "lost": 0}
    start = time.monotonic()
    deadline = start + seconds
    last = [start]

    def client(c: int) -> None:
        with httpx.Client(timeout=timeout) as http:
            k = 0
            while time.monotonic() < deadline:
                sent = time.monotonic()
                try:
                    r = http.post(f"{base}/v1/completions", json={**body, "seed": c * 100_000 + k})
                    kind = {200: "ok", 429: "busy"}.get(r.status_code, "failed")
                except httpx.TimeoutException:
                    kind = "lost"
                except httpx.TransportError:
                    kind = "failed"
                done = time.monotonic()
                with lock:
                    counts[kind] += 1
                    if kind == "ok":
                        latencies.append(done - sent)
                        last[0] = max(last[0], done)
                if kind == "busy":  # the server said when to come back; a short pause here
                    time.sleep(0.5)
                k += 1

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    elapsed = last[0] - start
    q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
    return {
        "clients": clients,
        "samples": counts["ok"] * body.get("n", 1),
        "samples_per_s": counts["ok"] * body.get("n", 1) / max(elapsed, 1e-9),
        "p50_s": statistics.median(latencies) if latencies else float("nan"),
        "p95_s": q[18] if q else float("nan"),
        **{k: counts[k] for k in ("busy", "failed", "lost")},
    }


def local_pipeline(args: argparse.Namespace):
    """The served model's pipeline in this process, and the sampler the clients ask for."""
    from elflow.cli.common import load_pipeline

    pipe = load_pipeline(args.model, "cpu")
    return pipe, pipe.sampler if not args.steps else replace(pipe.sampler, steps=args.steps)


def direct_rates(pipe, sampler, max_batch: int, clients: list[int]) -> dict[int, float]:
    """samples/s of the model's own pipeline in batches of min(c, max batch), no server."""
    pipe.generate(1, sampler=sampler)
    out = {}
    for c in clients:
        batch = min(c, max_batch)
        n = max(batch, 8)
        start = time.perf_counter()
        pipe.generate(n, sampler=sampler, seed=1, batch_size=batch)
        out[c] = n / (time.perf_counter() - start)
    return out


def compute_ceiling(pipe, sampler) -> dict[str, float]:
    """What batching can reach at most on this processor: one sample's FLOPs (counted, attention
    included), and the fp32 matrix-product peak (a 2048 x 2048 product timed for two seconds)."""
    from elflow.runtime.profiling import OpCounter

    n = 8
    with OpCounter() as counter:  # torch's formulas, with the CPU attention kernels'
        pipe.generate(n, sampler=sampler, seed=1, batch_size=n)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    k, start = 0, time.perf_counter()
    while time.perf_counter() - start < 2.0:
        a @ b
        k += 1
    peak = 2 * 2048**3 * k / (time.perf_counter() - start)
    return {"flops_per_sample": sum(counter.counts.flops.values()) / n, "peak_flops": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-queue", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the model's)")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="a request unanswered this long is lost"
    )
    p.add_argument("--no-direct", action="store_true", help="skip the in-process comparison")
    p.add_argument(
        "--no-ceiling", action="store_true", help="skip counting the compute ceiling of batching"
    )
    args = p.parse_args(argv)
    port = free_port()
    proc = start_server(args, port)
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": "", "n": 1} | ({"steps": args.steps} if args.steps else {})
    try:
        load(base, 1, 0.0, body, args.timeout)  # one request: first-call costs out of the way
        rows = [load(base, c, args.seconds, body, args.timeout) for c in args.clients]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    one = next((r["samples_per_s"] for r in rows if r["clients"] == 1), None)
    local = None if args.no_direct and (args.no_ceiling or not one) else local_pipeline(args)
    clients = sorted(set(args.clients))
    direct = {} if args.no_direct else direct_rates(*local, args.max_batch, clients)
    print(
        f"model {args.model}, {args.seconds:g} s per row, max queue {args.max_queue}, "
        f"max batch {args.max_batch}"
    )
    print("clients  samples  samples/s  vs 1 client  p50 s  p95 s  429s  failed  lost  in-process")
    for r in rows:
        speedup = f"{r['samples_per_s'] / one:.2f}x" if one else "-"
        ref = f"{direct[r['clients']]:.3f}" if r["clients"] in direct else "-"
        print(
            f"{r['clients']:>7}  {r['samples']:>7}  {r['samples_per_s']:>9.3f}  {speedup:>11}  "
            f"{r['p50_s']:>5.2f}  {r['p95_s']:>5.2f}  {r['busy']:>4}  {r['failed']:>6}  "
            f"{r['lost']:>4}  {ref:>10}"
        )
    if direct:
        print(
            "in-process: samples/s of the model's pipeline in batches of min(clients, "
            "--max-batch), no server (the ceiling batching can reach on this hardware)"
        )
    if not args.no_ceiling and one:
        c = compute_ceiling(*local)
        used = one * c["flops_per_sample"]
        print(
            f"compute: {c['flops_per_sample'] / 1e9:.1f} GFLOP a sample (matrix products and "
            f"attention, counted); one client ran at {used / 1e9:.1f} GFLOP/s, this "
            f"processor's fp32 matrix-product peak is {c['peak_flops'] / 1e9:.1f} GFLOP/s "
            f"(2048 x 2048), so batching can give at most {c['peak_flops'] / used:.2f}x one "
            "client here"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
