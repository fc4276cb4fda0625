"""Ablations of a replay: re-entries restore only some buffer kinds (``--ablation``).

The paper's point that recurrent state is load-bearing: restoring the KV cache alone
(and even KV plus metadata) after a rollback diverges at the first step that follows.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from capsule_ros.runtime.schema import KIND_ORDER, BufferKind

ABLATIONS = {"kv-only": (BufferKind.KV,), "kv-meta": (BufferKind.KV, BufferKind.META)}


def complement_runs(kinds: Sequence[BufferKind]) -> List[Tuple[BufferKind, ...]]:
    """The other buffer kinds, as runs contiguous in the arena's layout order."""
    runs: List[List[BufferKind]] = [[]]
    for kind in KIND_ORDER:
        if kind in kinds:
            runs.append([])
        else:
            runs[-1].append(kind)
    return [tuple(run) for run in runs if run]
