"""The demo model: the small ELF model shipped inside the package (``elflow/demo_model/``: bf16
safetensors, config, the MiniLM vocabulary files and ``card.json`` with its training and quality
record; the model source ``demo``). :func:`export_demo` builds such a folder from a training run;
``elflow demo`` (:mod:`elflow.cli.demo_cmd`) shows it at work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from elflow.io.artifact import load_model, save_model

CARD = "card.json"
TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def export_demo(
    run: str | Path, out: str | Path, card: dict[str, Any], dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write a demo model folder: EMA weights in ``dtype``, config, tokenizer files and a card."""
    from elflow.text.encoder import resolve_pretrained

    model, config = load_model(run)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model.to(dtype), config)
    tok_src = Path(resolve_pretrained(config.tokenizer))
    (tmp / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (tok_src / name).is_file():
            shutil.copy(tok_src / name, tmp / "tokenizer" / name)
    (tmp / CARD).write_text(json.dumps(card, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_card(path: Path) -> dict[str, Any]:
    """A model's card.json, or {} when it has none or it is not a JSON object (the figures
    beside the samples' are then left out)."""
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return card if isinstance(card, dict) else {}
