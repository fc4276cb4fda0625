"""The counter-based Gaussian generator that policies draw from inside a captured step.

A policy keeps ``rng`` int64[2] = (seed, counter) in its arena. Its draws are a pure
function of those two numbers and the draw's size: no generator object, no hidden state,
so a capsule that restores the arena restores the random stream too, and the draw can
run inside a CUDA graph (it is integer arithmetic on tensors, no host round trip).

Algorithm: for ``n`` values, ``2n`` 32-bit
words ``h_i = hash32((seed ^ hash32(counter * 2n + i + 0x9E3779B1)) & 0xFFFFFFFF)``,
turned into uniforms ``u = (h + 0.5) / 2^32`` (float64) and paired by Box-Muller,
``sqrt(-2 ln u_i) * cos(2 pi u_{n+i})``, rounded to float32.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Integer hash of int64 tensors holding 32-bit values (products stay below 2^59)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def counter_normal(rng_state: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Standard normals of ``shape`` (float32, on ``rng_state``'s device) for the
    generator state ``rng_state`` = int64[2] (seed, counter); the state is only read.

    The caller advances the counter (``rng_state[1:].add_(1)``) once per draw it wants to
    be fresh; equal (seed, counter, numel) give equal values on every device.
    """
    n = math.prod(int(d) for d in shape)
    idx = torch.arange(2 * n, device=rng_state.device, dtype=torch.int64)
    h = hash32((rng_state[0] ^ hash32(rng_state[1] * 2 * n + idx + _GOLDEN)) & _MASK32)
    u = (h.to(torch.float64) + 0.5) / 4294967296.0
    u1, u2 = u[:n], u[n:]
    normals = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)
    return normals.to(torch.float32).reshape(tuple(int(d) for d in shape))
