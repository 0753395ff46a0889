"""``elflow serve`` on a real loopback port: the OpenAI completions API (its official client),
batching that leaves every sample as ``elflow sample`` writes it, limits, cancellation, the API
key, metrics, and the playground page in headless Chromium."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from elflow import ELFPipeline
from elflow.__main__ import main
from elflow.errors import ELFError
from elflow.serving.api_schema import Limits
from elflow.serving.app import create_app
from elflow.serving.batcher import Batcher
from tests.builders import CHROMIUM, CHROMIUM_FLAGS, read

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")


def wait_until(condition, timeout: float = 30.0) -> None:
    """Block until ``condition()`` holds (another thread makes it so), or fail."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting for the server"
        time.sleep(0.01)


@contextlib.contextmanager
def serving(app):
    """``app`` on uvicorn on a free loopback port, in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


@pytest.fixture(scope="module")
def model(infill_model):
    return infill_model


@pytest.fixture(scope="module")
def pipe(model):
    p = ELFPipeline.from_pretrained(model)
    p.config = replace(p.config, sampler=replace(p.config.sampler, steps=3))
    return p


def app_for(pipe, *, start=True, limits=None, **batcher):
    return create_app(
        pipe, name="tiny", limits=limits, batcher=Batcher(pipe, **batcher), start=start
    )


@pytest.fixture(scope="module")
def url(pipe):
    with serving(app_for(pipe)) as base:
        yield base


def complete(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def cli_texts(tmp_path: Path, model: str, argv: list[str]) -> list[str]:
    out = tmp_path / f"cli-{len(list(tmp_path.iterdir()))}.jsonl"
    assert main(["sample", "--model", model, "--steps", "3", "--out", str(out), *argv]) == 0
    return [r["text"] for r in read(out)]


def test_the_openai_client_completes_and_streams_as_elflow_sample(url, model, tmp_path):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    got = client.completions.create(
        model="tiny", prompt="In the beginning", max_tokens=4, seed=3, n=2
    )
    assert [c.index for c in got.choices] == [0, 1] and got.choices[0].finish_reason == "length"
    assert got.object == "text_completion"
    # usage: the prompt's tokens, and what the two choices added to it (4 tokens each, counted
    # again from the decoded text: a word piece may merge or split)
    assert got.usage.prompt_tokens == 3  # in / the / beginning
    assert 2 * 2 <= got.usage.completion_tokens <= 2 * 6, got.usage
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    infill = tmp_path / "infill.jsonl"
    infill.write_text(json.dumps({"text": "In the beginning [___4]"}) + "\n")
    want = cli_texts(tmp_path, model, ["--infill", str(infill), "--seed", "3"])
    assert got.choices[0].text == want[0] and got.choices[0].text.startswith("In the beginning")
    # a free sample: no prompt, no length, is `elflow sample -n`
    free = client.completions.create(model="tiny", prompt="", seed=8, n=2)
    assert [c.text for c in free.choices] == cli_texts(tmp_path, model, ["-n", "2", "--seed", "8"])
    # streaming: one event per step (the text so far under "elf"), then the final text
    chunks = list(
        client.completions.create(
            model="tiny", prompt="In the beginning", max_tokens=4, seed=3, stream=True
        )
    )
    steps = [c.choices[0].model_extra["elf"] for c in chunks]
    assert [s["step"] for s in steps] == [1, 2, 3, 3] and steps[-1]["final"]
    assert "".join(c.choices[0].text for c in chunks) == want[0] == steps[-1]["text"]
    assert client.models.list().data[0].id == "tiny"


def test_a_conditional_models_prompt_is_its_source(cond_model, tmp_path):
    model = str(cond_model)
    pipe = ELFPipeline.from_pretrained(model)
    with serving(create_app(pipe, name="c")) as base:
        r = complete(base, prompt=["a source", "another source"], seed=2, steps=3)
        assert r.status_code == 200, r.text
        missing = complete(base, prompt="", steps=3)
    want = cli_texts(
        tmp_path, model, ["--source", "a source", "--source", "another source", "--seed", "2"]
    )
    assert [c["text"] for c in r.json()["choices"]] == want
    assert missing.status_code == 422 and "the prompt is the source" in missing.text


def test_requests_batched_together_equal_each_alone(pipe):
    """Different lengths, prompts and seeds queued, then run as one batch: each response is
    what the same request gets alone, and the metrics show the one batch."""
    bodies = [
        {"prompt": "In the beginning", "max_tokens": 2, "seed": 1},
        {"prompt": "", "max_tokens": 6, "seed": 4, "n": 2},
        {"prompt": "God [___3] light", "seed": 1},
        {"prompt": "Moses said", "max_tokens": 5, "seed": 9},
    ]
    app = app_for(pipe, start=False, window_s=0.0)
    batcher = app.state.batcher
    with serving(app) as base, ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(complete, base, **b) for b in bodies]
        wait_until(lambda: batcher.depth() == len(bodies))
        batcher.start()
        together = [f.result().json() for f in futures]
        alone = [complete(base, **b).json() for b in bodies]
        metrics = httpx.get(f"{base}/metrics").text
    for t, a in zip(together, alone, strict=True):
        assert [c["text"] for c in t["choices"]] == [c["text"] for c in a["choices"]]
    assert 'elflow_batch_size_bucket{le="4"} 4' in metrics  # the four alone
    assert "elflow_batch_size_count 5" in metrics  # and the one batch of 5 samples
    assert 'elflow_requests_total{status="200"} 8' in metrics


def test_a_full_queue_answers_429_and_a_slow_request_504(pipe):
    app = app_for(pipe, start=False, max_queue=1)
    with serving(app) as base, ThreadPoolExecutor(1) as pool:
        first = pool.submit(complete, base, prompt="", seed=0)
        wait_until(lambda: app.state.batcher.depth() == 1)
        busy = complete(base, prompt="", seed=1)
        assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
        assert "busy" in busy.json()["error"]["message"]
        app.state.batcher.start()
        assert first.result().status_code == 200
    slow = app_for(pipe, start=False, limits=Limits(timeout_s=0.3))
    with serving(slow) as base:
        r = complete(base, prompt="", seed=0)
        assert r.status_code == 504 and "request timeout" in r.json()["error"]["message"]
        assert slow.state.batcher.depth() == 0  # its work was cancelled


def test_a_client_that_goes_away_cancels_its_work(pipe):
    import socket

    app = app_for(pipe, start=False)
    batcher = app.state.batcher
    with serving(app) as base:
        host, port = base.removeprefix("http://").split(":")
        for stream in (True, False):
            body = json.dumps({"prompt": "", "stream": stream}).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(head.encode() + body)
                wait_until(lambda: batcher.depth() == 1)
            wait_until(lambda: batcher.depth() == 0)  # the client gone: dropped from the queue
        assert batcher.metrics.cancelled == 2 and batcher.metrics.samples == 0


def test_bad_requests_get_one_clear_line(url):
    cases = [
        ("{not json", 400, "not valid JSON"),
        ({"prompt": "x", "temperature": 0.7}, 400, "'temperature' is not supported"),
        ({"prompt": "x", "colour": 1}, 400, "unknown field 'colour'"),
        ({"prompt": [1, 2]}, 422, "prompt must be a string or a list of strings"),
        ({"n": 99}, 422, "n 99 is over this server's 16"),
        ({"steps": 100000}, 422, "steps 100000 is over this server's 256"),
        ({"max_tokens": 0}, 422, "max_tokens"),
        ({"max_tokens": 500}, 422, "max_tokens 500 is over the model's 16"),
        ({"max_tokens": 15}, 422, "more than the model's 16"),
        ({"prompt": ["a", "word " * 20], "max_tokens": 2}, 422, "more than the model's 16"),
        ({"sampler": "nope"}, 422, "must be one of"),
        ({"model": "/etc/passwd"}, 404, "is not served here"),
        ({"prompt": "a [___3] b", "max_tokens": 2}, 422, "drop max_tokens"),
        ([1, 2], 400, "a JSON object"),
        ({"prompt": ["", "In the beginning"]}, 422, "mix free samples"),
        ({"max_tokens": 10**9}, 422, "max_tokens 1000000000 is over the model's 16"),
        ({"prompt": "a [___99999999999]"}, 422, "is over the model's 16"),
        ({"prompt": "a [___" + "9" * 5000 + "]"}, 422, "is over the model's 16"),
        ({"prompt": "a [___000016]"}, 422, "more than the model's 16"),
        ({"prompt": ["a", "b", "c"], "n": 16, "max_tokens": 2}, 422, "over this server's 32"),
        ({"prompt": "x", "temperature": 0.0}, 400, "'temperature' is not supported"),
        ('{"prompt": "Hello \\ud800", "max_tokens": 2}', 422, "unpaired surrogate escape"),
        ({"w": -1.0}, 422, "w must be"),
    ]
    for body, status, words in cases:
        if isinstance(body, str):
            r = httpx.post(f"{url}/v1/completions", content=body, timeout=30)
        else:
            r = (
                complete(url, **body)
                if isinstance(body, dict)
                else httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            )
        assert r.status_code == status, (body, r.text)
        message = r.json()["error"]["message"]
        assert words in message and "\n" not in message, (body, message)
    assert complete(url, steps=2, w=-1.0).json()["error"]["param"] == "w"  # the field at fault


def test_a_body_over_max_body_bytes_gets_413_before_it_is_read(pipe):
    import http.client
    import socket

    app = app_for(pipe, limits=Limits(max_body_bytes=2000))
    with serving(app) as base:
        # Content-Length over the limit: refused at once, though not a byte of the body came
        host, port = base.removeprefix("http://").split(":")
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            "application/json\r\nContent-Length: 10000000000\r\n\r\n"
        )
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(head.encode())
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            assert answer.status == 413
            assert answer.getheader("connection") == "close"  # the rest is not drained
            message = json.loads(answer.read())["error"]["message"]
        assert message == (
            "the request body is 10000000000 bytes, over this server's limit of 2000 bytes"
        )
        big = complete(base, prompt="word " * 500, max_tokens=2)
        assert big.status_code == 413, big.text
        assert big.json()["error"]["type"] == "invalid_request_error"

        def chunks(body: bytes, size: int = 300):  # a generator: chunked transfer encoding
            for i in range(0, len(body), size):
                yield body[i : i + size]

        post = f"{base}/v1/completions"
        chunked = httpx.post(post, content=chunks(b" " * 5000 + b"{}"), timeout=30)
        assert chunked.status_code == 413, chunked.text
        message = chunked.json()["error"]["message"]
        assert message == "the request body is over this server's limit of 2000 bytes"
        # a body of exactly the limit is read and served, with a length or chunked
        body = {"prompt": "", "steps": 1, "seed": 0, "user": ""}
        pad = 2000 - len(json.dumps(body).encode())
        exact = json.dumps({**body, "user": "u" * pad}).encode()
        assert len(exact) == 2000
        headers = {"Content-Type": "application/json"}
        for content in (exact, chunks(exact)):
            ok = httpx.post(post, content=content, headers=headers, timeout=60)
            assert ok.status_code == 200, ok.text
        metrics = httpx.get(f"{base}/metrics").text
    assert 'elflow_requests_total{status="413"} 3' in metrics
    assert 'elflow_requests_total{status="200"} 2' in metrics


def test_a_chunked_body_is_read_no_further_than_the_limit():
    import asyncio

    from starlette.requests import Request

    from elflow.serving.api_schema import RequestError
    from elflow.serving.app import _read_body

    received = []

    async def receive():  # 100 chunks of 500 bytes, as a client streams them
        received.append(1)
        return {"type": "http.request", "body": b" " * 500, "more_body": len(received) < 100}

    scope = {"type": "http", "method": "POST", "headers": [(b"transfer-encoding", b"chunked")]}
    with pytest.raises(RequestError) as e:
        asyncio.run(_read_body(Request(scope, receive), 2000))
    assert e.value.status == 413 and len(received) == 5  # 2,500 bytes read, not 50,000


def test_the_neutral_values_clients_send_by_default_are_accepted(url):
    neutral = {
        "temperature": 1.0,
        "top_p": 1,
        "stop": None,
        "logprobs": None,
        "echo": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "best_of": 1,
        "logit_bias": {},
    }
    r = complete(url, prompt="", steps=1, seed=0, n=2, **neutral)
    assert r.status_code == 200, r.text
    assert (
        r.json()["choices"][1]["text"]
        == complete(url, prompt="", steps=1, seed=0, n=2).json()["choices"][1]["text"]
    )


def test_the_api_key_guards_the_api(pipe):
    with serving(create_app(pipe, name="k", api_key="s3cret")) as base:
        assert complete(base, prompt="").status_code == 401
        wrong = httpx.post(
            f"{base}/v1/completions",
            json={"prompt": ""},
            headers={"Authorization": "Bearer nope"},
            timeout=60,
        )
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/models").status_code == 401
        ok = httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "", "steps": 1},
            headers={"Authorization": "Bearer s3cret"},
            timeout=60,
        )
        assert ok.status_code == 200
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        for header, status in [("bearer s3cret", 200), ("Basic s3cret", 401), ("s3cret", 401)]:
            got = httpx.get(f"{base}/v1/models", headers={"Authorization": header})
            assert got.status_code == status, header  # the scheme is case-insensitive


def test_serve_refuses_bad_settings_in_one_line(capsys):
    assert main(["serve", "--model", "demo", "--max-n", "64", "--max-batch", "8"]) == 2
    assert "--max-n 64 is over --max-batch 8" in capsys.readouterr().err
    assert main(["serve", "--model", "demo", "--max-body-bytes", "0"]) == 2
    assert "--max-body-bytes must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--model", "demo", "--port", "70000"]) == 2
    assert "is not a port" in capsys.readouterr().err
    import socket

    with socket.socket() as busy:  # a port another server holds: refused before the model loads
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "demo", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "another --port" in err


def test_serve_flags_reach_the_limits(model):
    from elflow.__main__ import build_parser
    from elflow.cli.serve_cmd import build

    parser = build_parser()
    argv = ["serve", "--model", model, "--device", "cpu", "--max-n", "4"]
    app = build(parser.parse_args([*argv, "--max-body-bytes", "2000"]))
    assert app.state.limits.max_body_bytes == 2000 and app.state.limits.max_n == 4
    assert build(parser.parse_args(argv)).state.limits.max_body_bytes == Limits().max_body_bytes
    # The model's own step count is a request's default: it must fit --max-steps too.
    steps = ELFPipeline.from_pretrained(model).sampler.steps
    with pytest.raises(ELFError, match=f"runs {steps} steps, over --max-steps {steps - 1}"):
        build(parser.parse_args([*argv, "--max-steps", str(steps - 1)]))


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)")
def test_the_playground_streams_the_denoising_in_chromium(url):
    sync_api = pytest.importorskip("playwright.sync_api")
    want = complete(url, prompt="And God said", max_tokens=5, seed=7).json()["choices"][0]["text"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page()
        seen: list[str] = []
        page.on("console", lambda m: seen.append(m.text))
        page.goto(url + "/")
        page.wait_for_function("document.getElementById('steps').value !== ''")
        assert "unconditional" in page.inner_text("#model")
        page.fill("#prompt", "And God said")
        page.fill("#max_tokens", "5")
        page.fill("#seed", "7")
        page.evaluate("""() => { window.frames_seen = [];
            // every text the status was set to, even two set within one task
            new MutationObserver((records) => records.forEach((r) =>
                r.addedNodes.forEach((n) => window.frames_seen.push(n.textContent))))
              .observe(document.getElementById('status'), {childList: true}); }""")
        page.click("#run")
        page.wait_for_selector("#status[data-state='done']", timeout=60_000)
        assert page.get_attribute("#output", "data-text") == want
        labels = page.evaluate("window.frames_seen")
        assert [x for x in labels if x.startswith("step ")] == [
            "step 1 / 3",
            "step 2 / 3",
            "step 3 / 3",
        ]
        assert page.locator("#output span").count() == len(want.split())
        browser.close()
    assert not [m for m in seen if "error" in m.lower()]


def test_a_running_batch_stops_at_its_next_step_when_its_clients_are_gone(pipe):
    from elflow.serving.api_schema import check_completion, parse_body
    from elflow.serving.batcher import Job

    batcher = Batcher(pipe)
    body = parse_body({"prompt": "", "stream": True, "steps": 3})
    events: list = []

    def push(event):  # the client leaves after the first step's event
        events.append(event)
        batcher.cancel(job)

    job = Job(check_completion(pipe, body, Limits(), "tiny"), push)
    batcher.run([job])
    assert [e[0] for e in events] == ["step"] and batcher.metrics.samples == 0


def test_a_running_batch_stops_once_all_its_requests_are_gone_streaming_or_not(pipe):
    from elflow.serving.api_schema import check_completion, parse_body
    from elflow.serving.batcher import Job, _Stopped, stop_when_gone

    done: list = []
    jobs = [
        Job(
            check_completion(pipe, parse_body({"prompt": "", "seed": s}), Limits(), "t"),
            done.append,
        )
        for s in (1, 2)
    ]
    check = stop_when_gone(jobs)
    Batcher(pipe).cancel(jobs[0])
    check(None)  # one request still wants its samples: the batch goes on
    Batcher(pipe).cancel(jobs[1])
    with pytest.raises(_Stopped):
        check(None)


@pytest.mark.slow
def test_ctrl_c_stops_the_server_promptly_with_a_stream_open(uncond_model):
    """``elflow serve`` in its own process, a stream open on a long request, then SIGINT: the
    stream is answered (503) and the process exits within a couple of seconds."""
    import http.client
    import os
    import queue
    import re
    import signal
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = ["serve", "--model", str(uncond_model), "--port", "0", "--device", "cpu"]
    argv += ["--max-steps", "100000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "elflow", *argv], stderr=subprocess.PIPE, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        end, port = time.monotonic() + 120, None
        while port is None:
            line = lines.get(timeout=max(0.0, end - time.monotonic()))
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            port = int(found.group(1)) if found else None
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = json.dumps({"prompt": "", "stream": True, "steps": 100000})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # the stream is open and stepping
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest = []  # events flow every step: read until the stream ends or 10 s have passed
        while time.monotonic() - started < 10 and (line := response.readline()):
            rest.append(line.decode())
        rest = "".join(rest)
        proc.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "the server is shutting down" in rest and rest.rstrip().endswith("data: [DONE]")
    assert took < 3.0, took
    said = "".join(lines.queue)
    assert "Traceback" not in said and proc.returncode in (0, 130)
