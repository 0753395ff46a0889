"""Sampling under bf16 autocast runs the network on cached bf16 weights
(elflow.runtime.bf16_fast_path) and stays as close to fp32 as per-op autocast
(``ELFLOW_FAST_BF16=0``) does; fp32 sampling does not touch that path."""

import pytest
import torch

from elflow.config import SamplerConfig
from elflow.model import ELF
from elflow.runtime import bf16_fast_path as fastpath
from elflow.sampling import sample_generators
from elflow.sampling.denoiser import sample_model
from tests.builders import varied_network

E, V, L = 8, 20, 6


def _model() -> ELF:
    return varied_network(0, 0.3, E, V, 12)


def _sample(model: ELF, sampler: str, bf16: bool, cached: bool = True):
    cfg = SamplerConfig(steps=8, sampler=sampler, gamma=1.5 if sampler == "sde" else 0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fastpath.ENV, "1" if cached else "0")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return sample_model(model, sample_generators(0, range(3)), L, cfg)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("sampler", ["ode", "sde", "heun", "pc"])
def test_bf16_sampling_uses_cached_weights_and_stays_near_fp32(sampler):
    model = _model()
    ref = _sample(model, sampler, bf16=False)
    assert model not in fastpath._CACHE  # fp32 sampling never builds the bf16 copy
    per_op = _sample(model, sampler, bf16=True, cached=False)
    assert model not in fastpath._CACHE  # nor does the switch off
    cached = _sample(model, sampler, bf16=True)
    assert model in fastpath._CACHE
    assert cached.z.dtype == torch.float32 and cached.tokens.shape == (3, L)
    assert _rel(cached.z, ref.z) < max(2 * _rel(per_op.z, ref.z), 0.02)


def test_fp32_sampling_is_deterministic_after_bf16_sampling():
    """The bf16 copy and the cached rotations leave fp32 sampling bit for bit as it was."""
    model = _model()
    before = _sample(model, "sde", bf16=False)
    _sample(model, "sde", bf16=True)
    after = _sample(model, "sde", bf16=False)
    assert torch.equal(before.z, after.z) and torch.equal(before.tokens, after.tokens)
