"""The host side of a step: two copies between host buffers and the arena.

Host <-> device traffic per step is two copies: the whole input region from a staging
buffer (pinned on CUDA) into the arena, and the meta + output region back into a host
buffer (pinned on CUDA). Every view here is made once, at build: the control step slices
nothing. The runtime owns both host buffers; on a GPU its programs may write the outputs'
host buffer themselves (``fold_outputs``: one launch fewer per step).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import numpy as np
import torch

from capsule_ros.runtime.arena import BufferKind, StateArena
from capsule_ros.runtime.streams import on_stream


class HostTransfer:
    """The input staging buffer and the outputs' host buffer of one arena, with numpy
    views of each buffer in them (see the module docstring). ``staging`` / ``outputs``:
    host bytes to use instead of allocating them (a fleet slot's rows of the fleet's host
    buffers, ``capsule_ros.runtime.fleet``)."""

    def __init__(self, arena: StateArena, pinned: bool, *, staging: Optional[torch.Tensor] = None,
                 outputs: Optional[torch.Tensor] = None):
        layout = arena.layout
        in_start, in_end = layout.byte_range(BufferKind.INPUT)
        out_start, out_end = layout.byte_range(BufferKind.META, BufferKind.OUTPUT)
        self.input_staging = staging if staging is not None else torch.zeros(in_end - in_start, dtype=torch.uint8,
                                                                               pin_memory=pinned)
        self.output_host = outputs if outputs is not None else torch.zeros(out_end - out_start, dtype=torch.uint8,
                                                                            pin_memory=pinned)
        self.input_region = arena.storage[in_start:in_end]
        self.output_region = arena.storage[out_start:out_end]
        self.staging: Dict[str, np.ndarray] = {}
        self.outputs: Dict[str, np.ndarray] = {}
        for slot in layout:
            kind, spec = slot.spec.kind, slot.spec
            if kind == BufferKind.INPUT:
                raw = self.input_staging[slot.offset - in_start:slot.end - in_start]
                self.staging[spec.name] = raw.view(spec.dtype).view(spec.shape).numpy()
            elif kind in (BufferKind.META, BufferKind.OUTPUT):
                raw = self.output_host[slot.offset - out_start:slot.end - out_start]
                self.outputs[spec.name] = raw.view(spec.dtype).view(spec.shape).numpy()

    def upload(self, stream: Optional[torch.cuda.Stream], row: Optional[torch.Tensor] = None) -> None:
        """The staging buffer (or ``row``, the same bytes from elsewhere) into the arena's
        input region, ordered on ``stream`` (asynchronous on CUDA)."""
        source = self.input_staging if row is None else row
        if stream is None:
            self.input_region.copy_(source)
            return
        with on_stream(stream):
            self.input_region.copy_(source, non_blocking=True)

    def fold(self) -> None:
        """Inside a program: the meta + output region into the host buffer (non-blocking)."""
        self.output_host.copy_(self.output_region, non_blocking=True)

    def download(self, stream: Optional[torch.cuda.Stream]) -> Mapping[str, np.ndarray]:
        """The meta + output region into the host buffer, complete on return; its views."""
        if stream is None:
            self.output_host.copy_(self.output_region)
        else:
            with on_stream(stream):
                self.output_host.copy_(self.output_region, non_blocking=True)
            stream.synchronize()
        return self.outputs
