"""Sampling (paper §3.3; ELF_SPEC §5): one sampler registry, the steps, the loop from noise to
tokens, projection, and the infilling and likelihood maths.

Names load on first use from the module that defines them.
"""

from elflow.runtime.lazy_exports import lazy_exports

_LOOP = (
    "Denoiser Decoder Condition ode_step sde_step heun_step pc_step sample_seed Seeds seed_of "
    "seeds_of sample_generators SampleOutput StepContext sampler_step noise_draws advance "
    "step_function StepRunner StepState StepCallback sample"
).split()
_EXPORTS = {name: "elflow.sampling.sample_loop" for name in _LOOP}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
