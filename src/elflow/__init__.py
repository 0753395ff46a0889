"""elflow: ELF (Embedded Language Flows, arXiv 2605.10938) in PyTorch.

Public entry points: :class:`ELFPipeline` for generation, :func:`load_model` for any model source,
:class:`ELF` the network, :func:`elf_loss` the training objective, :func:`sample` the sampler.
"""

from elflow.io.artifact import ArtifactConfig, import_official, load_model, save_model
from elflow.config import ModelConfig, ObjectiveConfig, SamplerConfig, model_preset
from elflow.errors import ELFError
from elflow.model import ELF, build_model
from elflow.objective import Batch, Draws, elf_loss, sample_draws
from elflow.generation.pipeline import ELFPipeline
from elflow.sampling import sample, sample_generators

__version__ = "0.1.0"

__all__ = [
    "ELF",
    "ArtifactConfig",
    "Batch",
    "Draws",
    "ELFError",
    "ELFPipeline",
    "ModelConfig",
    "ObjectiveConfig",
    "SamplerConfig",
    "build_model",
    "elf_loss",
    "import_official",
    "load_model",
    "model_preset",
    "sample",
    "sample_draws",
    "sample_generators",
    "save_model",
]
