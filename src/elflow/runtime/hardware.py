"""Which number formats this machine computes fast, to pick training precision on a CPU.

bf16 is a large win on CPUs that multiply it in hardware (x86 AVX-512 BF16 or AMX, Arm's BF16
extension): the CPU presets' steps run about 1.8x faster there. Everywhere else PyTorch emulates
bf16 matrix products, which is ~100x slower than fp32 (a 1024^2 matmul on an AVX2-only AMD EPYC:
0.8 GFLOP/s against 86-90), so bf16 must never be chosen silently there (docs/training.md).
:class:`LowpLinear` is a Linear layer for low-precision inference, pre-packed for the CPU's
matrix unit where oneDNN can (the bf16 inference fast path, ``elflow.runtime.bf16_fast_path``).
:func:`keep_freed_memory` stops glibc from handing every freed activation back to the kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from elflow.errors import ELFError

if TYPE_CHECKING:
    from elflow.config import ModelConfig

_X86_BF16 = {"avx512_bf16", "amx_bf16"}
ENV = "ELFLOW_CPU_BF16"
"""Set to 1 or 0 to override the detection (e.g. a CPU whose flags this module misreads)."""
MALLOC_ENV = "ELFLOW_MALLOC"
"""Set to 0 to leave glibc's allocator settings alone (:func:`keep_freed_memory`)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's ceiling for the setting)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap that the process keeps instead of returning."""


def _cpu_flags(cpuinfo: str) -> set[str]:
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return flags


def native_bf16_flags(cpuinfo: str) -> bool:
    """True when ``/proc/cpuinfo`` text names a bf16 matrix unit (AVX-512 BF16, AMX, Arm BF16)."""
    flags = _cpu_flags(cpuinfo)
    return bool(flags & _X86_BF16) or "bf16" in flags


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (``ELFLOW_CPU_BF16=0/1`` overrides).

    Read from ``/proc/cpuinfo``; where that does not exist (macOS, Windows) the answer is False,
    so ``auto`` settings stay in fp32 unless the variable says otherwise.
    """
    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return native_bf16_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def fast_bf16(device: torch.device) -> bool:
    """bf16 is the fast choice on ``device``: any CUDA device, or a CPU with native bf16."""
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())


def use_bf16(precision: str, device: torch.device) -> bool:
    """``train.precision`` on ``device``: 'auto' is bf16 autocast on CUDA and on CPUs with native
    bf16, fp32 elsewhere."""
    return precision == "bf16" or (precision == "auto" and fast_bf16(device))


