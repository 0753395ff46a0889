"""``elflow serve``: an OpenAI-compatible completions server with a live playground."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading

from elflow.cli.common import add_dtype_argument, sampling_bf16
from elflow.cli.sample_cmd import add_cuda_graphs_argument, cuda_graphs_from_args
from elflow.errors import ELFError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="demo",
        help="the model to serve: any model source "
        "(a model folder, run, checkpoint, Hub id) or 'demo' (the shipped model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--name", default=None, help="the model's id in the API (default: --model)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("ELFLOW_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $ELFLOW_API_KEY)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:K"
    )
    add_dtype_argument(p)
    add_cuda_graphs_argument(p)
    p.add_argument("--no-ema", action="store_true", help="serve the training weights")
    p.add_argument("--max-batch", type=int, default=32, help="samples per batch (default 32)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting before new ones get 429 (default 64)",
    )
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        help="how long a batch waits for more requests (default 5 ms)",
    )
    p.add_argument("--max-n", type=int, default=16, help="samples per request (default 16)")
    p.add_argument("--max-steps", type=int, default=256, help="steps per request (default 256)")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="bytes of a request body; a larger one gets 413 unread (default 4194304, 4 MiB)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds a request may take before it is cancelled (default 300)",
    )


def build(args: argparse.Namespace):
    """The application ``elflow serve`` runs (built without binding a port)."""
    from elflow.cli.common import load_pipeline
    from elflow.runtime.distributed import resolve_device
    from elflow.serving.api_schema import Limits
    from elflow.serving.app import create_app
    from elflow.serving.batcher import Batcher

    for flag in ("max_batch", "max_queue", "max_n", "max_steps", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise ELFError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.request_timeout <= 0 or args.batch_window_ms < 0:
        raise ELFError("--request-timeout must be > 0 and --batch-window-ms >= 0")
    if args.max_n > args.max_batch:
        raise ELFError(
            f"--max-n {args.max_n} is over --max-batch {args.max_batch}; a request's "
            "samples run in one batch"
        )
    info = resolve_device(args.device)
    pipe = load_pipeline(args.model, info.device, use_ema=not args.no_ema)
    if pipe.sampler.steps > args.max_steps:
        raise ELFError(
            f"the model's sampler runs {pipe.sampler.steps} steps, over --max-steps "
            f"{args.max_steps}: a request that names no steps would run them; raise --max-steps"
        )
    batcher = Batcher(
        pipe,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        window_s=args.batch_window_ms / 1000,
        bf16=sampling_bf16(args, info.device),
        cuda_graphs=cuda_graphs_from_args(args),
    )
    limits = Limits(
        args.max_n, args.max_steps, 16, args.request_timeout, max_body_bytes=args.max_body_bytes
    )
    name = args.name or args.model
    return create_app(pipe, name=name, api_key=args.api_key, limits=limits, batcher=batcher)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ELFError(
            "elflow serve needs FastAPI and uvicorn: pip install 'elflow[serve]'"
        ) from None
    if not 0 <= args.port < 65536:
        raise ELFError(f"--port {args.port} is not a port (0-65535)")
    sock = listen(args.host, args.port)  # before the model loads: a busy port fails at once
    try:
        app = build(args)
        server = _stopping_server(
            uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        )
        port = sock.getsockname()[1]
        print(
            f"elflow serve: {args.name or args.model} on http://{args.host}:{port} "
            "(playground at /, API at /v1; Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which on Ctrl-C first answers the open requests (an open stream
        would otherwise hold the shutdown until its last step)."""

        def handle_exit(self, sig, frame) -> None:
            # A signal handler: the batcher's lock may be held by this very thread, so close
            # from another thread.
            batcher = self.config.app.state.batcher
            threading.Thread(target=batcher.close, name="elflow-close", daemon=True).start()
            super().handle_exit(sig, frame)

    return Server


def _stopping_server(config):
    return _server_class()(config)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) (port 0: a free one), or a one-line error."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ELFError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); another server may hold the "
            "port: give another --port (0 picks a free one) or --host"
        ) from None
    sock.listen(128)
    return sock
