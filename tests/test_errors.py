"""Bad input gives one-line ELFErrors that name the problem."""

from __future__ import annotations

import pytest
import torch

from elflow import Batch, ELFError, ObjectiveConfig, SamplerConfig, build_model, elf_loss
from elflow.config import elf_tiny
from elflow.sampling import Condition, sample_generators
from elflow.sampling.denoiser import sample_model
from elflow.train.forward import TrainForward
from elflow.train.objective_draws import sample_draws

CFG = elf_tiny(encoder_dim=8, vocab_size=20, max_length=8)


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_non_finite_latents_in_training_batch():
    model = build_model(CFG)
    x = torch.randn(2, 8, 8)
    x[1, 3, 0] = float("nan")
    batch = Batch(
        x=x, input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(2, 8)
    )
    draws = sample_draws(2, 8, 8, ObjectiveConfig(), torch.Generator().manual_seed(0))
    with pytest.raises(ELFError, match="NaN or inf") as e:
        elf_loss(TrainForward(model), batch, draws, ObjectiveConfig())
    assert "latents" in _one_line(e)


def test_non_finite_condition_in_sampling():
    model = build_model(CFG).eval()
    latents = torch.zeros(1, 8, 8)
    latents[0, 0, 0] = float("inf")
    mask = torch.zeros(1, 8)
    mask[0, :2] = 1
    with pytest.raises(ELFError, match="condition latents"):
        sample_model(
            model,
            sample_generators(0, [0]),
            8,
            SamplerConfig(steps=2),
            cond=Condition(latents, mask),
        )


def test_sequence_longer_than_max_length():
    model = build_model(CFG)
    with pytest.raises(ELFError, match="exceeds the model's max_length 8") as e:
        model(torch.randn(1, 9, 16), 0.5, 1.0)
    _one_line(e)


def test_unknown_procedure():
    model = build_model(CFG)
    batch = Batch(torch.randn(1, 4, 8), torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4))
    draws = sample_draws(1, 4, 8, ObjectiveConfig())
    with pytest.raises(ELFError, match="procedure"):
        elf_loss(TrainForward(model), batch, draws, ObjectiveConfig(), procedure="fast")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"decoder_prob": 1.5}, r"decoder_prob must be in \[0, 1\]"),
        ({"label_drop_prob": -0.1}, "label_drop_prob"),
        ({"t_eps": 0.0}, "t_eps"),
        ({"w_min": 3.0, "w_max": 1.0}, "w_min"),
    ],
)
def test_objective_config_validation(kwargs, match):
    with pytest.raises(ELFError, match=match):
        ObjectiveConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 0}, "steps"),
        ({"sampler": "euler"}, "sampler"),
        ({"gamma": -1.0}, "gamma"),
        ({"time_grid": "cosine"}, "time_grid"),
        ({"w": -2.0}, r"sampler\.w"),
    ],
)
def test_sampler_config_validation(kwargs, match):
    with pytest.raises(ELFError, match=match):
        SamplerConfig(**kwargs)