def bf16_autocast(bf16: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device`` when ``bf16`` (training, sampling), else a no-op context."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


GPU_BF16_TFLOPS = {
    # Dense bf16 tensor-core peaks from the vendors' datasheets (no sparsity), matched against
    # torch.cuda.get_device_name in order: the first key found in the name wins.
    "GB200": 2500.0,
    "B200": 2250.0,
    "B100": 1750.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "A6000": 155.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}
"""Dense bf16 TFLOP/s per GPU by model name (MFU's denominator; ``train.peak_tflops`` overrides)."""


def peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` from :data:`GPU_BF16_TFLOPS`, or None (a CPU, or a
    GPU the table does not know: set ``train.peak_tflops``)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in GPU_BF16_TFLOPS.items() if k in name), None)


def memory_bytes(device: torch.device | str) -> int | None:
    """The memory of ``device`` in bytes (a GPU's, or the host's RAM for the CPU), or None when
    it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX system
            return None
    return None


def check_fits(
    cfg: ModelConfig, device: torch.device | str, bytes_per_parameter: float, purpose: str
) -> None:
    """A one-line error, before anything is allocated, when ``cfg``'s network needs more than
    ``device`` has: ``bytes_per_parameter`` times its parameter count (4: fp32 weights)."""
    n = cfg.num_parameters
    need, have = n * bytes_per_parameter, memory_bytes(device)
    if have is not None and need > have:
        raise ELFError(
            f"the model config (hidden_size {cfg.hidden_size}, depth {cfg.depth}, vocab_size "
            f"{cfg.vocab_size}, encoder_dim {cfg.encoder_dim}) gives a network of {n:.3g} "
            f"parameters, which needs about {need / 1e9:.3g} GB {purpose}, more than the "
            f"{have / 1e9:.3g} GB of {torch.device(device).type}; check the config's model "
            "section"
        )


def full_precision(device: torch.device) -> torch.autocast:
    """Autocast off inside a caller's bf16 autocast: what spec §3 keeps in the parameters' dtype
    (fp32) runs there (the network's projections, embedders and heads; the frozen encoder)."""
    return torch.autocast(device.type, enabled=False)


def _onednn_packs(weight: Tensor) -> bool:
    """Whether oneDNN can pre-pack ``weight`` for :class:`LowpLinear` (bf16 on a CPU)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")):
        return False
    return hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported()


class LowpLinear(NamedTuple):
    """A Linear layer in a low-precision dtype for inference. On a CPU with oneDNN the weight is
    packed once into its matmul layout and the bias (and a SiLU) run inside the matmul.

    NOTE: the packed path uses ``torch.ops.mkldnn`` (the ops torch.compile emits for frozen CPU
    linears); where they are missing, plain ``F.linear`` does the same sums.
    """

    weight: Tensor
    bias: Tensor
    packed: bool

    @classmethod
    def of(cls, weight: Tensor, bias: Tensor, dtype: torch.dtype) -> LowpLinear:
        weight, bias = weight.detach().to(dtype), bias.detach().to(dtype)
        if _onednn_packs(weight):
            return cls(torch.ops.mkldnn._reorder_linear_weight(weight), bias, True)
        return cls(weight, bias, False)

    def __call__(self, x: Tensor, silu: bool = False, times: Tensor | None = None) -> Tensor:
        """``x W^T + b``, then SiLU (``silu``) or a product with ``times`` (its shape)."""
        if self.packed:
            ops = torch.ops.mkldnn
            if times is not None:
                return ops._linear_pointwise.binary(x, times, self.weight, self.bias, "mul")
            attr = "swish" if silu else "none"
            return ops._linear_pointwise(x, self.weight, self.bias, attr, [], "")
        y = F.linear(x, self.weight, self.bias)
        if times is not None:
            return y.mul_(times)
        return F.silu(y, inplace=True) if silu else y


@functools.cache
def keep_freed_memory() -> bool:
    """Let freed tensors' memory be reused instead of going back to the kernel at every free.

    glibc serves blocks over a (dynamic, initially 128 KiB) threshold with fresh mmaps and gives
    heap tops back past a trim threshold, so each network call's activations fault their pages in
    anew: at ELF-B, B 8, L 128 that is ~19% of a bf16 sampling run's time and ~9% of an fp32
    one's (docs/sampling.md). This serves blocks up to 32 MiB from the heap and keeps up to 1 GiB of
    freed heap, once per process (``mallopt``; what jemalloc/tcmalloc do by default). Returns
    whether it applied: Linux with glibc, unless ``ELFLOW_MALLOC=0``.

    NOTE: process-wide and not undone; the process's memory stays at its high-water mark.
    """
    if os.environ.get(MALLOC_ENV, "").strip() == "0":
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mmap threshold first: setting either fixes both (no more dynamic adjustment).
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def slow_bf16_warning(precision: str, ns_dtype: str, device: torch.device) -> str | None:
    """A one-line warning when bf16 was asked for explicitly on a CPU that emulates it."""
    if device.type != "cpu" or cpu_has_native_bf16():
        return None
    asked = [
        name
        for name, value in (
            ("train.precision", precision),
            ("optim.muon_ns_dtype", ns_dtype),
        )
        if value in ("bf16", "bfloat16")
    ]
    if not asked:
        return None
    return (
        f"elflow train: warning: {' and '.join(asked)} set bf16, which this CPU emulates "
        "(no AVX-512 BF16/AMX/Arm BF16): steps run several times slower than fp32; set "
        f"{'=auto and '.join(asked)}=auto to use fp32 here"
    )
