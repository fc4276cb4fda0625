"""Independent calls of one function run side by side on the GPU: a VLA's cameras through its vision tower.

A VLA embeds each camera with the same tower, one camera after the other in LeRobot's code. At
batch 1 a tower's kernels leave most of an H100 idle (SmolVLA's SigLIP at 1,024 patches, π0's
at 256), so on CUDA each camera's call runs on a side stream of its own, forked from the current
stream and joined back to it: in a captured graph these are parallel branches. Every kernel is
the one the sequential code launches, on the same inputs, so the bits are the same (the CUDA
tests ``test_side_by_side_gives_the_sequential_bits_eagerly_and_captured`` and, for the
policies, ``test_cuda_graph_programs_equal_the_eager_cuda_plan`` check it); on a CPU the calls
run in order.

Side streams belong to the instance (one per call, made on first use and kept, so that a
capture finds the cuBLAS workspaces its warm-up runs made); a deep copy (the start-up check's
copy of a policy) gets streams of its own.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch


class SideBySide:
    """``map(fn, inputs)``: ``[fn(x) for x in inputs]``, on CUDA with each call on a side stream
    (module docstring). ``enabled`` False: always in order (the reference the test compares to)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._streams: Dict[torch.device, List[torch.cuda.Stream]] = {}

    def __deepcopy__(self, memo: Optional[dict] = None) -> SideBySide:
        return SideBySide(self.enabled)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        if not inputs:
            return []
        device = inputs[0].device
        if not self.enabled or device.type != "cuda" or len(inputs) == 1:
            return [fn(x) for x in inputs]
        current = torch.cuda.current_stream(device)
        streams = self._side_streams(device, len(inputs))
        outputs = []
        for stream, x in zip(streams, inputs, strict=True):
            stream.wait_stream(current)                       # the inputs, made on the current stream
            with torch.cuda.stream(stream):
                outputs.append(fn(x))
        for stream, out in zip(streams, outputs, strict=True):
            current.wait_stream(stream)
            out.record_stream(current)        # not reused for another stream while the current one reads it
        return outputs

    def _side_streams(self, device: torch.device, count: int) -> List[torch.cuda.Stream]:
        streams = self._streams.setdefault(device, [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device))
        return streams[:count]
