"""Ablations of a replay: re-entries restore only some buffer kinds (``--ablation``; the
session's ``reenter(..., only=...)`` does it).

The paper's point that recurrent state is load-bearing: restoring the KV cache alone
(and even KV plus metadata) after a rollback diverges at the first step that follows.
"""
from __future__ import annotations

from capsule_ros.runtime.schema import BufferKind

ABLATIONS = {"kv-only": (BufferKind.KV,), "kv-meta": (BufferKind.KV, BufferKind.META)}
