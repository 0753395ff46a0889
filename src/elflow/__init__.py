"""elflow: ELF (Embedded Language Flows, arXiv 2605.10938) in PyTorch.

Public entry points: :class:`ELFPipeline` for generation, :func:`load_model` for any model source,
:class:`ELF` the network, :func:`elf_loss` the training objective, :func:`sample` the sampler (over
a denoise function; :func:`sample_model` wires it for a network). Names load on first use, so
``import elflow`` does not import torch.
"""

from elflow.runtime.lazy_exports import lazy_exports

__version__ = "0.3.0"

_EXPORTS = {
    "ELF": "elflow.model",
    "build_model": "elflow.model",
    "ArtifactConfig": "elflow.io.artifact",
    "import_official": "elflow.io.artifact",
    "load_model": "elflow.io.artifact",
    "save_model": "elflow.io.artifact",
    "Batch": "elflow.objective",
    "Draws": "elflow.train.objective_draws",
    "elf_loss": "elflow.objective",
    "sample_draws": "elflow.train.objective_draws",
    "ELFError": "elflow.errors",
    "ELFPipeline": "elflow.generation.pipeline",
    "Generation": "elflow.generation.outputs",
    "StepState": "elflow.sampling",
    "ModelConfig": "elflow.config",
    "ObjectiveConfig": "elflow.config",
    "SamplerConfig": "elflow.config",
    "model_preset": "elflow.config",
    "sample": "elflow.sampling",
    "sample_generators": "elflow.sampling",
    "TrainForward": "elflow.train.forward",
    "make_denoiser": "elflow.sampling.denoiser",
    "sample_model": "elflow.sampling.denoiser",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
