"""The factory ``capsule-ros export`` calls to get the module it traces:

    capsule-ros export --module capsule_gru_policy.export:module --set hidden=64 --out gru.pt2

Its keyword arguments are the ``policy.gru_chunk`` settings plus ``inputs`` (the node's
ports, ``name:dims[:dtype]`` separated by commas, dims joined by ``x``), ``seed`` (the
same as ``policy.init_seed``) and ``weights`` (a safetensors file, as ``policy.weights``),
so the exported program computes what ``policy.kind: gru_chunk`` serves with the same
settings.
"""
from __future__ import annotations

from typing import List

from capsule_ros.runtime.arena import BufferKind, BufferSpec, dtype_from_name
from capsule_ros.runtime.weights import load_weights

from .model import GruChunkConfig, GruChunkModule
from .policy import seeded_module


def parse_inputs(text: str) -> List[BufferSpec]:
    """'joints:4,goal:2,camera:64x64x3:uint8' -> input buffer specs (dtype float32 unless given)."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, shape, *dtype = item.split(":")
        try:
            dims = tuple(int(d) for d in shape.split("x"))
        except ValueError:
            raise ValueError(f"inputs: {item!r} must be name:dims[:dtype], e.g. joints:4 or camera:64x64x3:uint8") \
                from None
        specs.append(BufferSpec(name, dims, dtype_from_name(dtype[0] if dtype else "float32"), BufferKind.INPUT))
    return specs


def module(hidden: int = 64, layers: int = 1, action_dim: int = 2, chunk_horizon: int = 8,
           action_scale: float = 1.0, action_noise_std: float = 0.0, inputs: str = "joints:4,goal:2",
           seed: int = 0, weights: str = "") -> GruChunkModule:
    """The GRU chunk module for export (see the module docstring)."""
    cfg = GruChunkConfig(hidden=hidden, layers=layers, action_dim=action_dim, chunk_horizon=chunk_horizon,
                         action_scale=float(action_scale), action_noise_std=float(action_noise_std))
    result = seeded_module(cfg, parse_inputs(inputs), seed)
    if weights:
        load_weights(result, weights)
    return result
