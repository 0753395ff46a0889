"""Choosing bf16 only where the CPU computes it in hardware."""

from __future__ import annotations

import pytest
import torch

from elflow.config.run_presets import preset
from elflow.config.train_config import apply_overrides
from elflow.runtime import hardware
from elflow.runtime.hardware import slow_bf16_warning, use_bf16
from elflow.train.optim import resolve_ns_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n", True),
        ("flags\t\t: fpu avx2 amx_bf16 amx_tile\n", True),
        ("flags\t\t: fpu sse avx avx2 fma\nflags\t\t: fpu sse avx avx2 fma\n", False),
        ("Features\t: fp asimd evtstrm aes sve bf16 i8mm\n", True),
        ("Features\t: fp asimd evtstrm aes\n", False),
        ("model name\t: bf16 in a name is not a flag\n", False),
        ("", False),
    ],
)
def test_native_bf16_is_read_from_cpu_flags(cpuinfo, native):
    assert hardware.native_bf16_flags(cpuinfo) is native


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Set the detection's answer through its environment override."""

    def set_native(native: bool) -> None:
        monkeypatch.setenv(hardware.ENV, "1" if native else "0")
        hardware.cpu_has_native_bf16.cache_clear()

    yield set_native
    hardware.cpu_has_native_bf16.cache_clear()


def test_auto_precision_is_bf16_only_on_native_hardware(cpu_bf16):
    cpu_bf16(False)
    assert not use_bf16("auto", CPU) and use_bf16("auto", CUDA)
    assert use_bf16("bf16", CPU) and not use_bf16("fp32", CUDA)
    assert resolve_ns_dtype("auto", CPU) == "float32"
    assert resolve_ns_dtype("bfloat16", CPU) == "bfloat16"
    cpu_bf16(True)
    assert use_bf16("auto", CPU)
    assert resolve_ns_dtype("auto", CPU) == "bfloat16"
    # bf16 on GPUs, where a plain-fp32 Newton-Schulz would run at a fifteenth of the speed
    assert resolve_ns_dtype("auto", CUDA) == "bfloat16"
    cpu_bf16(False)
    assert resolve_ns_dtype("auto", CUDA) == "bfloat16"


def test_cpu_presets_use_auto_and_explicit_bf16_on_emulating_cpu_warns(cpu_bf16):
    cfg = preset("bible-tiny")
    assert (cfg.train.precision, cfg.optim.muon_ns_dtype) == ("auto", "auto")
    cpu_bf16(False)
    assert slow_bf16_warning(cfg.train.precision, cfg.optim.muon_ns_dtype, CPU) is None
    forced = apply_overrides(cfg, sets=["train.precision=bf16", "optim.muon_ns_dtype=bfloat16"])
    warning = slow_bf16_warning(forced.train.precision, forced.optim.muon_ns_dtype, CPU)
    assert warning is not None and "\n" not in warning
    assert "train.precision and optim.muon_ns_dtype set bf16" in warning
    assert "train.precision=auto and optim.muon_ns_dtype=auto" in warning
    assert slow_bf16_warning(forced.train.precision, forced.optim.muon_ns_dtype, CUDA) is None
    cpu_bf16(True)
    assert slow_bf16_warning(forced.train.precision, forced.optim.muon_ns_dtype, CPU) is None


def test_packed_bf16_linear_equals_f_linear(monkeypatch):
    """oneDNN's packed bf16 matmul (bias, and the SwiGLU's SiLU, fused) against plain F.linear."""
    import torch

    from elflow.runtime import hardware

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    x = torch.randn(2, 5, 16, generator=g).to(torch.bfloat16)
    packed = hardware.LowpLinear.of(w, b, torch.bfloat16)
    if not packed.packed:
        pytest.skip("no oneDNN bf16 matmul on this machine")
    monkeypatch.setattr(hardware, "_onednn_packs", lambda weight: False)
    plain = hardware.LowpLinear.of(w, b, torch.bfloat16)
    assert not plain.packed and plain.weight.dtype == torch.bfloat16
    assert torch.equal(packed(x), plain(x))
    torch.testing.assert_close(packed(x, silu=True), plain(x, silu=True), rtol=0.01, atol=0.02)
    other = torch.randn(2, 5, 24, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(packed(x, times=other), plain(x, times=other), rtol=0.01, atol=0.05)
    assert not hardware.LowpLinear.of(w, b, torch.float32).packed  # fp32 stays plain


@pytest.fixture
def fresh_malloc_setting(monkeypatch):
    """keep_freed_memory's once-per-process answer, recomputed for this test and after it."""
    hardware.keep_freed_memory.cache_clear()
    yield
    hardware.keep_freed_memory.cache_clear()


def test_keep_freed_memory_applies_on_glibc_and_opts_out(monkeypatch, fresh_malloc_setting):
    import platform
    import sys

    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert hardware.keep_freed_memory() is glibc  # mallopt accepted both settings
    hardware.keep_freed_memory.cache_clear()
    monkeypatch.setenv(hardware.MALLOC_ENV, "0")
    assert hardware.keep_freed_memory() is False
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv(hardware.MALLOC_ENV, "")
    hardware.keep_freed_memory.cache_clear()
    assert hardware.keep_freed_memory() is False  # only Linux's glibc has these settings


def test_cpu_sampling_keeps_freed_memory(monkeypatch):
    """sample_model sets the allocator up before it samples on a CPU (and only there)."""
    from elflow.config import SamplerConfig, model_preset
    from elflow.model import build_model
    from elflow.sampling import denoiser as wiring
    from elflow.sampling import sample_generators

    calls = []
    monkeypatch.setattr(wiring, "keep_freed_memory", lambda: calls.append(1) or True)
    cfg = model_preset("elf-tiny", encoder_dim=8, vocab_size=11, max_length=6)
    model = build_model(cfg).eval()
    out = wiring.sample_model(
        model, sample_generators(0, range(2), "cpu"), 6, SamplerConfig(steps=2)
    )
    assert calls == [1] and out.tokens.shape == (2, 6)
