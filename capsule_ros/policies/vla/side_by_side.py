"""Independent calls run side by side on the GPU: a VLA's cameras through its vision tower, a
layer's query, key and value projections, an MLP's gate and up projections.

LeRobot runs such calls one after the other. At batch 1 their kernels leave most of an H100
idle (SmolVLA's SigLIP at 1,024 patches per camera, π0's at 256, the action expert's 50
tokens), so on CUDA each call runs on a side stream of its own, forked from the current stream
and joined back to it: in a captured graph these are parallel branches. Every kernel is the one
the sequential code launches, on the same inputs, so the bits are the same (the CUDA tests
``test_side_by_side_gives_the_sequential_bits_eagerly_and_captured`` and, for the policies,
``test_cuda_graph_programs_equal_the_eager_cuda_plan`` check it); on a CPU the calls run in
order.

Side streams belong to the instance (made on first use and kept, so that a capture finds the
cuBLAS workspaces its warm-up runs made); a deep copy (the start-up check's copy of a policy)
gets streams of its own.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence

import torch

Call = Callable[[], torch.Tensor]


class SideBySide:
    """``run(calls, device)``: ``[call() for call in calls]``, on CUDA with each call on a side
    stream (module docstring); ``map(fn, inputs)``: ``fn`` over ``inputs`` the same way.
    ``enabled`` False: always in order (the reference the tests compare to)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._streams: Dict[torch.device, List[torch.cuda.Stream]] = {}

    def __deepcopy__(self, memo: Optional[dict] = None) -> SideBySide:
        return SideBySide(self.enabled)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        if not inputs:
            return []
        return self.run([functools.partial(fn, x) for x in inputs], inputs[0].device)

    def run(self, calls: Sequence[Call], device: torch.device) -> List[torch.Tensor]:
        if not self.enabled or device.type != "cuda" or len(calls) < 2:
            return [call() for call in calls]
        current = torch.cuda.current_stream(device)
        streams = self._side_streams(device, len(calls))
        outputs = []
        for stream, call in zip(streams, calls, strict=True):
            stream.wait_stream(current)                       # the inputs, made on the current stream
            with torch.cuda.stream(stream):
                outputs.append(call())
        for stream, out in zip(streams, outputs, strict=True):
            current.wait_stream(stream)
            out.record_stream(current)        # not reused for another stream while the current one reads it
        return outputs

    def _side_streams(self, device: torch.device, count: int) -> List[torch.cuda.Stream]:
        streams = self._streams.setdefault(device, [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device))
        return streams[:count]
