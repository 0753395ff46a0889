"""A model folder's Hugging Face model card (``README.md``) and its upload to the Hub.

The card's YAML front matter is what the Hub indexes: ``library_name: elflow`` and
``pipeline_tag: text-generation`` (the Hub's names), tags, the licence and a Hub training dataset
when the config names them, and the evaluation figures when the caller has them (e.g. the JSON
``elflow score`` writes). Its text says what the encoder needs (an offline package, a Hub model or
a local folder), the training data and the licence.
"""

from __future__ import annotations

import json
from pathlib import Path

from elflow.errors import ELFError, first_line
from elflow.io.artifact_config import ArtifactConfig
from elflow.io.model_folder import CARD
from elflow.text.encoder import how_to_get


def model_card(config: ArtifactConfig, metrics: dict | None = None) -> str:
    """The card's text: front matter, what the model is, how to load it, its figures."""
    m = config.model
    kind = "conditional (source to target)" if config.conditional else "unconditional"
    tags = ["elflow", "diffusion", "flow-matching", "continuous-diffusion", kind.split()[0]]
    front = ["---", "library_name: elflow", "pipeline_tag: text-generation", "tags:"]
    front += [f"- {t}" for t in tags]
    if config.license:
        front.append(f"license: {json.dumps(config.license)}")
    hub_data = config.data and not _local(config.data)
    if hub_data:
        front += ["datasets:", f"- {json.dumps(config.data)}"]
    figures = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str))}
    if figures:
        front.append("elflow_metrics:")
        front += [f"  {k}: {json.dumps(v)}" for k, v in sorted(figures.items())]
    front.append("---")
    body = [
        "",
        "# An ELF model",
        "",
        f"An {kind} ELF (Embedded Language Flows, arXiv 2605.10938) model: a rectified-flow "
        f"network of depth {m.depth} and width {m.hidden_size} over the latents of the frozen "
        f"encoder `{config.encoder}` (max length {m.max_length} tokens), made with elflow.",
        "",
        "```python",
        "from elflow import ELFPipeline",
        "",
        'pipe = ELFPipeline.from_pretrained("<this repository or folder>")',
        "print(pipe(4).texts)" if not config.conditional else 'print(pipe(sources=["..."]).texts)',
        "```",
        "",
        "Or from a shell: `elflow sample --model <this repository or folder> -n 4`.",
        "",
        f"- **Encoder:** `{config.encoder}`, from {how_to_get(config.encoder)}.",
        f"- **Training data:** {_data_line(config.data, bool(hub_data))}.",
        f"- **Licence:** {f'`{config.license}`' if config.license else 'not stated'}.",
    ]
    if figures:
        body += ["", "| metric | value |", "|---|---|"]
        body += [f"| {k} | {v} |" for k, v in sorted(figures.items())]
    return "\n".join(front + body) + "\n"


def _local(data: str) -> bool:
    """A local path rather than a Hub dataset id ("name" or "org/name", no file suffix)."""
    path = Path(data).expanduser()
    return (
        path.exists()
        or data.startswith((".", "~", "/"))
        or data.count("/") > 1
        or bool(path.suffix)
    )


def _data_line(data: str, hub: bool) -> str:
    if not data:
        return "not recorded"
    if hub:
        return f"the Hugging Face dataset [`{data}`](https://huggingface.co/datasets/{data})"
    return f"local data `{Path(data).name}`, not published with the model"


def write_model_card(folder: Path, config: ArtifactConfig, metrics: dict | None = None) -> Path:
    path = Path(folder) / CARD
    path.write_text(model_card(config, metrics))
    return path


def upload_folder(folder: Path, repo_id: str, private: bool, token: str | None) -> str:
    """Create ``repo_id`` on the Hub if needed and upload ``folder``; returns the repo's URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model")
    except Exception as e:  # the Hub client's own errors: offline, auth, network
        raise ELFError(
            f"could not upload to the Hugging Face Hub repository {repo_id!r}: "
            f"{first_line(e)}; check your network, HF_HUB_OFFLINE and your token "
            "(huggingface-cli login)"
        ) from None
    return str(url)
