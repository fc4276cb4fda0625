"""The mark a capsule carries of its runtime's execution mode, without torch (the capsule
file format and ``capsule-ros inspect`` read it).

A runtime's execution mode (``capsule_ros.runtime.mode``) may keep host-side state that
goes with the arena's bytes: the chunking mode mirrors its chunk cursor on the host, so
that choosing a step's program never waits for the device. A capsule of the live state
carries that state as a ``ModeMark``: a small, flat, JSON-able value that the capsule
store and the file format keep and write (the header key ``chunk``, its name from when
chunking was the only mode) but never interpret. The mode that made it parses and checks
it when a capsule is restored (``ExecutionMode.admit``), and takes it up afterwards
(``ExecutionMode.after_restore``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, Mapping, Tuple, Type, Union

from capsule_ros.errors import CapsuleRosError, CorruptCapsule

Value = Union[int, str]
MAX_ENTRIES = 16
MAX_TEXT = 64


@dataclass(frozen=True)
class ModeMark:
    """A mode's host-side state at a step boundary: names -> small integers or short
    strings (see the module docstring). Equal marks have equal entries, in any order."""

    entries: Tuple[Tuple[str, Value], ...]

    @classmethod
    def of(cls, values: Mapping[str, Value]) -> ModeMark:
        return cls(tuple(sorted(values.items())))

    def as_dict(self) -> Dict[str, Value]:
        return dict(self.entries)

    def to_json(self) -> dict:
        return self.as_dict()

    @classmethod
    def from_json(cls, obj: object, where: str, error: Type[CapsuleRosError] = CorruptCapsule) -> ModeMark:
        """A mark from a capsule header's ``chunk`` object: at most 16 entries, each a name
        of at most 64 characters with a non-negative integer below 2^31 or a string of at
        most 64 characters (``error`` naming ``where`` otherwise). What the entries mean
        is the mode's to check."""
        shown = json.dumps(obj, default=repr)[:120]
        if not isinstance(obj, dict) or not obj or len(obj) > MAX_ENTRIES:
            raise error(f"{where}chunk = {shown}: must be an object of 1 to {MAX_ENTRIES} entries")
        for key, value in obj.items():
            if not isinstance(key, str) or not key or len(key) > MAX_TEXT:
                raise error(f"{where}chunk = {shown}: entry names must be 1 to {MAX_TEXT} characters")
            number = type(value) is int and 0 <= value < 1 << 31
            text = isinstance(value, str) and len(value) <= MAX_TEXT
            if not (number or text):
                raise error(f"{where}chunk.{key} = {json.dumps(value, default=repr)[:60]}: must be an integer in "
                            f"[0, 2^31) or a string of at most {MAX_TEXT} characters")
        return cls.of(obj)
