"""Graph-captured sampling (elflow.generation.cuda_graphs): on a CPU, the runners' static buffers
without capture give the eager path's samples bitwise, the cache buckets and bounds, and no step
reads the device; on a GPU, replayed graphs give the eager texts and replay without recapture."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from elflow import ELFError, ELFPipeline
from elflow.config import SamplerConfig, elf_tiny
from elflow.generation import cuda_graphs as cg
from elflow.model import build_model
from elflow.runtime.profiling import OpCounter
from elflow.sampling import Condition, sample_generators
from elflow.sampling.denoiser import sample_model

E, V, L = 8, 20, 6
SAMPLERS = ["ode", "sde", "heun", "pc"]


def _model():
    torch.manual_seed(0)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=12)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a fresh flow head predicts 0; give it something to say
        lin = model.final_layer.linear
        lin.weight.copy_(0.3 * torch.randn(lin.weight.shape, generator=g))
        lin.bias.copy_(0.3 * torch.randn(lin.bias.shape, generator=g))
    return model


@pytest.fixture
def buffers(monkeypatch):
    """Sampling through the graph runners' static buffers, without capture (any device)."""
    real = cg.graph_mode

    def mode(flag, device):
        real(flag, device)  # its checks still apply
        return None if flag is False else "buffers"

    monkeypatch.setattr(cg, "graph_mode", mode)


def _cond(b: int) -> Condition:
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(L)[None] < torch.tensor([2, 3, 1, 2][:b])[:, None]).long()
    return Condition(torch.randn(b, L, E, generator=g), mask, guided=mask.clone())


# --- the buffer logic gives the eager samples -------------------------------------------------


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("cfg", [1.0, 2.5])
def test_buffers_give_the_eager_samples_bitwise(buffers, name, cfg):
    model = _model()
    sampler = SamplerConfig(sampler=name, steps=5, cfg=cfg)
    cond = _cond(3) if cfg != 1.0 else None
    eager = sample_model(
        model, sample_generators(0, range(3)), L, sampler, cond=cond, cuda_graphs=False
    )
    graphed = sample_model(model, sample_generators(0, range(3)), L, sampler, cond=cond)
    assert torch.equal(eager.tokens, graphed.tokens)
    assert torch.equal(eager.z, graphed.z)
    cache = cg.graph_cache(model)
    assert len(cache) == 1 and cache.built == 1
    (bucket,) = cache.buckets.values()
    assert bucket.captures == 2  # the sampler's step and the last Euler step
    assert bucket.runners[False].replays == 4 and bucket.runners[True].replays == 1


def test_a_second_condition_in_the_same_bucket_is_loaded_not_baked_in(buffers):
    model = _model()
    sampler = SamplerConfig(sampler="sde", steps=4, cfg=2.0)
    first, second = _cond(2), Condition(*(x.flip(0) for x in vars(_cond(2)).values()))
    for cond in (first, second):
        eager = sample_model(
            model, sample_generators(1, range(2)), L, sampler, cond=cond, cuda_graphs=False
        )
        graphed = sample_model(model, sample_generators(1, range(2)), L, sampler, cond=cond)
        assert torch.equal(eager.z, graphed.z)
    assert cg.graph_cache(model).built == 1


def test_trajectory_and_callback_get_copies_that_outlive_the_next_step(buffers):
    model = _model()
    sampler = SamplerConfig(sampler="sde", steps=4)
    runs = {}
    for flag in (False, None):
        states = []
        out = sample_model(
            model,
            sample_generators(0, range(2)),
            L,
            sampler,
            trajectory=True,
            callback_on_step_end=states.append,
            cuda_graphs=flag,
        )
        runs[flag] = out, states
    (eager, e_states), (graphed, g_states) = runs[False], runs[None]
    assert torch.equal(eager.trajectory, graphed.trajectory)
    for a, b in zip(e_states, g_states, strict=True):
        assert torch.equal(a.z, b.z) and torch.equal(a.x_hat, b.x_hat), a.step
    assert not torch.equal(g_states[0].z, g_states[1].z)


def test_pipeline_conditional_and_infilling_equal_eager(buffers, cond_model, infill_model):
    cond_pipe = ELFPipeline.from_pretrained(cond_model)
    sources = ["in the beginning", "and god said", "let there be light"]
    guided = replace(cond_pipe.sampler, cfg=2.0)
    a = cond_pipe(sources=sources, sampler=guided, cuda_graphs=False)
    b = cond_pipe(sources=sources, sampler=guided)
    assert torch.equal(a.tokens, b.tokens) and a.texts == b.texts
    assert cg.graph_cache(cond_pipe.model).built == 1

    pipe = ELFPipeline.from_pretrained(infill_model)
    held = replace(pipe.sampler, refresh_from=1.0)  # kept latents fixed: graphed
    requests = ["In the beginning [___4] the earth.", "[___2] said Moses [___3]"]
    a = pipe.infill(requests, sampler=held, cuda_graphs=False)
    b = pipe.infill(requests, sampler=held)
    assert torch.equal(a.tokens, b.tokens) and a.texts == b.texts
    assert cg.graph_cache(pipe.model).built == 1
    # A refresh (the default) re-encodes the kept text mid-step: eager, no bucket.
    pipe.infill(requests)
    assert cg.graph_cache(pipe.model).built == 1


def test_projected_sampling_runs_eagerly(buffers, infill_model):
    pipe = ELFPipeline.from_pretrained(infill_model)
    projected = replace(pipe.sampler, project_from=0.5)
    a = pipe(2, sampler=projected, cuda_graphs=False)
    b = pipe(2, sampler=projected)
    assert a.texts == b.texts
    assert len(cg.graph_cache(pipe.model)) == 0


