"""The recompute fallback: rebuild a capsule's state from the input log when its bytes
cannot be restored (corrupt or missing file, wrong key, foreign fingerprint).

Every step's inputs go to the episode's input log, which starts at a *log root*: a
capsule of the state the log's first step was taken from (held in memory while it is
the root). The ledger remembers, for each capsule this process made, its episode, step
and the log generation it was made at. A capsule whose step lies on the logged timeline
is rebuilt by restoring the root's bytes on a scratch runtime (a replica of the live
one: same weights, own arena and graphs) and replaying the logged inputs: steps are
deterministic, so the result is bit-identical.

Three phases, so the control loop keeps stepping during the long part: ``plan`` under
the session's boundary lock (check coverage, copy the root's bytes and the rows, reserve
room), ``rebuild`` outside it, ``adopt`` under it again (the result becomes an in-memory
capsule of the same id). ``unreserve`` returns the reserved room when the rebuild failed.
The session runs the phases (``PolicySession.reenter``); this module never takes the lock.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch

from capsule_ros.capsules.store import Capsule, CapsuleStore, Reservation
from capsule_ros.errors import CapsuleRosError, ConfigError, CorruptCapsule
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.inputlog import InputLog

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerEntry:
    """What the session knows of a capsule it made."""

    episode_id: int
    step: int
    generation: int


@dataclass(frozen=True)
class RebuildPlan:
    """What a rebuild needs, taken under the lock."""

    entry: LedgerEntry
    root_id: str
    root_bytes: torch.Tensor
    rows: np.ndarray
    room: Optional[Reservation]              # room in the store for the rebuilt capsule


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
    """The input log, the ledger and the rebuild (see the module docstring). Not
    thread-safe except ``rebuild``: callers hold the session's boundary lock."""

    def __init__(self, runtime: PolicyRuntime, store: CapsuleStore, log_steps: int, max_log_mb: float = 2048.0):
        """Raises ConfigError when ``log_steps`` of inputs would take more than
        ``max_log_mb`` (camera inputs make a step's row large: the default 20,000 steps of
        two 480 x 640 cameras would be 34 GiB)."""
        self.runtime = runtime
        self.store = store
        row_bytes = runtime.input_staging.numel()
        check_log_size(log_steps, row_bytes, max_log_mb)
        self.log = InputLog(log_steps, row_bytes)
        self.root_id = ""
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

    def forget(self, capsule_id: str) -> None:
        """The capsule is gone for good: nothing may bring it back."""
        self._ledger.pop(capsule_id, None)

    def start(self, root: Capsule) -> None:
        """A new log root: the log restarts at ``root``'s state (held while it is the root)."""
        if self.root_id and self.root_id != root.id:
            self.store.hold(self.root_id, False)
        self.store.hold(root.id)
        self.root_id = root.id
        self.log.start(root.episode_id, root.step)
        self._ledger[root.id] = LedgerEntry(root.episode_id, root.step, self.log.generation)

    def resumed_at(self, capsule: Capsule) -> None:
        """The live state became ``capsule``'s: continue its logged timeline when the log
        covers it (a rollback truncates the log there), else start a new log at it."""
        entry = self._ledger.get(capsule.id)
        if entry is not None and self.log.covers(entry.episode_id, entry.step, entry.generation) is None:
            self.log.truncate(capsule.step)
        else:
            self.start(capsule)

    def log_step(self, step: int, row: Optional[np.ndarray]) -> None:
        """The inputs of the step just taken from state ``step`` (None: it read none)."""
        self.log.append(step, row)

    # -- the fallback ----------------------------------------------------------------------------
    def plan(self, capsule_id: str, cause: CapsuleRosError) -> RebuildPlan:
        """Under the lock: check the log can rebuild the capsule (else re-raise ``cause``
        with the reason) and take what the rebuild needs."""
        entry = self._ledger.get(capsule_id)
        reason: Optional[str]
        if entry is None:
            reason = "this process did not make the capsule, so it has no input log for it"
        elif self.log.capacity == 0:
            reason = "control.input_log_steps is 0"
        else:
            reason = self.log.covers(entry.episode_id, entry.step, entry.generation)
        root = self.store.find(self.root_id)
        if reason is None and (root is None or root.payload is None):
            reason = f"the log root {self.root_id!r} is no longer in memory"
        if reason is not None or entry is None:
            raise type(cause)(f"{cause}; no recompute fallback: {reason}") from cause
        known = self.store.find(capsule_id)
        room = self.store.reserve() if known is None or known.payload is None else None
        with self.store.lend(self.root_id) as loan:
            root_bytes = loan.copy()
        return RebuildPlan(entry, self.root_id, root_bytes, self.log.rows(entry.step).copy(), room)

    def rebuild(self, plan: RebuildPlan) -> float:
        """Outside the lock: replay the logged inputs from the root on the replica; the
        seconds it took. Raises CorruptCapsule when it does not reach the capsule's step."""
        start = time.perf_counter()
        with self._replica_lock:
            replica = self._replica_runtime()
            replica.load_state(plan.root_bytes)
            rows = torch.from_numpy(plan.rows).to(replica.device)   # every logged input, uploaded once
            for row in rows:
                replica.load_inputs(row)
                replica.step()
            rebuilt_step = replica.read_outputs().step
        if rebuilt_step != plan.entry.step:
            raise CorruptCapsule(f"recompute reached step {rebuilt_step}, expected {plan.entry.step}")
        return time.perf_counter() - start

    def adopt(self, capsule_id: str, plan: RebuildPlan, cause: CapsuleRosError, seconds: float) -> Capsule:
        """Under the lock: the rebuilt state as an in-memory capsule of the same id."""
        known = self.store.find(capsule_id)
        if known is not None and known.payload is not None:        # reappeared in memory meanwhile
            self.unreserve(plan)
            capsule = known
        else:
            if known is not None:
                self.store.drop(capsule_id)        # its file is bad: forget the disk-only entry
            with self._replica_lock:
                replica = self._replica_runtime()
                capsule = self.store.snapshot(replica, label="rebuilt by recompute", parent_id=plan.root_id,
                                              episode_id=plan.entry.episode_id, step=plan.entry.step,
                                              capsule_id=capsule_id, into=plan.room)
                replica.synchronize()
        self._ledger[capsule.id] = plan.entry
        LOG.warning("capsule %s rebuilt by recomputing %d steps in %.1f ms (%s)", capsule_id, len(plan.rows),
                    seconds * 1e3, cause)
        return capsule

    def unreserve(self, plan: RebuildPlan) -> None:
        """Under the lock: return the plan's reserved room (the rebuild failed or was not needed)."""
        if plan.room is not None:
            plan.room.release()

    def close(self) -> None:
        """Release the replica runtime (if one was made) and forget the log and ledger."""
        with self._replica_lock:
            if self._replica is not None:
                self._replica.close()
                self._replica = None
        self._ledger.clear()

    def _replica_runtime(self) -> PolicyRuntime:
        if self._replica is None:
            self._replica = self.runtime.replica()
        return self._replica
