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

Beside the fingerprint, ``FingerprintParts`` keeps one digest per component (capsule
headers carry them from format version 2 on), so that ``capsule-ros check`` can say *why*
a model update invalidates a capsule: weights, architecture, state layout, port mapping,
kernel or build. The fingerprint's own formula is unchanged by them: capsules and bags made
before still verify. This module imports torch only where a weight digest or a device kind
is computed, so the capsule file format (which validates the parts) stays torch-free.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple, Type

from capsule_ros.errors import CapsuleRosError, CorruptCapsule

if TYPE_CHECKING:
    import torch
    from torch import nn

    from capsule_ros.runtime.arena import ArenaLayout

FINGERPRINT_VERSION = 2
# Keys of a policy's architecture that name the kernels that run it rather than the model
# (an ONNX policy's runtime version and execution provider; the versions of the libraries
# whose modules and tokenizers a VLA runs): they count as "kernel".
# A fleet's batch shape counts as kernel too: the slot count S, the batching and the batch
# a chunking fleet's plans run at change the bits a batched step computes
# (``capsule_ros.runtime.fleet``, ``capsule_ros.chunking.fleet``).
KERNEL_KEYS = ("onnxruntime", "execution_provider", "optimization", "intra_op_threads", "cuda_graph", "transformers",
               "tokenizers", "fleet_slots", "fleet_batching", "fleet_plan_batch")
# Why a capsule is invalid, by component (``FingerprintParts.causes``), in report order.
CAUSES = {"weights": "weights", "architecture": "architecture", "layout": "state layout",
          "ports": "port mapping", "kernel": "kernel", "build": "build"}
MAX_KERNEL_CHARS = 256


def weights_digest(module: nn.Module) -> str:
    """SHA-256 of every parameter and persistent buffer (name, dtype, shape, bytes)."""
    import torch
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())     # the tensor's own bytes: no copy
    return h.hexdigest()


def device_kind(device: torch.device) -> str:
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:sm_{major}{minor}"
    return device.type


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def _sha256(obj: Any) -> str:
    return hashlib.sha256(_canonical(obj).encode()).hexdigest()


def compute_fingerprint(architecture: dict, layout: ArenaLayout, weights: str, kind: str,
                        inputs: Optional[Mapping[str, Any]] = None) -> str:
    """The fingerprint (see the module docstring); ``inputs``: input buffer name -> a
    JSON-able description of what fills it."""
    canonical = _canonical({"version": FINGERPRINT_VERSION, "architecture": architecture,
                            "layout": layout.digest(), "weights": weights, "device_kind": kind,
                            "inputs": dict(inputs or {})})
    return hashlib.sha256(canonical.encode()).hexdigest()


def binding_digest(binding: Any) -> str:
    """SHA-256 of what fills one input buffer (its port binding; None when unknown)."""
    return _sha256(binding)


@dataclass(frozen=True)
class FingerprintParts:
    """One digest per component of the fingerprint (hex SHA-256, except ``kernel``, which
    is readable: the device kind, and an ONNX policy's runtime and provider). Equal parts
    of the same ``version`` give equal fingerprints; ``causes`` names what differs."""

    architecture: str        # the architecture without its kernel keys
    layout: str              # ArenaLayout.digest()
    weights: str             # weights_digest()
    ports: str               # what fills each input buffer (all port bindings)
    kernel: str              # device kind (+ KERNEL_KEYS of the architecture)
    version: int = FINGERPRINT_VERSION

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, obj: Any, error: Type[CapsuleRosError] = CorruptCapsule) -> FingerprintParts:
        """Parts from a capsule header, validated strictly (``error`` otherwise)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(obj, dict) or sorted(obj) != sorted(names):
            raise error(f"fingerprint_parts = {_canonical(obj)[:120]}: needs exactly the keys {names}")
        for name in ("architecture", "layout", "weights", "ports"):
            value = obj[name]
            if type(value) is not str or not re.fullmatch(r"[0-9a-f]{64}", value):
                raise error(f"fingerprint_parts.{name} = {str(value)[:80]!r}: must be 64 lowercase hex digits")
        kernel = obj["kernel"]
        if type(kernel) is not str or not 0 < len(kernel) <= MAX_KERNEL_CHARS or not kernel.isprintable():
            raise error(f"fingerprint_parts.kernel = {str(kernel)[:80]!r}: must be printable text of 1 to "
                        f"{MAX_KERNEL_CHARS} characters")
        if type(obj["version"]) is not int or not 0 < obj["version"] < 1 << 16:
            raise error(f"fingerprint_parts.version = {obj['version']!r}: must be a small positive integer")
        return cls(**obj)

    def causes(self, other: FingerprintParts) -> Tuple[str, ...]:
        """The components (keys of ``CAUSES``) in which ``other`` differs from these parts;
        "build" when the fingerprint's version differs, or when nothing recorded does (the
        fingerprints differ all the same: a formula this build does not know)."""
        differing = tuple(name for name in ("weights", "architecture", "layout", "ports", "kernel")
                          if getattr(self, name) != getattr(other, name))
        if self.version != other.version or not differing:
            differing += ("build",)
        return differing


def fingerprint_parts(architecture: dict, layout: ArenaLayout, weights: str, kind: str,
                      inputs: Optional[Mapping[str, Any]] = None) -> FingerprintParts:
    """The parts of ``compute_fingerprint``'s inputs (same arguments)."""
    model = {k: v for k, v in architecture.items() if k not in KERNEL_KEYS}
    kernel_keys: Dict[str, Any] = {k: architecture[k] for k in KERNEL_KEYS if k in architecture}
    kernel = kind + "".join(f"; {k} {v}" for k, v in sorted(kernel_keys.items()))
    return FingerprintParts(_sha256(model), layout.digest(), weights, _sha256(dict(inputs or {})),
                            kernel[:MAX_KERNEL_CHARS])


@dataclass(frozen=True)
class RuntimeIdentity:
    """What binds capsules to a runtime: its fingerprint and the parts it is computed from
    (``capsule_ros.runtime.builder.runtime_identity`` computes both without building the
    runtime; a builder given one trusts it, as the node's activate does with what its
    configure computed)."""

    fingerprint: str
    parts: FingerprintParts

    @classmethod
    def of(cls, architecture: dict, layout: ArenaLayout, weights: str, kind: str,
           inputs: Optional[Mapping[str, Any]] = None) -> RuntimeIdentity:
        return cls(compute_fingerprint(architecture, layout, weights, kind, inputs),
                   fingerprint_parts(architecture, layout, weights, kind, inputs))


def describe_causes(causes: Tuple[str, ...]) -> str:
    """``("weights", "layout")`` -> ``"weights, state layout"``."""
    return ", ".join(CAUSES.get(c, c) for c in causes)