# --- the cache ----------------------------------------------------------------------------------


def test_buckets_by_batch_length_and_sampler_bounded_and_dropped_with_new_weights(
    buffers, monkeypatch
):
    model = _model()
    sampler = SamplerConfig(sampler="ode", steps=2)

    def run(batch=2, length=L, s=sampler):
        sample_model(model, sample_generators(0, range(batch)), length, s)

    cache = cg.graph_cache(model)
    run()
    run()
    assert cache.built == 1  # the same bucket replays
    run(batch=3)
    run(length=L + 1)
    run(s=replace(sampler, w=2.0))  # a setting the step closes over
    run(s=replace(sampler, steps=7))  # the number of steps is not part of the step
    assert cache.built == 4 and len(cache) == 4
    cache.size = 2
    run(batch=4)
    assert len(cache) == 2
    assert [k[1] for k in cache.buckets] == [2, 4]  # the most recently used kept (w=2.0, B 4)
    with torch.no_grad():
        model.final_layer.linear.bias.add_(0.1)  # new weights: every captured bucket is stale
    run(batch=4)
    assert len(cache) == 1 and cache.built == 6


def test_a_copied_model_starts_with_an_empty_cache(buffers):
    import copy

    model = _model()
    sample_model(model, sample_generators(0, range(2)), L, SamplerConfig(steps=2))
    assert len(cg.graph_cache(model)) == 1
    assert len(cg.graph_cache(copy.deepcopy(model))) == 0


def test_the_runner_copies_inputs_into_its_buffers_and_checks_their_shapes():
    calls = []

    def fn(a, b):
        calls.append((a.data_ptr(), b.data_ptr()))
        return (a + b,)

    runner = cg.GraphRunner(fn, [torch.zeros(3), torch.zeros(3)], capture=False)
    x = torch.arange(3.0)
    (out,) = runner(x, x)
    assert torch.equal(out, 2 * x)
    assert calls[0] == (runner.inputs[0].data_ptr(), runner.inputs[1].data_ptr())
    assert x.data_ptr() not in calls[0]
    with pytest.raises(ELFError, match="captured with"):
        runner(torch.zeros(4), torch.zeros(4))


def test_the_switch():
    cpu = torch.device("cpu")
    assert cg.graph_mode(None, cpu) is None and cg.graph_mode(False, cpu) is None
    assert cg.graph_mode(None, torch.device("cuda")) == "capture"
    assert cg.graph_mode(False, torch.device("cuda")) is None
    with pytest.raises(ELFError, match="cuda_graphs=True needs a CUDA device") as e:
        sample_model(_model(), sample_generators(0, [0]), L, SamplerConfig(), cuda_graphs=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ELFError, match="True, False or None"):
        cg.graph_mode("yes", cpu)


def test_registered_samplers_and_training_mode_run_eagerly():
    model = _model()
    assert cg.eager_reason(model, SamplerConfig()) is None
    assert "training" in cg.eager_reason(model.train(), SamplerConfig())


# --- no host syncs in the steps -------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, None])
@pytest.mark.parametrize("name", ["sde", "pc"])
def test_steps_read_nothing_from_the_device(buffers, monkeypatch, graphs, name):
    """Syncs (scalar reads, data-dependent shapes, .tolist(), .cpu()) do not grow with the
    steps: a step reads nothing back (a captured step could not)."""
    model = _model()
    cpu_calls = []
    real_cpu = torch.Tensor.cpu

    def counted_cpu(self, *a, **k):
        cpu_calls.append(1)
        return real_cpu(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)

    def syncs(steps: int) -> int:
        sampler = SamplerConfig(sampler=name, steps=steps, cfg=2.0)
        gens = sample_generators(0, range(2))
        sample_model(model, gens, L, sampler, cond=_cond(2), cuda_graphs=graphs)  # capture
        with OpCounter() as c:
            sample_model(model, gens, L, sampler, cond=_cond(2), cuda_graphs=graphs)
        return c.counts.num_syncs + len(cpu_calls)

    assert syncs(3) == syncs(9)


# --- on a GPU ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_pipe(uncond_model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return ELFPipeline.from_pretrained(uncond_model, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", SAMPLERS)
def test_gpu_fp32_graphed_texts_equal_eager(gpu_pipe, name):
    sampler = replace(gpu_pipe.sampler, sampler=name, steps=8)
    eager = gpu_pipe(8, sampler=sampler, seed=3, cuda_graphs=False)
    graphed = gpu_pipe(8, sampler=sampler, seed=3)
    assert graphed.texts == eager.texts
    assert torch.equal(graphed.tokens, eager.tokens)


@pytest.mark.gpu
def test_gpu_bf16_graphed_tokens_nearly_equal_eager(gpu_pipe):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = gpu_pipe(16, seed=5, cuda_graphs=False)
        graphed = gpu_pipe(16, seed=5)
    agree = (eager.tokens == graphed.tokens).float().mean().item()
    assert agree >= 0.99, agree


@pytest.mark.gpu
def test_gpu_second_call_replays_without_sync_or_recapture(gpu_pipe):
    sampler = replace(gpu_pipe.sampler, steps=6)
    cache = cg.graph_cache(gpu_pipe.model)
    first = gpu_pipe(4, sampler=sampler, seed=9)
    built = cache.built
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gens = sample_generators(9, range(4), "cuda")
        out = sample_model(
            gpu_pipe.model,
            gens,
            gpu_pipe.config.sample_length(sampler),
            sampler,
            gpu_pipe.config.noise_scale,
            gpu_pipe.config.t_eps,
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cache.built == built
    assert torch.equal(out.tokens.cpu(), first.tokens)
