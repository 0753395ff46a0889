"""Configuration schemas (ELF_SPEC §1–§5, §9): the model, objective and sampler configs with their
presets and (de)serialisation, the sampler registry's names, and the run and data configs of
training.

Names load on first use from the module that defines them, so ``import elflow.config`` imports
no torch.
"""

from elflow.runtime.lazy_exports import lazy_exports

_MODULES = {
    "elflow.config.model_config": "T5_SMALL ModelConfig PAPER_TASKS elf_b elf_m elf_l elf_small "
    "elf_tiny MODEL_PRESETS model_preset",
    "elflow.config.objective_config": "ObjectiveConfig",
    "elflow.config.sampler_config": "MAX_STEPS SamplerConfig LENGTH_RANGE check_task "
    "check_guidance length_bounds fewstep_sampler change_sampler TIME_GRIDS GAMMA_SCHEDULES "
    "CHOICES",
    "elflow.sampling.registry": "SamplerSpec SAMPLERS register_sampler unregister_sampler "
    "sampler_own_settings unused_settings",
    "elflow.config.serialise": "to_dict from_dict coerce_field field_docs",
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names.split()}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
