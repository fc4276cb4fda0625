"""The vocabulary of arena layouts, without torch: buffer kinds, their order, alignment and
the dtypes a buffer may have. The arena (``capsule_ros.runtime.arena``) builds layouts
from it; the capsule file format (``capsule_ros.capsules.fileformat``) validates stored
schemas against it, so ``capsule-ros inspect`` answers without importing torch.
"""
from __future__ import annotations

import enum
from typing import Dict

ALIGNMENT = 256  # bytes; a CUDA allocation's own alignment, enough for every dtype and vector loads


class BufferKind(str, enum.Enum):
    """What a buffer holds; the order here is the arena's layout order."""

    INPUT = "input"          # fixed-shape sensor inputs, written by the host each step
    REQUEST = "request"      # an asynchronous chunk refill's copy of what the plan reads (capsule_ros.chunking)
    KV = "kv"                # attention key/value cache
    RECURRENT = "recurrent"  # linear-recurrent layer state
    CONV = "conv"            # short causal convolution state
    CHUNK = "chunk"          # action-chunk (multi-token prediction) state
    META = "meta"            # step, position, episode, RNG
    OUTPUT = "output"        # action and predicted chunk, read by the host each step


KIND_ORDER = tuple(BufferKind)
# Buffers that define the policy's execution state (everything but the I/O staging areas),
# and what a step guard puts back when it undoes a step. REQUEST buffers are state too (a
# capsule holds them), but only while ``chunk.pending`` says a request is out, and the step
# that writes them also sets that flag, which the guard does put back: so they stay out of
# the guard's copy (they hold a copy of the inputs, often the largest buffers).
STATE_KINDS = (BufferKind.KV, BufferKind.RECURRENT, BufferKind.CONV, BufferKind.CHUNK, BufferKind.META)

# dtype name -> bytes per element (the names torch prints without "torch.")
DTYPE_SIZES: Dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
                               "uint8": 1}
