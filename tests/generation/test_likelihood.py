"""Likelihood: the change of variables along the probability-flow ODE against an exact density,
Hutchinson's estimate against the exact trace, and the per-text bound on tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch

from elflow import ELFPipeline
from elflow.__main__ import main
from elflow.config import elf_tiny
from elflow.errors import ELFError
from elflow.flow import velocity
from elflow.model import build_model
from elflow.sampling.likelihood_maths import (
    gaussian_log_density,
    nll_bound,
    ode_log_density,
    rademacher,
    velocity_and_divergence,
)
from tests.builders import make_infill_model

MU, SD, S = 0.7, 0.5, 2.0


def gaussian_flow(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The exact marginal velocity of z_t = t x + (1 - t) s eps for x ~ N(MU, SD^2 I)."""
    a = t.reshape(-1, *([1] * (z.dim() - 1)))
    b = (1 - a) * S
    var = a**2 * SD**2 + b**2
    return MU + (a * SD**2 - S * b) / var * (z - a * MU)


@pytest.mark.parametrize("t1", [0.5, 0.95, 0.999])
def test_the_ode_gives_the_exact_density_of_gaussian_data(t1):
    x = MU + SD * torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(0))
    z = t1 * x  # any point; its density under the path's marginal at t1 is known
    log_p, z0 = ode_log_density(gaussian_flow, z, t1, 32, S)
    exact = gaussian_log_density(z, t1 * MU, math.sqrt(t1**2 * SD**2 + ((1 - t1) * S) ** 2))
    assert ((log_p - exact).abs() / exact.abs()).max() < 0.01  # the bar: within 1%
    assert (log_p - exact).abs().max() < 1e-3  # in fact far closer
    assert z0.shape == z.shape


@pytest.mark.slow
def test_hutchinson_estimates_the_exact_trace_of_a_network():
    torch.manual_seed(0)
    net = build_model(elf_tiny(encoder_dim=4, vocab_size=10, max_length=4, self_condition=False))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))

    def v(z, t):
        return velocity(net(z, t, 2.0, 0.0)[0].float(), z, t, 0.05)

    z = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.3, 0.7])
    out, exact = velocity_and_divergence(v, z, t, None)
    torch.testing.assert_close(out, v(z, t).detach())
    probes = rademacher((2000, 2, 4, 4), torch.Generator().manual_seed(2))
    _, estimate = velocity_and_divergence(v, z, t, probes)
    assert (estimate - exact).abs().max() < 0.05 * exact.abs().max()
    # The dominant term of an x-prediction's divergence: -D / (1 - t) when x_hat ignores z.
    _, flat = velocity_and_divergence(
        lambda z, t: velocity(torch.zeros_like(z), z, t, 0.05), z, t, None
    )
    torch.testing.assert_close(flat, -16 / (1 - t.double()))


def test_the_bound_is_the_elbo_in_bits_per_token():
    noise = torch.zeros(1, 2, 2)
    log_q = -4 * math.log(0.1) - 2 * math.log(2 * math.pi)  # N(0; 0, 1) - D log sigma
    bits = nll_bound(
        torch.tensor([-3.0], dtype=torch.float64),
        torch.tensor([-1.0]),
        noise,
        0.1,
        torch.tensor([2]),
    )
    assert bits.item() == pytest.approx((3.0 + 1.0 + log_q) / (2 * math.log(2)))


def test_text_likelihood_is_deterministic_and_batch_invariant(tmp_path):
    from elflow.generation.likelihood import text_likelihood

    pipe = ELFPipeline.from_pretrained(make_infill_model(tmp_path))
    texts = ["the lord said", "god made the earth and the light", "amen"]
    a = text_likelihood(pipe, texts, steps=2, probes=1, seed=3)
    b = text_likelihood(pipe, texts, steps=2, probes=1, seed=3, batch_size=1)
    assert a.bits_per_token == pytest.approx(b.bits_per_token, rel=1e-4)
    assert a.tokens == [5, 9, 4]  # [CLS] ... [SEP]: "amen" is two pieces
    assert all(math.isfinite(x) and x > 0 for x in a.bits_per_token)
    exact = text_likelihood(pipe, texts[:1], steps=2, probes=0)
    assert math.isfinite(exact.bits_per_token[0])
    with pytest.raises(ELFError, match="steps= must be >= 1"):
        text_likelihood(pipe, texts, steps=0)


def test_cli_likelihood(tmp_path, capsys):
    model = make_infill_model(tmp_path)
    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b c", "the lord", "x"]))
    out = tmp_path / "l.json"
    argv = [
        "likelihood",
        "--model",
        model,
        "--texts",
        str(texts),
        "--steps",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert "bits per token (95% CI [" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert len(record["per_text"]) == 3 and record["probes"] == 1
    assert record["t1"] == 0.1  # the default: near t1 = 1 the bound is far looser
    assert main([*argv[:-2], "--shuffle-words", "-n", "2"]) == 0
    assert main(["likelihood", "--model", model, "--texts", str(tmp_path / "none.jsonl")]) == 2


def test_a_text_longer_than_the_model_is_refused_unless_truncated(tmp_path, capsys):
    from elflow.generation.likelihood import text_likelihood

    model = make_infill_model(tmp_path)
    pipe = ELFPipeline.from_pretrained(model)
    L = pipe.config.model.max_length
    long = " ".join(["light"] * (L + 5))
    with pytest.raises(ELFError, match=rf"text 1 is {L + 7} tokens, more than the model's {L} "):
        text_likelihood(pipe, ["amen", long], steps=1)
    cut = text_likelihood(pipe, ["amen", long], steps=1, truncate=True)
    assert cut.tokens[1] == L and cut.settings["truncated"] == 1
    texts = tmp_path / "t.jsonl"
    texts.write_text(json.dumps({"text": long}) + "\n")
    argv = ["likelihood", "--model", model, "--texts", str(texts), "--steps", "1"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --truncate to score their first tokens" in err
    assert main([*argv, "--truncate"]) == 0
