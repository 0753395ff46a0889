"""The OpenAI completions protocol as ELF answers it: a request checked once into a
:class:`Completion` (its rows and sampler), and the response and stream-event bodies.

A request's ``prompt`` is a conditional model's source text, or, for an unconditional model,
kept text that the sample continues (a prefix infill; ``[___]`` gaps allowed anywhere);
``max_tokens`` is the generated length (a gap of exactly that many tokens); without it an
unconditional sample with no prompt is a free sample of the model's own length, as ``elflow
sample`` draws it. Sample k of a request is sample k of its seed (rows of
:mod:`elflow.generation.engine`), so it equals ``elflow sample --seed SEED`` with the same
settings, whatever else the server batches it with (bitwise in fp32; under bf16 autocast a
batch's shape changes the last bits).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elflow.config import SamplerConfig, change_sampler
from elflow.errors import ELFError
from elflow.generation.engine import Row
from elflow.generation.infill import GAP, InfillRequest, build_template, parse_template
from elflow.io.jsonl import check_unicode

UNSUPPORTED = {
    "temperature": "ELF samples by integrating a flow; set steps, gamma, w or cfg instead",
    "top_p": "ELF samples by integrating a flow; set steps, gamma, w or cfg instead",
    "logprobs": "ELF gives no per-token log-probabilities",
    "echo": "the prompt is not echoed; an unconditional model's text keeps it verbatim",
    "stop": "ELF writes every token at once; it has no stop sequences",
    "best_of": "ask for n samples instead",
    "suffix": "write the gap inside the prompt instead: 'text [___5] more text'",
    "presence_penalty": "ELF has no sampling penalties",
    "frequency_penalty": "ELF has no sampling penalties",
    "logit_bias": "ELF has no logit bias",
}
"""OpenAI fields ELF cannot honour, refused with the reason rather than silently ignored."""


class CompletionBody(BaseModel):
    """The JSON body of ``POST /v1/completions`` (unknown fields refused)."""

    model_config = ConfigDict(extra="forbid", strict=False)

    model: str | None = None
    prompt: str | list[str] = ""
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # ELF's sampler settings, defaulting to the model's
    sampler: str | None = None
    steps: int | None = Field(None, ge=1)
    gamma: float | None = Field(None, ge=0.0)
    w: float | None = None
    cfg: float | None = None


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_n: int = 16
    max_steps: int = 256
    max_prompts: int = 16
    timeout_s: float = 300.0
    max_rows: int = 32
    """Samples per request (n times the prompts): at most the batch size."""
    max_prompt_chars: int = 20_000
    max_body_bytes: int = 4 * 1024 * 1024
    """Bytes of a request body, refused with 413 before more is read. 4 MiB holds the largest
    body of valid prompts (16 of 20,000 characters, each written as JSON's longest escape, 12
    bytes for a character outside the BMP) with room to spare."""


@dataclass(frozen=True)
class Completion:
    """A checked request: its rows (one per choice), its sampler and what the response names."""

    id: str
    created: int
    model: str
    rows: tuple[Row, ...]
    sampler: SamplerConfig
    seed: int
    stream: bool
    with_length: bool
    prompt_tokens: int

    @property
    def key(self) -> tuple[SamplerConfig, str]:
        """Requests with one key (sampler settings and row kind) run in one batch."""
        return self.sampler, self.rows[0].kind


class RequestError(Exception):
    """A request the server refuses: its HTTP status, one-line message and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


def _validation_error(e: ValidationError) -> RequestError:
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        why = UNSUPPORTED.get(str(field))
        if why:
            return RequestError(400, f"'{field}' is not supported: {why}", field)
        known = ", ".join(CompletionBody.model_fields)
        return RequestError(400, f"unknown field '{field}'; the fields are: {known}", field)
    if field == "prompt" or (field or "").startswith("prompt."):
        return RequestError(422, "prompt must be a string or a list of strings", "prompt")
    return RequestError(422, f"{field}: {err['msg']} (got {err.get('input')!r})", field)


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "temperature": (None, 1, 1.0),
    "top_p": (None, 1, 1.0),
    "logprobs": (None,),
    "echo": (None, False),
    "stop": (None, [], ""),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
"""Values of the fields in :data:`UNSUPPORTED` that ask for nothing (many clients send them by
default): accepted and dropped."""


