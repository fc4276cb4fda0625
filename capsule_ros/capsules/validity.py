"""Whether a capsule file fits a runtime, and if not why: from its header alone.

A capsule is valid under a deployment when its fingerprint is the deployment's. When it
is not, the fingerprint's parts (``FingerprintParts``, in every header from format version
2 on) name the components that differ: weights, architecture, state layout, port
mapping, kernel or build. A version 1 header has no parts: only a changed state layout
can still be told (its buffer schema is in the header), the rest cannot be split.

The session lists a disk-only capsule of another fingerprint with its validity
(``~/list_capsules``); model updates (``capsule_ros.updates``) count and regenerate them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from capsule_ros.capsules.fileformat import BufferRecord, CapsuleHeader
from capsule_ros.runtime.fingerprint import FingerprintParts, describe_causes

UNSPLIT = "unsplit"          # a cause that a version 1 header cannot name


@dataclass(frozen=True)
class Validity:
    """A capsule file under a deployment: valid, or the causes of its invalidation
    (keys of ``CAUSES``; ``UNSPLIT`` when the header cannot tell)."""

    valid: bool
    causes: Tuple[str, ...] = ()
    note: str = ""           # what could not be told, and why

    def describe(self) -> str:
        if self.valid:
            return "valid"
        named = describe_causes(tuple(c for c in self.causes if c != UNSPLIT))
        return "; ".join(filter(None, (named, self.note)))


def judge(header: CapsuleHeader, fingerprint: str, parts: FingerprintParts, schema: Sequence[dict]) -> Validity:
    """The validity of one capsule file's header under a deployment of ``fingerprint``,
    ``parts`` and arena ``schema`` (``ArenaLayout.schema()``)."""
    if header.fingerprint == fingerprint:
        return Validity(True)
    if header.fingerprint_parts is not None:
        return Validity(False, header.fingerprint_parts.causes(parts))
    layout_changed = header.schema != tuple(BufferRecord.of(e) for e in schema)
    note = (f"the other components cannot be told apart: format version {header.version} records no fingerprint "
            "parts" if layout_changed else
            f"which component changed cannot be told: format version {header.version} records no fingerprint parts "
            "(the state layout is the same)")
    return Validity(False, ("layout", UNSPLIT) if layout_changed else (UNSPLIT,), note)
