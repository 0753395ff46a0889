"""Sampling (paper §3.3; ELF_SPEC §5): one sampler registry, the samplers (one module each), the
loop from noise to tokens, projection, and the infilling and likelihood maths.

Names load on first use from the module that defines them.
"""

from elflow.runtime.lazy_exports import lazy_exports

_MODULES = {
    "elflow.sampling.step_context": "Denoiser Decoder Condition StepContext",
    "elflow.sampling.registry": "SamplerSpec SAMPLERS register_sampler unregister_sampler "
    "sampler_own_settings unused_settings sampler_step noise_draws",
    "elflow.sampling.samplers.ode": "ode_step",
    "elflow.sampling.samplers.sde": "sde_step",
    "elflow.sampling.samplers.heun": "heun_step",
    "elflow.sampling.samplers.pc": "pc_step",
    "elflow.sampling.samplers.renoise": "renoise_step",
    "elflow.sampling.sample_loop": "sample_seed Seeds seed_of seeds_of sample_generators "
    "SampleOutput advance step_function StepRunner StepState StepCallback sample",
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names.split()}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
