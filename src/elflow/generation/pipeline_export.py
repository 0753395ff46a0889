"""A pipeline as a model folder (ELF_SPEC §10): ``save_pretrained`` writes the weights, config,
tokenizer and model card that ``ELFPipeline.from_pretrained`` loads; ``push_to_hub`` uploads
them (the diffusers and transformers way)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from elflow.io.artifact import ArtifactConfig, save_model
from elflow.io.model_card import upload_folder, write_model_card
from elflow.model import ELF


class ModelFolderMixin:
    """``save_pretrained`` and ``push_to_hub`` for a class holding ``model``, ``config`` and
    ``tokenizer`` (:class:`elflow.ELFPipeline`)."""

    model: ELF
    config: ArtifactConfig
    tokenizer: Any

    def save_pretrained(
        self, folder: str | Path, *, metrics: dict | None = None, overwrite: bool = False
    ) -> Path:
        """Write the pipeline as a model folder that :meth:`from_pretrained` (and ``elflow
        sample --model``) loads: ``model.safetensors``, ``config.json``, ``tokenizer/`` and a
        ``README.md`` model card whose YAML front matter names ``library_name: elflow``;
        ``metrics`` (e.g. an ``elflow score`` result) go into the card. A folder that already
        holds a model's files is refused unless ``overwrite=True``."""
        out = save_model(folder, self.model, self.config, overwrite=overwrite)
        self.tokenizer.save_pretrained(str(Path(out) / "tokenizer"))
        write_model_card(Path(out), self.config, metrics)
        return Path(out)

    def push_to_hub(
        self, repo_id: str, *, private: bool = False, token: str | None = None, **save
    ) -> str:
        """:meth:`save_pretrained` into a temporary folder and upload it to the Hugging Face Hub
        repository ``repo_id`` (created if needed) with ``huggingface_hub``; returns its URL."""
        with tempfile.TemporaryDirectory() as tmp:
            return upload_folder(self.save_pretrained(tmp, **save), repo_id, private, token)