def parse_body(raw: Any) -> CompletionBody:
    """The body as a :class:`CompletionBody`, or a :class:`RequestError` saying what to fix."""
    if not isinstance(raw, dict):
        raise RequestError(400, "the body must be a JSON object")
    raw = {
        k: v
        for k, v in raw.items()
        if not (k in NEUTRAL and any(v == x and type(v) is type(x) for x in NEUTRAL[k]))
    }
    try:
        return CompletionBody.model_validate(raw)
    except ValidationError as e:
        raise _validation_error(e) from None


SAMPLER_FIELDS = tuple(
    f.name for f in fields(SamplerConfig) if f.name in CompletionBody.model_fields
)
"""The request fields that change the model's sampler settings."""


def _sampler(pipe, body: CompletionBody, limits: Limits) -> SamplerConfig:
    changes = {k: getattr(body, k) for k in SAMPLER_FIELDS if getattr(body, k) is not None}
    if body.steps is not None and body.steps > limits.max_steps:
        raise RequestError(
            422, f"steps {body.steps} is over this server's {limits.max_steps}", "steps"
        )
    try:
        sampler = pipe.check_sampler(change_sampler(pipe.sampler, changes))
    except (ELFError, ValueError) as e:
        # The library names config keys (sampler.w); a request names its own fields (w).
        message = re.sub(r"\bsampler\.(?=\w)", "", str(e).splitlines()[0])
        named = [k for k in changes if re.search(rf"\b{k}\b", message)]
        raise RequestError(422, message, (named or [*changes, None])[0]) from None
    if sampler.steps > limits.max_steps:  # the model's default too, not only a request's
        raise RequestError(
            422, f"steps {sampler.steps} is over this server's {limits.max_steps}", "steps"
        )
    return sampler


def template_text(prompt: str, max_tokens: int | None) -> str | None:
    """An unconditional request as an infill template (``elflow sample --infill``'s ``text``):
    the prompt followed by a gap of ``max_tokens`` (default 16) unless it has ``[___]`` gaps of
    its own; None (a free sample) for no prompt and no length."""
    if not prompt and max_tokens is None:
        return None
    if GAP.search(prompt):
        if max_tokens is not None:
            raise RequestError(
                422, "the prompt's [___N] gaps set the length; drop max_tokens", "max_tokens"
            )
        return prompt
    gap = f"[___{16 if max_tokens is None else max_tokens}]"
    return f"{prompt.rstrip()} {gap}" if prompt.strip() else gap


def _infill(text: str | None, source: str | None = None) -> InfillRequest | None:
    if text is None:
        return None
    try:
        return InfillRequest(parts=parse_template(text), source=source)
    except ELFError as e:
        raise RequestError(422, str(e), "prompt") from None


def check_completion(pipe, body: CompletionBody, limits: Limits, model_name: str) -> Completion:
    """Check a parsed body against the model and the limits, once, into a :class:`Completion`."""
    if body.model not in (None, "", model_name):
        raise RequestError(
            404,
            f"model '{body.model}' is not served here; this server serves "
            f"'{model_name}' (GET /v1/models)",
            "model",
            "not_found_error",
        )
    if body.n > limits.max_n:
        raise RequestError(422, f"n {body.n} is over this server's {limits.max_n}", "n")
    prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    if not prompts or len(prompts) > limits.max_prompts:
        raise RequestError(422, f"give 1 to {limits.max_prompts} prompts", "prompt")
    if len(prompts) * body.n > limits.max_rows:
        raise RequestError(
            422,
            f"{len(prompts)} prompts x n {body.n} = {len(prompts) * body.n} samples, over this "
            f"server's {limits.max_rows} per request (its batch size)",
            "n",
        )
    room = pipe.config.model.max_length
    if body.max_tokens is not None and body.max_tokens > room:
        raise RequestError(
            422, f"max_tokens {body.max_tokens} is over the model's {room} tokens", "max_tokens"
        )
    for prompt in prompts:
        try:
            check_unicode(prompt, "prompt")
        except ELFError as e:
            raise RequestError(422, str(e), "prompt") from None
        if len(prompt) > limits.max_prompt_chars:
            raise RequestError(
                422,
                f"a prompt of {len(prompt)} characters is over this server's "
                f"{limits.max_prompt_chars}",
                "prompt",
            )
        for m in GAP.finditer(prompt):
            # Compared as digits first: int() of thousands of digits would itself fail.
            digits = (m.group(2) or m.group(1) or "0").lstrip("0") or "0"
            if len(digits) > len(str(room)) or int(digits) > room:
                gap = m.group(0) if len(m.group(0)) <= 40 else f"{m.group(0)[:30]}...]"
                raise RequestError(422, f"gap {gap} is over the model's {room} tokens", "prompt")
    sampler = _sampler(pipe, body, limits)
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    conditional = pipe.config.conditional
    rows: list[Row] = []
    for prompt in prompts:
        if conditional and not prompt.strip():
            raise RequestError(
                422,
                "this model is conditional: the prompt is the source text "
                "to translate or summarise",
                "prompt",
            )
        for _ in range(body.n):
            k = len(rows)
            if conditional:
                text = None if body.max_tokens is None else f"[___{body.max_tokens}]"
                rows.append(Row(seed, k, prompt, _infill(text, prompt)))
            else:
                rows.append(Row(seed, k, None, _infill(template_text(prompt, body.max_tokens))))
    if len({row.kind for row in rows}) > 1:
        raise RequestError(
            422,
            "these prompts mix free samples (an empty prompt, no max_tokens) with continued or "
            "filled ones; give max_tokens, or send them as separate requests",
            "prompt",
        )
    _check_room(pipe, rows)
    prompt_tokens = sum(_count(pipe, GAP.sub(" ", p)) for p in prompts)  # the text, not [___]
    return Completion(
        id=f"cmpl-{secrets.token_hex(12)}",
        created=int(time.time()),
        model=model_name,
        rows=tuple(rows),
        sampler=sampler,
        seed=seed,
        stream=body.stream,
        with_length=body.max_tokens is not None,
        prompt_tokens=prompt_tokens,
    )


