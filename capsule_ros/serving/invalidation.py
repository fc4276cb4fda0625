"""Which capsule files a deployment invalidates, and why: from their headers alone.

A capsule is valid under a deployment when its fingerprint is the deployment's. When it
is not, the fingerprint's parts (``FingerprintParts``, in every header from format version
2 on) name the components that differ: weights, architecture, state layout, port
mapping, kernel or build. A version 1 header has no parts: only a changed state layout
can still be told (its buffer schema is in the header), the rest cannot be split.

``survey`` counts a capsule directory by cause (the node's configure: ``~/status`` and
``/diagnostics`` show the counts); ``capsule-ros check`` (``capsule_ros.serving.regenerate``)
adds what regeneration can do about each.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.fileformat import BufferRecord, CapsuleHeader
from capsule_ros.errors import CapsuleRosError
from capsule_ros.runtime.fingerprint import CAUSES, FingerprintParts, describe_causes

UNSPLIT = "unsplit"          # a cause that a version 1 header cannot name


@dataclass(frozen=True)
class Verdict:
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


def judge(header: CapsuleHeader, fingerprint: str, parts: FingerprintParts, schema: Sequence[dict]) -> Verdict:
    """The verdict on one capsule file's header under a deployment of ``fingerprint``,
    ``parts`` and arena ``schema`` (``ArenaLayout.schema()``)."""
    if header.fingerprint == fingerprint:
        return Verdict(True)
    if header.fingerprint_parts is not None:
        return Verdict(False, header.fingerprint_parts.causes(parts))
    layout_changed = header.schema != tuple(BufferRecord.of(e) for e in schema)
    note = (f"the other components cannot be told apart: format version {header.version} records no fingerprint "
            "parts" if layout_changed else
            f"which component changed cannot be told: format version {header.version} records no fingerprint parts "
            "(the state layout is the same)")
    return Verdict(False, ("layout", UNSPLIT) if layout_changed else (UNSPLIT,), note)


@dataclass(frozen=True)
class Survey:
    """A capsule directory under a deployment: how many files, how many of another
    fingerprint (stale) by cause, of those how many carry a recipe that can rebuild them,
    the files whose header could not be read, and every file's recipe (bytes, regenerable)."""

    total: int = 0
    stale: int = 0
    by_cause: Dict[str, int] = field(default_factory=dict)     # keys of CAUSES and UNSPLIT
    regenerable: int = 0
    unreadable: int = 0
    stale_ids: Tuple[str, ...] = ()
    recipes: Dict[str, Tuple[int, bool]] = field(default_factory=dict)   # every file: (recipe bytes, regenerable)

    def describe(self) -> str:
        if not self.stale:
            return f"{self.total} capsule file(s), none of another fingerprint"
        causes = ", ".join(f"{CAUSES.get(c, 'cause not recorded')} {n}" for c, n in sorted(self.by_cause.items()))
        return (f"{self.stale} of {self.total} capsule file(s) are of another fingerprint ({causes}); "
                f"{self.regenerable} carry a recipe")


def survey(directory: Optional[CapsuleDirectory], fingerprint: str, parts: FingerprintParts,
           schema: Sequence[dict]) -> Survey:
    """Read every capsule file's header (never a payload) and count the stale ones by cause."""
    if directory is None:
        return Survey()
    counts: collections.Counter = collections.Counter()
    stale: List[str] = []
    recipes: Dict[str, Tuple[int, bool]] = {}
    total = regenerable = unreadable = 0
    for capsule_id in directory.ids():
        total += 1
        try:
            header = directory.header(capsule_id)
        except CapsuleRosError:
            unreadable += 1
            continue
        has_recipe = bool(header.recipe is not None and header.recipe.regenerable)
        recipes[capsule_id] = (header.recipe_bytes, has_recipe)
        verdict = judge(header, fingerprint, parts, schema)
        if verdict.valid:
            continue
        stale.append(capsule_id)
        counts.update(verdict.causes)
        regenerable += has_recipe
    return Survey(total, len(stale), dict(counts), regenerable, unreadable, tuple(stale), recipes)
