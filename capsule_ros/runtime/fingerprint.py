"""Fingerprints bind a capsule to the exact graph that made it.

fingerprint = SHA-256 over a canonical JSON of:
- the policy's architecture (its config, inputs, dtype),
- the arena layout (every buffer's name, shape, dtype, kind, offset; total bytes),
- a digest of every weight (name, dtype, shape, bytes, in name order),
- the device kind ("cpu", or "cuda:sm_90" by compute capability: a capsule moves between
  GPUs of one kind, not between kinds, whose kernels differ),
- the input binding: what fills each input buffer (for the node, each port's message
  type, fields, joint names and encodings, never its topic). Reordering a port's fields
  changes what the state's history means, so a capsule made before must be refused.

The torch version is deliberately not part of it: a capsule's bytes stay meaningful
across builds, but the bit-identical-replay promise holds for one build (docs say so).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional

import torch
from torch import nn

from capsule_ros.runtime.arena import ArenaLayout

FINGERPRINT_VERSION = 2


def weights_digest(module: nn.Module) -> str:
    """SHA-256 of every parameter and persistent buffer (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def device_kind(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:sm_{major}{minor}"
    return device.type


def compute_fingerprint(architecture: dict, layout: ArenaLayout, weights: str, kind: str,
                        inputs: Optional[Mapping[str, Any]] = None) -> str:
    """The fingerprint (see the module docstring); ``inputs``: input buffer name -> a
    JSON-able description of what fills it."""
    canonical = json.dumps({"version": FINGERPRINT_VERSION, "architecture": architecture,
                            "layout": layout.digest(), "weights": weights, "device_kind": kind,
                            "inputs": dict(inputs or {})},
                           sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
