"""Making a CUDA stream current for a block, cheaply: the control step enters its stream
several times per step, and ``torch.cuda.stream``'s Python (it resolves the current device
and wraps streams in objects) costs as much as a consume step's whole GPU work
(docs/benchmarks.md, "Switching CUDA streams"). ``on_stream`` does the same switch through
the two calls underneath (``_cuda_getCurrentStream`` / ``_cuda_setStream``), and falls back
to ``torch.cuda.stream`` where they are missing. A None stream (a CPU runtime) is a no-op.

``StreamKeeper`` hands out the streams runtimes run on, one per device and role, for as
long as their owner lives, each at its role's priority (``role_priority``).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Optional, Tuple

import torch

_C: Any = torch._C
_FAST = hasattr(_C, "_cuda_getCurrentStream") and hasattr(_C, "_cuda_setStream")


class _Scope:
    __slots__ = ("stream", "previous")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.previous: Any = None

    def __enter__(self) -> None:
        stream = self.stream
        self.previous = _C._cuda_getCurrentStream(stream.device_index)
        _C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                           device_type=stream.device_type)

    def __exit__(self, *exc: object) -> None:
        stream_id, device_index, device_type = self.previous
        _C._cuda_setStream(stream_id=stream_id, device_index=device_index, device_type=device_type)


def on_stream(stream: Optional[torch.cuda.Stream]) -> ContextManager[None]:
    """``stream`` current on this thread for the block (see the module docstring)."""
    if stream is None:
        return contextlib.nullcontext()
    return _Scope(stream) if _FAST else torch.cuda.stream(stream)


BACKGROUND_ROLES = ("refill",)   # work that fills the gaps of the control step's: a chunk refill's plan
STEP_PRIORITY = -1               # every other role: the control step's own kernels go first
BACKGROUND_PRIORITY = 0          # CUDA's lowest (and torch's default): a lower number is a higher priority


def role_priority(role: str) -> int:
    """The CUDA stream priority of ``role``'s stream. A refill's plan (tens of ms of large
    kernels for a VLA or a Diffusion U-Net) runs on its stream while consume steps run on
    the step's; at equal priority the GPU hands free SMs to whichever kernel was queued
    first, so a consume step's small kernels would wait for the plan's blocks ahead of
    them. At a higher priority they take the next free SMs. Priorities order no work:
    events do, so the bits are the same either way."""
    return BACKGROUND_PRIORITY if role in BACKGROUND_ROLES else STEP_PRIORITY


class StreamKeeper:
    """The CUDA streams of runtimes that come and go (the node's lifecycle, a benchmark's
    cycles): one per device and role, reused by every runtime made with this keeper.

    Why: cuBLAS keeps a workspace for every stream it has ever run on (docs/benchmarks.md,
    "Lifecycle: first active step and cleanup"), and
    ``torch.cuda.empty_cache`` does not free it; a fresh stream per activation would leave
    one behind each cycle. Freeing all workspaces would pull them from under CUDA graphs
    that other runtimes in the process have captured, so only a cleanup that leaves none
    does it (``release_device_memory(cublas_workspaces=True)``, the node's). The owner
    outlives the runtimes (the node holds one); a runtime made without a keeper gets its own.
    """

    def __init__(self) -> None:
        self._streams: Dict[Tuple[torch.device, str], torch.cuda.Stream] = {}

    def get(self, device: torch.device, role: str = "step") -> Optional[torch.cuda.Stream]:
        """The stream for ``role`` on ``device``, at ``role_priority(role)`` (None on a CPU)."""
        if device.type != "cuda":
            return None
        key = (device, role)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device, priority=role_priority(role))
        return self._streams[key]
