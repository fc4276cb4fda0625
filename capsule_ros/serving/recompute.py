"""The recompute fallback: rebuild a capsule's state when its bytes cannot be restored
(corrupt, truncated or missing file, wrong key), and the recipes saved capsules carry.

Every step's inputs (and the action it produced) go to the episode's input log, which
starts at a *log root*: a capsule of the state the log's first step was taken from (held
in memory while it is the root), made from an *origin* a recipe can name: the initial
state of an episode (its episode id, seed and token prefix) or another capsule's state
relabelled to an episode. The ledger remembers, for each capsule this process made, its
episode, step and the log generation it was made at.

Two ways to rebuild, tried in this order:

- **from the input log** (this process made the capsule and its step lies on the logged
  timeline): restore the root's bytes on a scratch runtime (a replica of the live one: same
  weights, own arena and graphs) and replay the logged inputs;
- **from the capsule file's recipe** (any capsule saved with one, also by an earlier run
  of the node): follow the recipe back to a state that can be had (``resolve_chain``: an
  initial state, a capsule in memory or in a file that verifies, or one made again from its
  own recipe) and replay it. Only under the same fingerprint: a capsule of another graph is
  never rebuilt silently (that is ``capsule-ros regenerate``, or the node's opt-in
  ``capsules.regenerate_stale``).

Steps are deterministic, so the result is bit-identical; a recipe's rebuild also checks
every action against the recorded one and refuses at the first that differs.

Phases, so the control loop keeps stepping during the long part: ``resolve`` outside the
session's boundary (file reads), ``begin_rebuild`` under it (check coverage, copy the
root's bytes and the rows, reserve room: a ``RebuildJob``), ``rebuild`` outside it,
``adopt`` under it again (the result becomes an in-memory capsule of the same id).
``unreserve`` returns the reserved room when the rebuild failed. The session runs the
phases (``SessionVerbs.reenter``); this module never takes the boundary.

Recipes for saved capsules: the logged rows and actions from the log root to the
capsule's step, bounded by ``capsules.recipe_max_mb``. ``recipe_for`` runs under the
boundary when a save begins and only counts (the size is known before anything is
copied); a recipe over the bound, or of a capsule the log no longer covers, is cut, and
the file says why. ``take_recipe`` copies the rows outside the boundary, while the control
loop steps on (it only ever appends after them), then checks that the log was not
rewritten below the capsule meanwhile (a rollback or a new timeline: then the recipe is
cut too): the copy of a long episode's rows costs the loop no wait at the boundary
(docs/benchmarks.md, "Persisting commits with recipes").
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from capsule_ros.capsules.recipe import Recipe, RecipeInfo, RecipeRoot
from capsule_ros.capsules.store import Capsule, CapsuleStore, Reservation
from capsule_ros.errors import (
    CapsuleIOError,
    CapsuleRosError,
    ConfigError,
    CorruptCapsule,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from capsule_ros.runtime.builder import replica_of
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.inputlog import InputLog
from capsule_ros.serving.recipes import RecipeChain, recipe_inputs, replay, start_from

LOG = logging.getLogger(__name__)
ROWS_PER_COPY = 1024          # rows copied per call outside the boundary: the loop's thread gets the
                              # interpreter lock back between them


@dataclass(frozen=True)
class PendingRecipe:
    """A recipe counted under the boundary whose rows are still in the input log
    (``Recompute.take_recipe`` copies them)."""

    info: RecipeInfo
    episode_id: int
    generation: int


# What a save writes as a capsule's recipe: one to copy from the log (PendingRecipe), only
# why there is none (a cut RecipeInfo), None (recipes are off), or KEEP_FILE_RECIPE (this
# process has no log of the capsule: keep the recipe its file has, if any).
# Errors of a capsule that cannot be restored from its bytes: re-entering it tries the fallback.
UNRESTORABLE = (CorruptCapsule, NotFound, FingerprintMismatch, CapsuleIOError, PermissionDenied, InvalidArgument)
KEEP_FILE_RECIPE = "keep the file's recipe"
RecipeCapture = Union[None, PendingRecipe, RecipeInfo, str]


@dataclass(frozen=True)
class LedgerEntry:
    """What the session knows of a capsule it made."""

    episode_id: int
    step: int
    generation: int


@dataclass(frozen=True)
class RebuildJob:
    """A rebuild begun under the lock (``begin_rebuild``), run outside it: where to start
    (an initial root, or a capsule's bytes), the recipes to replay, and what the rebuilt
    capsule will be."""

    capsule_id: str
    episode_id: int
    step: int
    start: Union[RecipeRoot, torch.Tensor]
    stages: Tuple[Recipe, ...]
    entry: Optional[LedgerEntry]             # from the input log: the ledger's entry
    label: str
    parent_id: str
    room: Optional[Reservation]              # room in the store for the rebuilt capsule
    source: str                              # "the input log" or "its recipe"

    @property
    def steps(self) -> int:
        return sum(stage.info.steps for stage in self.stages)


def check_log_size(log_steps: int, row_bytes: int, max_log_mb: float) -> None:
    """ConfigError when ``log_steps`` rows of ``row_bytes`` (one step's inputs) would take
    more than ``max_log_mb``; configure checks it from the layout, before any memory is used."""
    if log_steps * row_bytes > max_log_mb * 2**20:
        fits = int(max_log_mb * 2**20 // max(row_bytes, 1))
        raise ConfigError(f"control.input_log_steps = {log_steps}: the input log would take "
                          f"{log_steps * row_bytes / 2**20:,.0f} MiB ({row_bytes:,} bytes of inputs per step), "
                          f"over control.input_log_max_mb = {max_log_mb:g}; set input_log_steps to at most "
                          f"{fits} (0 turns the recompute fallback off) or raise the limit")


class Recompute:
    """The input log, the ledger, recipes and the rebuild (see the module docstring). Not
    thread-safe except ``rebuild``: callers hold the session's boundary lock."""

    def __init__(self, runtime: PolicyRuntime, store: CapsuleStore, log_steps: int, max_log_mb: float = 2048.0,
                 prefix: Sequence[int] = ()):
        """Raises ConfigError when ``log_steps`` of inputs would take more than
        ``max_log_mb`` (camera inputs make a step's row large: the default 20,000 steps of
        two 480 x 640 cameras would be 34 GiB). ``prefix``: the token prefix of every reset
        to the initial state (a recipe's root names it)."""
        self.runtime = runtime
        self.store = store
        self.prefix = tuple(prefix)
        row_bytes = runtime.input_staging.numel()
        check_log_size(log_steps, row_bytes, max_log_mb)
        self.log = InputLog(log_steps, row_bytes, runtime.policy.action_dim)
        self.inputs = recipe_inputs(runtime)
        self.root_id = ""
        self.origin: Optional[RecipeRoot] = None      # what the log root's state was made from
        self._ledger: Dict[str, LedgerEntry] = {}
        self._replica: Optional[PolicyRuntime] = None     # made on first use
        self._replica_lock = threading.Lock()

    # -- bookkeeping (under the lock) --------------------------------------------------------
    def remember(self, capsule: Capsule, like: Optional[str] = None) -> None:
        """A capsule made now of the live state (or a fork with the same state as ``like``)."""
        if like is not None:
            if like in self._ledger:
                self._ledger[capsule.id] = self._ledger[like]
            return
        self._ledger[capsule.id] = LedgerEntry(capsule.episode_id, capsule.step, self.log.generation)

    def knows(self, capsule_id: str) -> bool:
        """Whether the input log can rebuild the capsule now (a hint outside the lock: ``begin_rebuild`` decides)."""
        entry = self._ledger.get(capsule_id)
        return entry is not None and self.log.capacity > 0 and self.log.covers(
            entry.episode_id, entry.step, entry.generation) is None

    def forget(self, capsule_id: str) -> None:
        """The capsule is gone for good: nothing may bring it back."""
        self._ledger.pop(capsule_id, None)

    def start(self, root: Capsule, origin: Optional[RecipeRoot] = None) -> None:
        """A new log root: the log restarts at ``root``'s state (held while it is the root).
        ``origin``: what that state was made from; default: an episode's start, made from the
        initial state (``root.parent_id`` empty) or from the capsule ``root.parent_id``."""
        if self.root_id and self.root_id != root.id:
            self.store.hold(self.root_id, False)
        self.store.hold(root.id)
        self.root_id = root.id
        if origin is None:
            origin = (RecipeRoot.initial(root.episode_id, self.runtime.config.seed, self.prefix) if not root.parent_id
                      else RecipeRoot.capsule(root.parent_id, self.store.fingerprint, root.episode_id))
        self.origin = origin
        self.log.start(root.episode_id, root.step)
        self._ledger[root.id] = LedgerEntry(root.episode_id, root.step, self.log.generation)

    def resumed_at(self, capsule: Capsule) -> None:
        """The live state became ``capsule``'s: continue its logged timeline when the log
        covers it (a rollback truncates the log there), else start a new log at it."""
        entry = self._ledger.get(capsule.id)
        if entry is not None and self.log.covers(entry.episode_id, entry.step, entry.generation) is None:
            self.log.truncate(capsule.step)
        else:
            self.start(capsule, RecipeRoot.capsule(capsule.id, capsule.fingerprint, capsule.episode_id))

    def log_step(self, step: int, row: Optional[np.ndarray], action: Optional[np.ndarray] = None) -> None:
        """The inputs of the step just taken from state ``step`` (None: it read none) and its action."""
        self.log.append(step, row, action)

    # -- recipes (under the lock) -----------------------------------------------------------------
    def recipe_for(self, capsule: Capsule) -> RecipeCapture:
        """Under the lock: what a save of ``capsule`` writes as its recipe
        (``RecipeCapture``): counted now, at most ``capsules.recipe_max_mb``, its rows copied
        later (``take_recipe``)."""
        config = self.store.config
        if not config.recipe:
            return None
        entry = self._ledger.get(capsule.id)
        origin = self.origin
        if entry is None or (origin is not None and origin.capsule_id == capsule.id):
            return KEEP_FILE_RECIPE        # not made here, or the log starts at it: its own file knows more
        reason = self._log_reason(entry)
        if reason is not None:
            return RecipeInfo.cut(f"the input log did not cover it when it was saved: {reason}")
        info = self._log_recipe_info(entry.step)
        bound = int(config.recipe_max_mb * 2**20)
        if info.data_bytes > bound:
            return RecipeInfo.cut(f"its recipe would take {info.data_bytes:,} bytes ({info.steps} steps, {info.rows} "
                                  f"input rows of {info.row_bytes:,} bytes), over capsules.recipe_max_mb = "
                                  f"{config.recipe_max_mb:g} ({bound:,} bytes)", info.root, info.base_step,
                                  info.steps, info.rows, info.row_bytes, info.action_dim, info.inputs)
        return PendingRecipe(info, entry.episode_id, entry.generation)

    def take_recipe(self, pending: PendingRecipe, into: bytearray) -> Union[Recipe, RecipeInfo]:
        """Outside the lock (a save's file work): copy the recipe's mask, actions and rows
        from the input log straight into its binary part, a slice at a time, then check the
        log was not rewritten below the capsule meanwhile; a cut recipe if it was. ``into``:
        the caller's buffer, at least ``pending.info.data_bytes`` long (the recipe views it:
        it is valid until the caller reuses the buffer)."""
        info, log = pending.info, self.log
        steps, step = info.steps, info.step
        buffer = memoryview(into)[:info.data_bytes]
        mask_bytes, action_bytes = -(-steps // 8), steps * info.action_dim * 4
        try:
            if log.rewritten_below(step, pending.generation):
                raise ValueError("rewritten")
            reads = log.reads(step)
            packed = np.packbits(reads, bitorder="little")
            if packed.size != mask_bytes:
                raise ValueError("rewritten")
            buffer[:mask_bytes] = packed.tobytes()
            actions = np.frombuffer(buffer, dtype="<f4", count=steps * info.action_dim, offset=mask_bytes)
            actions[:] = log.actions(step).reshape(-1)
            rows = np.frombuffer(buffer, dtype=np.uint8, offset=mask_bytes + action_bytes).reshape(info.rows,
                                                                                                    info.row_bytes)
            logged, done = log.rows(step), 0
            for start in range(0, steps, ROWS_PER_COPY):
                part = reads[start:start + ROWS_PER_COPY]
                count = int(np.count_nonzero(part))
                np.compress(part, logged[start:start + ROWS_PER_COPY], axis=0, out=rows[done:done + count])
                done += count
            if done != info.rows or log.rewritten_below(step, pending.generation):
                raise ValueError("rewritten")
        except (ValueError, IndexError):      # the log moved under the copy: its shapes no longer fit
            return RecipeInfo.cut("the episode's input log was rewritten below the capsule (a rollback or a new "
                                  "episode) while it was being saved", info.root, info.base_step, info.steps, info.rows,
                                  info.row_bytes, info.action_dim, info.inputs)
        return Recipe.from_bytes(info, buffer)

    def _log_reason(self, entry: LedgerEntry) -> Optional[str]:
        """Why the input log cannot give the recipe of a capsule of ``entry`` (None: it can)."""
        if self.log.capacity == 0:
            return "control.input_log_steps is 0"
        return self.log.covers(entry.episode_id, entry.step, entry.generation)

    def _log_recipe_info(self, step: int) -> RecipeInfo:
        steps = step - self.log.base_step
        rows = int(np.count_nonzero(self.log.reads(step)))
        return RecipeInfo(True, "", self.origin, self.log.base_step, steps, rows, self.log.rows(step).shape[1],
                          self.runtime.policy.action_dim, self.inputs)

    def _log_recipe(self, info: RecipeInfo) -> Recipe:
        """Under the lock: the log's recipe up to ``info.step``, copies of its read mask,
        rows and actions (a rebuild job's)."""
        reads = self.log.reads(info.step).copy()
        return Recipe(info, reads, self.log.rows(info.step)[reads], self.log.actions(info.step).copy())

    # -- the fallback ----------------------------------------------------------------------------
    def begin_rebuild(self, capsule_id: str, cause: CapsuleRosError,
                      chain: Optional[RecipeChain] = None) -> RebuildJob:
        """Under the lock: a job to rebuild the capsule from the input log, else from
        ``chain`` (its file's recipe, resolved outside the lock); else re-raise ``cause``
        with the reasons."""
        entry = self._ledger.get(capsule_id)
        reason = ("this process did not make the capsule, so it has no input log for it" if entry is None
                  else self._log_reason(entry))
        root = self.store.find(self.root_id)
        if reason is None and (root is None or root.payload is None):
            reason = f"the log root {self.root_id!r} is no longer in memory"
        if reason is None and entry is not None:
            known = self.store.find(capsule_id)
            with self.store.lend(self.root_id) as loan:
                root_bytes = loan.copy()
            return RebuildJob(capsule_id, entry.episode_id, entry.step, root_bytes,
                               (self._log_recipe(self._log_recipe_info(entry.step)),), entry,
                               "rebuilt by recompute", self.root_id, self._room_for(known), "the input log")
        if chain is not None and not chain.reason:
            start = chain.start
            if isinstance(start, str):               # a root in memory: its bytes now (it may have left meanwhile)
                held = self.store.find(start)
                if held is None or held.payload is None:
                    raise type(cause)(f"{cause}; no recompute fallback: {reason}; and the root {start} of its "
                                      "recipe left memory") from cause
                with self.store.lend(start) as loan:
                    start = loan.copy()
            assert start is not None
            return RebuildJob(capsule_id, chain.episode_id, chain.step, start, chain.stages, None, chain.label,
                               chain.parent_id, self._room_for(self.store.find(capsule_id)), "its recipe")
        if chain is not None:
            reason = f"{reason}; and from its file: {chain.reason}"
        raise type(cause)(f"{cause}; no recompute fallback: {reason}") from cause

    def _room_for(self, known: Optional[Capsule]) -> Optional[Reservation]:
        return self.store.reserve() if known is None or known.payload is None else None

    def rebuild(self, job: RebuildJob) -> float:
        """Outside the lock: make the state again on the replica; the seconds it took.
        Raises CorruptCapsule (RecipeMismatch) when the replay does not follow the recipe or
        does not reach the capsule's step."""
        start = time.perf_counter()
        with self._replica_lock:
            replica = self._replica_runtime()
            start_from(replica, job.start)
            for stage in job.stages:
                replay(replica, stage, expect_actions=True)
            rebuilt_step = replica.read_outputs().step
        if rebuilt_step != job.step:
            raise CorruptCapsule(f"recompute reached step {rebuilt_step}, expected {job.step}")
        return time.perf_counter() - start

    def adopt(self, capsule_id: str, job: RebuildJob, cause: CapsuleRosError, seconds: float) -> Capsule:
        """Under the lock: the rebuilt state as an in-memory capsule of the same id."""
        known = self.store.find(capsule_id)
        if known is not None and known.payload is not None:        # reappeared in memory meanwhile
            self.unreserve(job)
            capsule = known
        else:
            if known is not None:
                self.store.drop(capsule_id)        # its file is bad: forget the disk-only entry
            with self._replica_lock:
                replica = self._replica_runtime()
                capsule = self.store.snapshot(replica, label=job.label, parent_id=job.parent_id,
                                              episode_id=job.episode_id, step=job.step,
                                              capsule_id=capsule_id, into=job.room)
                replica.synchronize()
        if job.entry is not None:
            self._ledger[capsule.id] = job.entry
        LOG.warning("capsule %s rebuilt from %s by recomputing %d steps in %.1f ms (%s)", capsule_id, job.source,
                    job.steps, seconds * 1e3, cause)
        return capsule

    def unreserve(self, job: RebuildJob) -> None:
        """Under the lock: return the job's reserved room (the rebuild failed or was not needed)."""
        if job.room is not None:
            job.room.release()

    def close(self) -> None:
        """Release the replica runtime (if one was made) and forget the log and ledger."""
        with self._replica_lock:
            if self._replica is not None:
                self._replica.close()
                self._replica = None
        self._ledger.clear()

    def _replica_runtime(self) -> PolicyRuntime:
        if self._replica is None:
            self._replica = replica_of(self.runtime)
        return self._replica
