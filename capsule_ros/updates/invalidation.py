"""Which capsule files of a directory a deployment invalidates, counted by cause (headers
only): the node's configure reports them in ``~/status`` and ``/diagnostics``
(``capsule_ros.updates.watch``); ``capsule-ros check`` (``capsule_ros.updates.assessment``)
adds what regeneration can do about each. Each file's validity is
``capsule_ros.capsules.validity.judge``'s.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.validity import judge
from capsule_ros.errors import CapsuleRosError
from capsule_ros.runtime.fingerprint import CAUSES, FingerprintParts


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
        validity = judge(header, fingerprint, parts, schema)
        if validity.valid:
            continue
        stale.append(capsule_id)
        counts.update(validity.causes)
        regenerable += has_recipe
    return Survey(total, len(stale), dict(counts), regenerable, unreadable, tuple(stale), recipes)
