"""Random numbers keyed by (seed, stream position), drawn for a whole batch at once (ELF_SPEC §10).

Every training draw of example p is a pure function of (seed, salt, p, element index), so N
processes, gradient accumulation and a resume see the numbers one process would, whatever the
batching. The generator is counter-based: SplitMix64's output function applied to
``key + counter * golden`` (the SplitMix64 stream of seed ``key`` read at position ``counter``),
vectorised over int64 tensors with wrapping products and logical shifts. One call draws a micro-
batch's noise on its device in a fixed, small number of ops (no per-example generators, no host
work proportional to the batch). :func:`host_uniform` and :func:`host_normal` are the same
generator in numpy for per-example scalars, which the host must know without reading the device
(which rows take the decoder branch, which self-condition).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from torch import Tensor

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_U24 = 1.0 / (1 << 24)


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


@torch.compiler.assume_constant_result  # a compiled step calls it at trace time, once
def stream_key(seed: int, salt: str) -> int:
    """The 64-bit key of the stream ``salt`` of run ``seed`` (as a signed int64)."""
    digest = hashlib.blake2b(f"elflow:{seed}:{salt}".encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: Tensor) -> Tensor:
    """SplitMix64's output function on int64 tensors (products wrap modulo 2^64)."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def keyed_bits(positions: Tensor, width: int, key: int) -> Tensor:
    """(B, width) int64 random bits: element j of row b is stream ``key`` at counter
    ``positions[b] * width + j``."""
    counters = positions[:, None] * width + torch.arange(width, device=positions.device)
    return _mix(counters * _signed(_GOLDEN) + key)


def _unit(bits: Tensor) -> Tensor:
    """24 random bits -> float32 in (0, 1), never 0 or 1."""
    return (bits & 0xFFFFFF).float().mul_(_U24).add_(0.5 * _U24)


def keyed_normals(positions: Tensor, width: int, seed: int, salt: str) -> Tensor:
    """(B, width) float32 standard normals for the stream positions ``positions`` (B,) int64:
    Box–Muller on the two 24-bit uniforms of one 64-bit draw gives two normals (the cosine one in
    the first half of a row, the sine one in the second); tails beyond 5.9 standard deviations
    are cut."""
    half = (width + 1) // 2
    bits = keyed_bits(positions, half, stream_key(seed, salt))
    radius = _unit(_shr(bits, 40)).log_().mul_(-2.0).sqrt_()
    angle = _unit(_shr(bits, 16)).mul_(2.0 * math.pi)
    out = torch.cat([radius * torch.cos(angle), radius.mul_(torch.sin(angle))], dim=1)
    return out[:, :width]


def host_uniform(positions: np.ndarray, seed: int, salt: str) -> np.ndarray:
    """A float64 in (0, 1) per stream position: the same generator as :func:`keyed_bits` (one
    element per position), in numpy on the host."""
    key = stream_key(seed, salt)
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = pos * np.uint64(_GOLDEN) + np.uint64(key % (1 << 64))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def host_normal(positions: np.ndarray, seed: int, salt: str) -> np.ndarray:
    """A float64 standard normal per stream position (Box–Muller on two keyed uniforms)."""
    u1 = host_uniform(positions, seed, f"{salt}/radius")
    u2 = host_uniform(positions, seed, f"{salt}/angle")
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)
