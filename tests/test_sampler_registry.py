"""The sampler registry (elflow.sampling.registry): a built-in sampler is one file of
elflow.sampling.samplers, found by listing the folder, and nothing else names the samplers."""

import ast
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from elflow.config import SAMPLERS, SamplerConfig, SamplerSpec, change_sampler, register_sampler
from elflow.errors import ELFError
from elflow.sampling import sample, sample_generators, unregister_sampler
from elflow.sampling.registry import BUILTIN_PACKAGE, noise_draws, sampler_step

SRC = Path(__file__).resolve().parents[1] / "src" / "elflow"
SAMPLER_DIR = SRC / "sampling" / "samplers"

TOY = '''
"""A toy built-in sampler: Euler steps that draw one noise they do not use."""

from elflow.sampling.registry import SamplerSpec

RANK = 2.5
"""Between Heun and pc."""


def _step(denoise, z, x_prev, t, t_next, ctx):
    from elflow.flow import euler_step

    ctx.noise()
    x_hat, v = denoise(z, x_prev, t)
    return euler_step(z, v, t, t_next), x_hat


SPEC = SamplerSpec("toy", "Toy", "Euler steps", settings=("pc_snr",), step=_step, noise_draws=1)
'''


def _literals(node: ast.AST) -> list[str]:
    """The string literals directly in a tuple, list or set display, or a dict display's keys."""
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    return [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def test_a_built_in_sampler_is_one_file_and_nothing_lists_the_samplers():
    """A new built-in sampler touches one file (its own): every built-in is the module of its
    name, and no tuple, list, set or dict outside the samplers folder names two of them (a
    hand-kept list of samplers, which a new one would have to join)."""
    names = set(SAMPLERS.builtin)
    assert names == {p.stem for p in SAMPLER_DIR.glob("[!_]*.py")}
    for name in names:
        assert SAMPLERS[name].name == name and SAMPLERS[name].step is not None
        assert isinstance(SAMPLERS[name].noise_draws, int), name  # CUDA graphs can run it
    lists = []
    for path in SRC.rglob("*.py"):
        if path.parent == SAMPLER_DIR:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = set(_literals(node)) & names
            if len(named) > 1:
                lists.append((str(path.relative_to(SRC)), node.lineno, sorted(named)))
    assert lists == []


def test_names_and_membership_need_no_step_maths():
    code = (
        "import sys; from elflow.config import SAMPLERS, SamplerConfig; "
        "print(list(SAMPLERS)); SamplerConfig(sampler='heun'); "
        "print('torch' in sys.modules)"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=SRC.parent
    ).stdout.split("\n")
    assert out[0] == "['ode', 'sde', 'heun', 'pc', 'renoise']" and out[1] == "False"


@pytest.fixture
def toy_file(tmp_path, monkeypatch):
    """A built-in sampler added as one file in the samplers folder (here a second folder on its
    package's path, so the source tree stays as it is)."""
    import elflow.sampling.samplers as package

    (tmp_path / "toy.py").write_text(textwrap.dedent(TOY))
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    monkeypatch.setattr(SAMPLERS, "_builtin", None)
    monkeypatch.setattr(SAMPLERS, "_loaded", {})
    yield
    sys.modules.pop(f"{BUILTIN_PACKAGE}.toy", None)


def _denoise(z, x_prev, t):
    x_hat = torch.ones_like(z)
    t3 = torch.as_tensor(t, dtype=z.dtype).reshape(-1, 1, 1)
    return x_hat, (x_hat - z) / (1 - t3).clamp_min(0.05)


def test_a_sampler_file_dropped_in_the_folder_is_a_sampler_everywhere(toy_file):
    assert tuple(SAMPLERS) == ("ode", "sde", "heun", "toy", "pc", "renoise")
    cfg = SamplerConfig(sampler="toy", steps=3, time_grid="uniform")
    assert cfg.nfe == 3 and noise_draws("toy") == 1 and sampler_step("toy") is SAMPLERS["toy"].step
    with pytest.raises(ELFError, match="built-in"):
        unregister_sampler("toy")
    gens = sample_generators(0, [0, 1])
    out = sample(_denoise, lambda z: z[..., 0].long(), gens, (4, 2), cfg)
    assert torch.allclose(out.z, torch.ones_like(out.z), atol=1e-5)  # Euler lands on x_hat
    ode = sample(_denoise, lambda z: z[..., 0].long(), gens, (4, 2), change_sampler(cfg, {}))
    assert out.z.shape == ode.z.shape == (2, 4, 2)


def test_a_registered_sampler_samples_and_then_leaves():
    steps = []

    def step(denoise, z, x_prev, t, t_next, ctx):
        steps.append(float(t[0]))
        return sampler_step("ode")(denoise, z, x_prev, t, t_next, ctx)

    register_sampler(SamplerSpec("counted", "Counted", "Euler steps, counted", step=step))
    try:
        with pytest.raises(ELFError, match="already registered"):
            register_sampler(SamplerSpec("counted", "Counted", "again", step=step))
        cfg = SamplerConfig(sampler="counted", steps=4, time_grid="uniform")
        assert list(SAMPLERS)[-1] == "counted" and noise_draws("counted") is None
        sample(_denoise, lambda z: z[..., 0].long(), sample_generators(0, [0]), (3, 2), cfg)
        assert steps == [0.0, 0.25, 0.5]  # the last step is Euler, not the sampler's
    finally:
        unregister_sampler("counted")
    assert "counted" not in SAMPLERS
    with pytest.raises(ELFError, match=r"sampler\.sampler must be one of ode, sde"):
        SamplerConfig(sampler="counted")


def test_change_sampler_is_the_one_check_of_a_change():
    ode_model = SamplerConfig(sampler="ode", gamma=0.0)
    with pytest.raises(ELFError, match=r"default gamma 0 is the ODE; give sampler\.gamma"):
        change_sampler(ode_model, {"sampler": "sde"})
    assert change_sampler(ode_model, {"sampler": "sde", "gamma": 1.0}).gamma == 1.0
    assert change_sampler(ode_model, {"steps": 4}).sampler == "ode"
    with pytest.raises(ELFError, match="unknown sampler setting"):
        change_sampler(ode_model, {"gama": 1.0})
    with pytest.raises(ELFError, match="must be one of"):
        change_sampler(ode_model, {"sampler": "euler"})
