"""The capsules a session keeps, and the verbs that leave the live state alone: list,
save, load and drop (and the file half of a persisting commit).

They share the session's boundary lock (the store is not thread-safe) but never touch
the arena, the episode or the lineage; ``PolicySession`` (the episode state machine)
delegates to them. File I/O happens outside the lock (``capsule_ros.serving.files``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, List, Optional, Sequence

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.capsules.store import Capsule, CapsuleStore
from capsule_ros.errors import CapsuleIOError, CapsuleRosError, NotFound, WrongState
from capsule_ros.serving.boundary import BoundaryLock
from capsule_ros.serving.files import CapsuleReader, CapsuleSaver, SaveJob, Source
from capsule_ros.serving.recompute import Recompute
from capsule_ros.serving.records import EventKind

Emit = Callable[..., None]       # PolicySession._emit(kind, capsule, *, capsule_id=..., detail=...)


class CapsuleSet:
    """See the module docstring. ``held(capsule_id)`` says whether the state machine holds
    a capsule it must not lose (the interrupt capsule while interrupted)."""

    def __init__(self, store: CapsuleStore, directory: Optional[CapsuleDirectory], schema: Sequence[dict],
                 recompute: Recompute, boundary: BoundaryLock, at_boundary: Callable[[], ContextManager],
                 emit: Emit, held: Callable[[str], bool], between_steps: Callable[[], object]):
        self.store = store
        self.directory = directory
        self.recompute = recompute
        self.reader = CapsuleReader(store, directory, schema)
        self.saver = CapsuleSaver(directory, store, schema, between_steps) if directory is not None else None
        self._boundary = boundary
        self._at_boundary = at_boundary
        self._emit = emit
        self._held = held

    def list(self, episode: Optional[int] = None) -> List[Capsule]:
        """Capsules in memory and in the capsule directory, newest first (of ``episode``)."""
        with self._at_boundary():
            capsules = {c.id: c for c in self.store.list()}
        if self.directory is not None:
            for capsule_id in self.directory.ids():
                if capsule_id not in capsules:
                    with contextlib.suppress(CapsuleRosError):
                        capsules[capsule_id] = self.directory.describe(capsule_id)
        out = sorted(capsules.values(), key=lambda c: c.stamp_ns, reverse=True)
        return [c for c in out if c.episode_id == episode] if episode is not None else out

    def drop(self, capsule_id: str, from_disk: bool = False) -> None:
        """Forget a capsule from memory (and its file with ``from_disk``). Once this returns,
        the capsule never comes back, even if a save of it was still writing. Raises
        InvalidArgument, NotFound, WrongState (a held capsule) and Busy."""
        check_capsule_id(capsule_id)
        has_file = self.directory is not None and self.directory.exists(capsule_id)
        with self._at_boundary():
            if self._held(capsule_id):
                raise WrongState(f"capsule {capsule_id!r} is the interrupt capsule: re-enter or reset first")
            saving = self.saver is not None and self.saver.is_saving(capsule_id)
            if capsule_id not in self.store and not (from_disk and (has_file or saving)):
                raise NotFound(f"no capsule {capsule_id!r}" + (" in memory or on disk" if from_disk else " in memory"))
            capsule = self.store.drop(capsule_id) if capsule_id in self.store else None
            if from_disk and self.saver is not None:
                self.saver.cancel(capsule_id)
            if from_disk or not has_file:
                self.recompute.forget(capsule_id)    # gone for good: no recompute brings it back
            self._emit(EventKind.DROP, capsule, capsule_id=capsule_id,
                       detail="memory and disk" if from_disk else "memory")
        if from_disk and self.directory is not None:
            with contextlib.suppress(NotFound):      # also a file a save published just before the drop
                self.directory.remove(capsule_id)

    def save(self, capsule_id: str) -> Capsule:
        """Write an in-memory capsule to the capsule directory (atomic, verified) without
        holding up the control loop. Raises InvalidArgument, NotFound (unknown, only on disk
        already, or dropped while saving), Busy, CapsuleIOError, PermissionDenied."""
        check_capsule_id(capsule_id)
        saver = self.require_saver()
        with self._at_boundary():
            capsule = self.store.find(capsule_id)
            if capsule is None or capsule.payload is None:
                raise NotFound(f"no capsule {capsule_id!r} in memory" + (f" (only on disk: {capsule.path})"
                                                                         if capsule is not None else ""))
            job = saver.begin(capsule)
        return self.write(job)

    def load(self, capsule_id: str) -> Capsule:
        """Read and verify a capsule file into memory (the live state is not touched).
        Raises NotFound, CorruptCapsule, FingerprintMismatch, PermissionDenied,
        CapsuleIOError (the file's own problem, even when the capsule is in memory),
        ResourceExhausted and Busy."""
        self.require_saver()
        fetched = self.reader.read(check_capsule_id(capsule_id))
        with self._at_boundary():
            capsule = self.in_store(self.reader.raise_error(fetched))
            self._emit(EventKind.LOAD, capsule, detail=capsule.path or "")
            return capsule

    def require_saver(self) -> CapsuleSaver:
        """The saver; CapsuleIOError when no capsule directory is configured."""
        if self.saver is None:
            raise CapsuleIOError("no capsule directory configured (capsules.directory)")
        return self.saver

    def in_store(self, source: Source) -> Capsule:
        """Under the lock: the source's capsule in the store (adopting its file's bytes)."""
        return source.capsule if source.data is None else self.store.adopt(source.capsule, source.data)

    def write(self, job: SaveJob) -> Capsule:
        """Outside the lock: a save begun under it. Its loan always ends, under the lock,
        which it must not give up on (it waits behind at most one step)."""
        saver = self.require_saver()
        try:
            path = saver.write(job)
        except BaseException:
            with self._boundary:
                saver.end(job)
            raise
        with self._boundary:
            saver.end(job)
            job.capsule.path = str(path)
            self._emit(EventKind.SAVE, job.capsule, detail=job.capsule.path)
        return job.capsule
