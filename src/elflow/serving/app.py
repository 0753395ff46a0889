"""The HTTP server: OpenAI-compatible completions over the batcher, and the playground page.

``create_app(pipe, ...)`` builds a FastAPI application; ``elflow serve`` runs it on uvicorn.
Routes: ``GET /`` (the playground), ``GET /health``, ``GET /metrics`` (Prometheus text),
``GET /v1/models``, ``POST /v1/completions`` (``stream: true``: server-sent events, one per
denoising step, then the final text, then ``[DONE]``). No route reads a path or loads a model
named by a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from elflow.serving.api_schema import (
    Completion,
    Limits,
    RequestError,
    check_completion,
    final_event,
    parse_body,
    response_body,
    step_event,
)
from elflow.serving.batcher import Batcher, Job, QueueFull

if TYPE_CHECKING:
    from elflow.generation.pipeline import ELFPipeline

POLL_S = 0.2
"""How often a waiting request looks at its client and its deadline."""


def model_card(pipe: ELFPipeline, name: str) -> dict[str, Any]:
    """``GET /v1/models``'s entry: the OpenAI fields and, under ``elf``, what the playground
    needs (task, lengths, default sampler settings)."""
    cfg = pipe.config
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "elflow",
        "elf": {
            "task": cfg.task,
            "conditional": cfg.conditional,
            "max_length": cfg.model.max_length,
            "max_input_length": cfg.max_input_length,
            "sampler": asdict(cfg.sampler),
        },
    }


def create_app(
    pipe: ELFPipeline,
    *,
    name: str = "elflow",
    api_key: str | None = None,
    limits: Limits | None = None,
    batcher: Batcher | None = None,
    start: bool = True,
):
    """The FastAPI application serving ``pipe``; its batcher is ``app.state.batcher`` (started
    with the app unless ``start`` is False; stopped at shutdown)."""
    limits = limits or Limits()
    batcher = batcher or Batcher(pipe)
    limits = replace(limits, max_n=min(limits.max_n, batcher.max_batch), max_rows=batcher.max_batch)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start:
            batcher.start()
        yield
        batcher.stop()

    app = FastAPI(
        title="elflow", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.batcher = batcher
    app.state.limits = limits
    metrics = batcher.metrics
    page = resources.files("elflow.serving").joinpath("playground.html").read_text("utf-8")

    def refuse(e: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.request(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def authorised(request: Request) -> bool:
        if not api_key:
            return True
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), api_key.encode()
        )

    unauthorised = RequestError(
        401, "give the server's API key: Authorization: Bearer KEY", None, "authentication_error"
    )

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> str:
        return page

    @app.get("/health")
    async def health():
        alive = batcher.alive()
        body = {
            "status": "ok" if alive else "worker stopped",
            "model": name,
            "queue_depth": batcher.depth(),
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorised(request):
            return refuse(unauthorised)
        return {"object": "list", "data": [model_card(pipe, name)]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrived = time.monotonic()
        if not authorised(request):
            return refuse(unauthorised)
        try:
            try:
                raw = json.loads(await _read_body(request, limits.max_body_bytes))
            except ValueError as e:
                raise RequestError(400, f"the body is not valid JSON: {e}") from None
            body = parse_body(raw)
            completion = check_completion(pipe, body, limits, name)
        except RequestError as e:
            # An unread body over the cap: close the connection rather than drain the rest.
            return refuse(e, {"Connection": "close"} if e.status == 413 else None)
        except Exception as e:  # a bug, not the request's fault: still one JSON line
            return refuse(RequestError(500, f"the server failed on this request: {e!r}"))
        job, events = Job.on_loop(completion, asyncio.get_running_loop())
        try:
            batcher.submit(job)
        except QueueFull as e:
            message = f"the server is busy ({batcher.max_queue} requests queued); retry later"
            return refuse(
                RequestError(429, message, None, "rate_limit_error"),
                {"Retry-After": str(e.retry_after)},
            )
        if completion.stream:
            stream = _events(pipe, batcher, job, events, completion, limits, arrived)
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        answered = False
        try:
            while True:
                event = await _next(events, request, limits, arrived)
                if event is None:  # the client is gone
                    metrics.request(499)
                    return JSONResponse({}, status_code=499)
                if event[0] == "timeout":
                    return refuse(_timed_out(limits))
                if event[0] == "error":
                    answered = True
                    return refuse(event[1])
                if event[0] == "done":
                    answered = True
                    metrics.request(200, time.monotonic() - arrived)
                    return response_body(pipe, completion, event[1])
        finally:  # gone, timed out or the handler cancelled: the work stops
            if not answered:
                batcher.cancel(job)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, read no further than ``limit`` bytes: a 413 :class:`RequestError` at
    once for a ``Content-Length`` over it, or (a chunked body) as soon as the bytes read pass it."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise RequestError(
            413,
            f"the request body is {int(length)} bytes, over this server's limit of {limit} bytes",
        )
    chunks: list[bytes] = []
    size = 0
    async with contextlib.aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                raise RequestError(
                    413, f"the request body is over this server's limit of {limit} bytes"
                )
            chunks.append(chunk)
    return b"".join(chunks)


def _timed_out(limits: Limits) -> RequestError:
    return RequestError(
        504,
        f"the request took over {limits.timeout_s:g} s (the server's request timeout); ask for "
        "fewer samples or steps",
        None,
        "timeout",
    )


async def _next(events: asyncio.Queue, request, limits: Limits, arrived: float):
    """The job's next event; None when the client has gone; ``("timeout",)`` past the limit."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), POLL_S)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                return None
            if time.monotonic() - arrived > limits.timeout_s:
                return ("timeout",)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(
    pipe: ELFPipeline,
    batcher: Batcher,
    job: Job,
    events: asyncio.Queue,
    completion: Completion,
    limits: Limits,
    arrived: float,
) -> AsyncIterator[str]:
    """The stream of a request: a step event per denoising step, the final event, ``[DONE]``.
    A client that goes away cancels the job (the response task is cancelled here)."""
    finished = False
    try:
        while True:
            event = await _next(events, None, limits, arrived)
            if event[0] == "step":
                _, k, steps, texts = event
                yield _sse(step_event(completion, k, steps, texts))
                continue
            if event[0] == "done":
                yield _sse(final_event(pipe, completion, event[1]))
                batcher.metrics.request(200, time.monotonic() - arrived)
            else:
                if event[0] == "timeout":
                    batcher.cancel(job)
                error = event[1] if event[0] == "error" else _timed_out(limits)
                batcher.metrics.request(error.status)
                yield _sse(error.body())
            finished = True
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:
            batcher.cancel(job)


def _version() -> str:
    from elflow import __version__

    return __version__
