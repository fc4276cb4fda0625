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
    KV = "kv"                # attention key/value cache
    RECURRENT = "recurrent"  # linear-recurrent layer state
    CONV = "conv"            # short causal convolution state
    CHUNK = "chunk"          # action-chunk (multi-token prediction) state
    META = "meta"            # step, position, episode, RNG
    OUTPUT = "output"        # action and predicted chunk, read by the host each step


KIND_ORDER = tuple(BufferKind)
# Buffers that define the policy's execution state (everything but the I/O staging areas).
STATE_KINDS = (BufferKind.KV, BufferKind.RECURRENT, BufferKind.CONV, BufferKind.CHUNK, BufferKind.META)

# dtype name -> bytes per element (the names torch prints without "torch.")
DTYPE_SIZES: Dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
                               "uint8": 1}
