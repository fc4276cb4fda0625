"""The host-side record of a chunk state that a capsule carries (no torch: the capsule file
format and ``capsule-ros inspect`` read it). ``capsule_ros.runtime.chunking`` has the
schedule it belongs to.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Type

from capsule_ros.errors import CapsuleRosError, CorruptCapsule

MARK_KEYS = ("mode", "delay", "horizon", "cursor", "pending")


class ChunkMode(str, enum.Enum):
    """``control.chunking``."""

    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class ChunkMark:
    """The host mirror of a chunk state (and what a capsule carries): the schedule it
    belongs to and the cursor and pending flag of ``chunk.cursor`` / ``chunk.pending``."""

    mode: str
    delay: int
    horizon: int
    cursor: int
    pending: bool

    def to_json(self) -> dict:
        return {"mode": self.mode, "delay": self.delay, "horizon": self.horizon, "cursor": self.cursor,
                "pending": int(self.pending)}

    @classmethod
    def from_json(cls, obj: object, where: str, error: Type[CapsuleRosError] = CorruptCapsule) -> ChunkMark:
        """A mark from a capsule header; ``error`` naming ``where`` when malformed."""
        if not isinstance(obj, dict) or sorted(obj) != sorted(MARK_KEYS):
            raise error(f"{where}chunk = {json.dumps(obj, default=repr)[:120]}: needs exactly the keys "
                        f"{list(MARK_KEYS)}")
        if obj["mode"] not in {m.value for m in ChunkMode}:
            raise error(f"{where}chunk.mode = {obj['mode']!r}: must be one of {[m.value for m in ChunkMode]}")
        values = [obj[k] for k in MARK_KEYS[1:]]
        if any(type(v) is not int or not 0 <= v < 1 << 31 for v in values):
            raise error(f"{where}chunk = {obj}: delay, horizon, cursor and pending must be small integers")
        if obj["pending"] not in (0, 1):
            raise error(f"{where}chunk.pending = {obj['pending']}: must be 0 or 1")
        return cls(obj["mode"], obj["delay"], obj["horizon"], obj["cursor"], bool(obj["pending"]))

    def describe(self) -> str:
        pending = ", a refill requested" if self.pending else ""
        delay = f", delay {self.delay}" if self.mode == ChunkMode.ASYNC.value else ""
        return f"{self.mode}{delay}, horizon {self.horizon}: row {self.cursor} next{pending}"