def _check_room(pipe, rows: list[Row]) -> None:
    """Infill rows must fit the model's length: checked now, so the batch cannot fail later."""
    cfg = pipe.config
    infill = [r for r in rows if r.infill is not None]  # gap lengths are drawn per row
    if not infill:
        return
    try:
        build_template(
            pipe.tokenizer,
            [r.infill for r in infill],
            length=cfg.model.max_length,
            pad_id=pipe.row_pad_id,
            eos_id=pipe.tokens.eos_id,
            indices=[r.index for r in infill],
            seed=[r.seed for r in infill],
            max_input_length=cfg.max_input_length if cfg.conditional else 0,
        )
    except ELFError as e:
        raise RequestError(422, f"{e} (max_tokens, prompt)", "max_tokens") from None


def _count(pipe, text: str) -> int:
    return len(pipe.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def _kept(pipe, row: Row) -> int:
    """Tokens of a row's text that the sample keeps from the prompt (a continued or filled
    unconditional prompt's text comes back in the choice's text)."""
    if row.infill is None or row.infill.parts is None:
        return 0
    return sum(_count(pipe, part) for part in row.infill.parts if isinstance(part, str))


def usage(pipe, completion: Completion, texts: list[str]) -> dict[str, int]:
    """OpenAI's token counts: the prompts' text (gap markup left out), and what each choice
    added to its prompt (its text less the kept prompt)."""
    tokens = sum(
        max(0, _count(pipe, t) - _kept(pipe, row))
        for t, row in zip(texts, completion.rows, strict=True)
    )
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": tokens,
        "total_tokens": completion.prompt_tokens + tokens,
    }


def response_body(pipe, completion: Completion, texts: list[str]) -> dict[str, Any]:
    """The ``text_completion`` object of a finished request."""
    reason = "length" if completion.with_length else "stop"
    return {
        "id": completion.id,
        "object": "text_completion",
        "created": completion.created,
        "model": completion.model,
        "seed": completion.seed,
        "choices": [
            {"index": i, "text": t, "logprobs": None, "finish_reason": reason}
            for i, t in enumerate(texts)
        ],
        "usage": usage(pipe, completion, texts),
    }


def step_event(completion: Completion, step: int, steps: int, texts: list[str]) -> dict[str, Any]:
    """A stream event after denoising step ``step`` (from 0): each choice's ``text`` delta is
    empty and its decoded text so far is in ``elf.text``, so a client that joins the deltas
    gets exactly the final text."""
    return {
        "id": completion.id,
        "object": "text_completion",
        "created": completion.created,
        "model": completion.model,
        "choices": [
            {
                "index": i,
                "text": "",
                "logprobs": None,
                "finish_reason": None,
                "elf": {"step": step + 1, "steps": steps, "text": t},
            }
            for i, t in enumerate(texts)
        ],
    }


def final_event(pipe, completion: Completion, texts: list[str]) -> dict[str, Any]:
    """The last stream event: each choice's whole text as its one delta."""
    body = response_body(pipe, completion, texts)
    steps = completion.sampler.steps
    for choice in body["choices"]:
        choice["elf"] = {"step": steps, "steps": steps, "text": choice["text"], "final": True}
    return body
