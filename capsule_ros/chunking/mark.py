"""What a capsule carries of the chunking mode's host-side state (no torch).

``ChunkingMark``: the schedule a state was made under (refill timing, delay, execution
horizon) and the host mirror of its ``chunk.cursor`` and ``chunk.pending``. The capsule
store and the file format keep it as an opaque ``ModeMark`` (the header key ``chunk``;
its entries ``mode``, ``delay``, ``horizon``, ``cursor``, ``pending`` are the format's, as
files written before keep them); only the chunking mode reads it back (``parse``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from capsule_ros.errors import CorruptCapsule
from capsule_ros.runtime.marks import ModeMark

MARK_KEYS = ("mode", "delay", "horizon", "cursor", "pending")
TIMINGS = ("sync", "async")


@dataclass(frozen=True)
class ChunkingMark:
    """The host mirror of a chunking state (see the module docstring)."""

    timing: str
    delay: int
    execution_horizon: int
    cursor: int
    pending: bool

    def to_mode_mark(self) -> ModeMark:
        return ModeMark.of({"mode": self.timing, "delay": self.delay, "horizon": self.execution_horizon,
                            "cursor": self.cursor, "pending": int(self.pending)})

    @classmethod
    def parse(cls, mark: Optional[ModeMark], capsule_id: str = "") -> ChunkingMark:
        """The chunking mark a capsule carries; CorruptCapsule naming ``capsule_id`` when
        it carries none or another mode's."""
        where = f"capsule {capsule_id!r}: " if capsule_id else ""
        if mark is None:
            raise CorruptCapsule(f"capsule {capsule_id!r} carries no chunk schedule; this policy's chunk state "
                                 "needs one")
        values = mark.as_dict()
        if sorted(values) != sorted(MARK_KEYS):
            raise CorruptCapsule(f"{where}chunk = {values}: needs exactly the keys {list(MARK_KEYS)}")
        if values["mode"] not in TIMINGS:
            raise CorruptCapsule(f"{where}chunk.mode = {values['mode']!r}: must be one of {list(TIMINGS)}")
        numbers = [values[key] for key in MARK_KEYS[1:]]
        if any(type(v) is not int for v in numbers) or values["pending"] not in (0, 1):
            raise CorruptCapsule(f"{where}chunk = {values}: delay, horizon and cursor must be integers, pending "
                                 "0 or 1")
        return cls(str(values["mode"]), int(values["delay"]), int(values["horizon"]), int(values["cursor"]),
                   bool(values["pending"]))

    def describe(self) -> str:
        pending = ", a refill requested" if self.pending else ""
        delay = f", delay {self.delay}" if self.timing == "async" else ""
        return f"{self.timing}{delay}, execution horizon {self.execution_horizon}: row {self.cursor} next{pending}"
