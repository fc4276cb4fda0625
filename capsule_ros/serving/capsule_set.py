"""The capsules a session keeps, in memory and in its capsule directory: the parts of
list, save, load and drop that leave the live state alone.

A part, not an actor: every method says whether it runs under the session's boundary
(the caller holds it) or outside it (file work), and none takes the boundary itself or
calls back into the session. The episode state machine (``capsule_ros.serving.machine``)
uses it under the boundary, with its events and its interrupt capsule; the session's
verbs (``capsule_ros.serving.session``) call its file work outside the boundary. File I/O
happens outside it (``capsule_ros.serving.files``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import List, Optional, Protocol, Sequence

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.recipe import RecipeInfo
from capsule_ros.capsules.store import Capsule, CapsuleStore
from capsule_ros.capsules.validity import judge
from capsule_ros.errors import CapsuleIOError, CapsuleRosError, NotFound
from capsule_ros.serving.files import CapsuleReader, CapsuleSaver, SaveJob, Source
from capsule_ros.serving.recipes import RecipeChain, resolve_chain
from capsule_ros.serving.recompute import Recompute
from capsule_ros.serving.records import StalePicture


class DirectoryWatch(Protocol):
    """What the session's status shows of its capsule directory's model updates, kept
    current by the session's saves and drops (``capsule_ros.updates.watch.ModelUpdateWatch``
    is the node's). Called under the boundary."""

    def saved(self, capsule_id: str, recipe: Optional[RecipeInfo]) -> None:
        """The session wrote this capsule's file (with ``recipe``, None: none)."""

    def removed(self, capsule_id: str) -> None:
        """The session removed this capsule's file."""

    def picture(self) -> StalePicture:
        ...

    def close(self) -> None:
        """The session closes: stop any work in the background."""


class CapsuleSet:
    """See the module docstring. ``between_steps`` is set while no step runs (the
    guarded step's ``idle``): saves start their file work in that gap."""

    def __init__(self, store: CapsuleStore, directory: Optional[CapsuleDirectory], schema: Sequence[dict],
                 recompute: Recompute, between_steps: threading.Event):
        self.store = store
        self.directory = directory
        self.recompute = recompute
        self.reader = CapsuleReader(store, directory, schema)
        self.saver = (CapsuleSaver(directory, store, schema, between_steps, recompute,
                                   recompute.runtime.fingerprint_parts) if directory is not None else None)

    def require_saver(self) -> CapsuleSaver:
        """The saver; CapsuleIOError when no capsule directory is configured."""
        if self.saver is None:
            raise CapsuleIOError("no capsule directory configured (capsules.directory)")
        return self.saver

    # -- outside the boundary ----------------------------------------------------------------------
    def with_files(self, in_memory: Sequence[Capsule], episode: Optional[int] = None) -> List[Capsule]:
        """``in_memory`` (the store's listing, taken under the boundary) plus the capsule
        directory's disk-only capsules, newest first (of ``episode``); a file of another
        fingerprint is listed too, with why it is not restorable (``Capsule.stale``)."""
        capsules = {c.id: c for c in in_memory}
        if self.directory is not None:
            parts = self.recompute.runtime.fingerprint_parts
            for capsule_id in self.directory.ids():
                if capsule_id not in capsules:
                    with contextlib.suppress(CapsuleRosError):
                        header = self.directory.header(capsule_id)
                        capsule = self.directory.capsule_of(header, self.directory.path_of(capsule_id), capsule_id)
                        validity = judge(header, self.store.fingerprint, parts, self.reader.schema)
                        capsule.stale = "" if validity.valid else validity.describe()
                        capsules[capsule_id] = capsule
        out = sorted(capsules.values(), key=lambda c: c.stamp_ns, reverse=True)
        return [c for c in out if c.episode_id == episode] if episode is not None else out

    def recipe_chain(self, capsule_id: str) -> Optional[RecipeChain]:
        """The capsule file's recipe, followed back to a state this runtime can have
        (``resolve_chain``); None without a capsule directory."""
        if self.directory is None:
            return None
        return resolve_chain(self.directory, capsule_id, self.store.fingerprint, self.reader.schema,
                             self.directory.max_file_bytes, self.reader.in_memory)

    def has_file(self, capsule_id: str) -> bool:
        return self.directory is not None and self.directory.exists(capsule_id)

    def remove_file(self, capsule_id: str) -> None:
        """After a drop from disk: the file goes, also one a save published just before the drop."""
        if self.directory is not None:
            with contextlib.suppress(NotFound):
                self.directory.remove(capsule_id)

    # -- under the boundary ------------------------------------------------------------------------
    def drop(self, capsule_id: str, from_disk: bool, has_file: bool) -> Optional[Capsule]:
        """Forget a capsule from memory and, ``from_disk``, cancel a save still writing it
        (its file goes with ``remove_file`` once the boundary is left); the capsule that
        was in memory, if any. NotFound when there is nothing to drop. Once dropped from
        memory and disk it is gone for good: no recompute brings it back."""
        saving = self.saver is not None and self.saver.is_saving(capsule_id)
        if capsule_id not in self.store and not (from_disk and (has_file or saving)):
            raise NotFound(f"no capsule {capsule_id!r}" + (" in memory or on disk" if from_disk else " in memory"))
        capsule = self.store.drop(capsule_id) if capsule_id in self.store else None
        if from_disk and self.saver is not None:
            self.saver.cancel(capsule_id)
        if from_disk or not has_file:
            self.recompute.forget(capsule_id)
        return capsule

    def begin_save(self, capsule_id: str) -> SaveJob:
        """Borrow an in-memory capsule's bytes for a save; NotFound when it is unknown or
        only on disk already."""
        saver = self.require_saver()
        capsule = self.store.find(capsule_id)
        if capsule is None or capsule.payload is None:
            raise NotFound(f"no capsule {capsule_id!r} in memory" + (f" (only on disk: {capsule.path})"
                                                                     if capsule is not None else ""))
        return saver.begin(capsule)

    def in_store(self, source: Source) -> Capsule:
        """The source's capsule in the store (adopting its file's bytes)."""
        return source.capsule if source.data is None else self.store.adopt(source.capsule, source.data)
