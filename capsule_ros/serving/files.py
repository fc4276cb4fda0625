"""Capsule files, handled outside the session's boundary lock so that the control loop
never waits for a disk: saving in-memory capsules (``CapsuleSaver``) and reading a
capsule's verified file (``CapsuleReader``).

A save has three phases. ``begin`` runs under the session's boundary lock and only
borrows the capsule's bytes from the store (a ``Loan``: the slab is neither moved,
evicted nor reused until the save ends, even if the capsule is dropped meanwhile) and
counts its recipe (``Recompute.recipe_for``, bounded by ``capsules.recipe_max_mb``; the
rows are copied in ``write``, outside the lock: ``Recompute.take_recipe``).
``write`` runs outside the lock: on a GPU it copies the slab into one pinned staging
buffer (allocated at start, the capsule's size) on a low-priority stream (the control
loop's stream is never waited on; one staging buffer, so saves of a GPU runtime take
turns), on a CPU it writes straight from the slab; then the directory writes, fsyncs
and renames the file. ``end`` runs under the lock again and gives the loan back.

A drop from disk while a save is writing marks the save *dropped*; the directory asks
right before it publishes the file, under its own lock, so a drop that answered success
is never undone by the save (``CapsuleDirectory.save``'s ``keep``).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence, Union

import torch

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.recipe import Recipe, RecipeInfo
from capsule_ros.capsules.store import Capsule, CapsuleStore, Loan
from capsule_ros.errors import Busy, CapsuleIOError, CapsuleRosError, FingerprintMismatch, InvalidArgument, NotFound
from capsule_ros.runtime.fingerprint import FingerprintParts
from capsule_ros.serving.recompute import KEEP_FILE_RECIPE, PendingRecipe, RecipeCapture, Recompute

SAVE_GAP_WAIT_S = 0.01       # a save waits at most this long for the gap after a step


class SaveFailed(CapsuleIOError):
    """A persisting commit made its capsule (it stays in memory: ``save`` retries, ``drop``
    discards it) but could not write its file; ``code`` is the save's own error code."""

    def __init__(self, capsule: Capsule, cause: CapsuleRosError):
        super().__init__(f"committed {capsule.id} in memory, but saving it failed: {cause}")
        self.capsule = capsule
        self.code = cause.code


@dataclass(frozen=True)
class Source:
    """Where a verb takes a capsule's state from: in memory (``data`` None) or the
    verified bytes of its file."""

    capsule: Capsule
    data: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Fetched:
    """The outcome of reading a capsule's file: its source, or the typed error."""

    source: Optional[Source] = None
    error: Optional[CapsuleRosError] = None


class CapsuleReader:
    """Finds the state a verb needs: a capsule in memory, or its file read and verified
    outside the boundary lock (``read``, the slow part), then used under it (``resolve``)."""

    def __init__(self, store: CapsuleStore, directory: Optional[CapsuleDirectory], schema: Sequence[dict]):
        self.store = store
        self.directory = directory
        self.schema = list(schema)

    def read(self, capsule_id: str) -> Fetched:
        """Outside the lock: read and verify the capsule's file."""
        if self.directory is None:
            return Fetched(error=NotFound(f"no capsule {capsule_id!r} in memory and no capsule directory "
                                          "configured"))
        try:
            capsule, data = self.directory.load(capsule_id, expected_fingerprint=self.store.fingerprint,
                                                expected_schema=self.schema)
        except CapsuleRosError as exc:
            return Fetched(error=exc)
        if capsule.episode_id >= 2**32:
            return Fetched(error=InvalidArgument(f"capsule {capsule_id!r}: episode id {capsule.episode_id} "
                                                 "is out of range"))
        return Fetched(source=Source(capsule, data))

    def resolve(self, capsule_id: str, fetched: Optional[Fetched]) -> Optional[Source]:
        """Under the lock: the capsule's state, in memory now (a file read meanwhile is not
        needed) or from ``fetched`` (raising its typed error, a foreign capsule counted as
        an invalidation); None when it was in memory at the read but has left since (the
        caller reads its file and tries again)."""
        if self.in_memory(capsule_id):
            return Source(self.store.get(capsule_id))
        if fetched is None:
            return None
        return self.raise_error(fetched)

    def in_memory(self, capsule_id: str) -> bool:
        known = self.store.find(capsule_id)      # a dict lookup: safe without the lock
        return known is not None and known.payload is not None

    def raise_error(self, fetched: Fetched) -> Source:
        """Under the lock: raise a read's error, if any (counting a foreign capsule); else
        return what it read."""
        if fetched.error is not None:
            if isinstance(fetched.error, FingerprintMismatch):
                self.store.counters.invalidations += 1
            raise fetched.error
        assert fetched.source is not None
        return fetched.source


@dataclass
class SaveJob:
    capsule: Capsule
    loan: Loan
    recipe: RecipeCapture = None   # what its file gets as a recipe (taken with the loan)
    dropped: bool = False          # a drop from disk came while it was writing
    written: Optional[RecipeInfo] = None   # the recipe info of the file written (when one was)


class CapsuleSaver:
    """Saves of one session's capsules (see the module docstring)."""

    def __init__(self, directory: CapsuleDirectory, store: CapsuleStore, schema: Sequence[dict],
                 between_steps: Optional[threading.Event] = None,
                 recipes: Optional[Recompute] = None, parts: Optional[FingerprintParts] = None):
        """``between_steps`` is set while no step runs (``GuardedStep.idle``): a save's file
        work starts in that gap (see ``write``). ``recipes``: where a capsule's recipe comes
        from (None: no recipes); ``parts``: the fingerprint's components, written in every
        header."""
        self.directory = directory
        self.store = store
        self.schema = list(schema)
        self.between_steps = between_steps
        self.recipes = recipes
        self.parts = parts
        self._recipe_buffer = bytearray()          # see _recipe_room
        self._recipe_lock = threading.Lock()
        self._jobs: Dict[str, SaveJob] = {}
        cuda = store.device.type == "cuda"
        self._stream = torch.cuda.Stream(store.device, priority=0) if cuda else None
        # Pinned now, not at the first save: pinning a large state holds the GIL long enough
        # to stall the control loop once (docs/benchmarks.md, "Pinned staging for saves").
        self._staging = torch.empty(store.nbytes, dtype=torch.uint8, pin_memory=True) if cuda else None
        self._staging_lock = threading.Lock() if cuda else None

    def begin(self, capsule: Capsule) -> SaveJob:
        """Under the boundary lock: borrow the capsule's bytes. Busy if it is being saved."""
        if capsule.id in self._jobs:
            raise Busy(f"capsule {capsule.id!r} is being saved already")
        recipe = self.recipes.recipe_for(capsule) if self.recipes is not None else None
        job = SaveJob(capsule, self.store.lend(capsule.id), recipe)
        self._jobs[capsule.id] = job
        return job

    def write(self, job: SaveJob) -> Path:
        """Outside the lock: the file, written atomically; raises the directory's errors
        (NotFound when the capsule was dropped from disk meanwhile). The file work starts
        between two steps: on a CPU a save's Python and a step's share one interpreter
        lock, and starting in the gap after a step lowers the step p99 during back-to-back
        persisting commits (docs/benchmarks.md, "Saves start in the gap after a step"). It waits at most
        ``SAVE_GAP_WAIT_S`` for that gap."""
        with self._recipe_room(job) as room:
            recipe = self._file_recipe(job.capsule.id) if job.recipe == KEEP_FILE_RECIPE else job.recipe
            if isinstance(recipe, PendingRecipe):
                assert self.recipes is not None and room is not None
                recipe = self.recipes.take_recipe(recipe, room)
            assert not isinstance(recipe, str)
            with self._host_bytes(job.loan) as data:
                if self.between_steps is not None:
                    self.between_steps.wait(SAVE_GAP_WAIT_S)
                path = self.directory.save(job.capsule, data, self.schema, keep=lambda: not job.dropped,
                                           recipe=recipe, parts=self.parts)
        job.written = recipe.info if isinstance(recipe, Recipe) else recipe
        return path

    @contextlib.contextmanager
    def _recipe_room(self, job: SaveJob) -> Iterator[Optional[bytearray]]:
        """The buffer a recipe's rows are copied into, kept from save to save (saves with
        recipes take turns on it): a multi-megabyte allocation and release per save is
        kernel work (mapping and unmapping memory) in the process whose control loop must
        not wait; one buffer, grown to the largest recipe so far, is not."""
        if not isinstance(job.recipe, PendingRecipe):
            yield None
            return
        with self._recipe_lock:
            need = job.recipe.info.data_bytes
            if len(self._recipe_buffer) < need:            # grows (a quarter more) and stays
                self._recipe_buffer = bytearray(need + need // 4)
            yield self._recipe_buffer

    def end(self, job: SaveJob) -> None:
        """Under the boundary lock: give the loan back (and, when the file was written,
        tell the capsule its recipe)."""
        self._jobs.pop(job.capsule.id, None)
        job.loan.end()
        if job.written is not None:
            job.capsule.recipe = job.written

    def _file_recipe(self, capsule_id: str) -> Union[None, Recipe, RecipeInfo]:
        """Outside the lock: the recipe of a capsule this process has no log of (it was
        loaded from its file): the one its file has, kept as it is."""
        if not self.directory.exists(capsule_id):
            return RecipeInfo.cut("this process has no input log for it (it came from a capsule file)")
        try:
            header, recipe = self.directory.recipe(capsule_id, self.directory.max_file_bytes)
        except CapsuleRosError as exc:
            return RecipeInfo.cut(f"this process has no input log for it, and its file's recipe cannot be read "
                                  f"({exc})")
        return recipe if recipe is not None else header.recipe

    def is_saving(self, capsule_id: str) -> bool:
        return capsule_id in self._jobs

    def cancel(self, capsule_id: str) -> None:
        """Under the boundary lock: the capsule is being dropped from disk; a save still
        writing it must not publish its file."""
        job = self._jobs.get(capsule_id)
        if job is not None:
            job.dropped = True

    @contextlib.contextmanager
    def _host_bytes(self, loan: Loan) -> Iterator[torch.Tensor]:
        if self._staging_lock is None:
            yield loan.host_bytes()
            return
        with self._staging_lock:
            yield loan.host_bytes(self._staging, self._stream)
