"""PolicySession: the episode state machine over one runtime and one capsule store.

This is everything the node does, without ROS: ``capsule_ros.ros`` maps topics and
services onto it, and ``capsule-ros replay --in-process`` and the demo drive it
directly. Policy, not mechanism: the runtime and the store provide verbs (step,
snapshot, restore, fork); the session decides when to use them.

Episode states: IDLE (no episode), RUNNING (each tick steps the policy), INTERRUPTED
(each tick publishes the safe action; the state waits at its boundary).

Concurrency: one boundary lock. ``tick`` holds it for exactly one step; every other verb
takes it between steps, so a state change is never applied during a step and a service
never waits behind more than one step (it gives up with BUSY after
``control.service_timeout_ms``). Sensor callbacks write the input staging area under a
separate, short staging lock, so they never wait for a step either.

Recompute fallback: every step's inputs go to the episode's input log. When a capsule
cannot be restored (corrupt or missing file, wrong key, foreign fingerprint) but its
step lies on the logged timeline, the state is rebuilt by restoring the timeline's root
and replaying the logged inputs: deterministic steps make the result bit-identical.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from capsule_ros.capsules.ids import check_capsule_id, new_capsule_id
from capsule_ros.capsules.store import Capsule, CapsuleStore, Tier
from capsule_ros.errors import (Busy, CapsuleIOError, CapsuleRosError, CorruptCapsule, FingerprintMismatch,
                                InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, WrongState)
from capsule_ros.metrics import LatencyWindow
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.config import ControlConfig
from capsule_ros.serving.inputlog import InputLog

LOG = logging.getLogger(__name__)
MAX_LABEL = 256


class EpisodeState(enum.IntEnum):
    """Values match RuntimeStatus.IDLE / RUNNING / INTERRUPTED."""

    IDLE = 0
    RUNNING = 1
    INTERRUPTED = 2


class HoldMode(enum.IntEnum):
    """Values match Interrupt.Request.HOLD_*."""

    HOLD_LAST = 0
    HOLD_ZERO = 1
    HOLD_SILENT = 2


class ActionSource(enum.IntEnum):
    """Values match Action.SOURCE_*."""

    POLICY = 0
    HOLD = 1
    ZERO = 2


class EventKind(enum.IntEnum):
    """Values match CapsuleEvent constants."""

    COMMIT = 0
    INTERRUPT = 1
    REENTER = 2
    RESET = 3
    FORK = 4
    DROP = 5
    SAVE = 6
    LOAD = 7
    EVICT = 8


@dataclass(frozen=True)
class ActionRecord:
    """One tick's command."""

    values: np.ndarray
    chunk: Optional[np.ndarray]        # [H, A] for policy actions, None for safe actions
    source: ActionSource
    episode_id: int
    step: int                          # the state's step counter after this tick
    lineage: str
    stamp_ns: int
    step_seconds: float = 0.0
    late: bool = False                 # the step missed its deadline: values are the safe action


@dataclass(frozen=True)
class CapsuleEvent:
    kind: EventKind
    capsule_id: str
    parent_id: str
    episode_id: int
    step: int
    rollback: bool = False
    fallback: bool = False
    detail: str = ""


@dataclass(frozen=True)
class ReenterResult:
    capsule: Optional[Capsule]         # None when resuming an interrupt without a capsule
    rollback: bool
    fallback: bool
    fallback_reason: str
    restore_seconds: float
    recompute_seconds: float


@dataclass
class SessionCounters:
    steps: int = 0
    deadline_misses: int = 0
    fallback_recomputes: int = 0
    ticks_waiting_for_inputs: int = 0


@dataclass(frozen=True)
class _LedgerEntry:
    """What the session knows of a capsule it made, for the recompute fallback."""

    episode_id: int
    step: int
    generation: int


@dataclass(frozen=True)
class _Rebuild:
    """What a recompute needs, taken under the lock."""

    entry: _LedgerEntry
    root_id: str
    root_bytes: "torch.Tensor"
    rows: np.ndarray
    room: Optional[Any]                  # a store reservation for the rebuilt capsule


@dataclass
class _Timeline:
    """The current episode timeline: where the input log starts."""

    root_id: str = ""


class PolicySession:
    """See the module docstring."""

    def __init__(self, runtime: PolicyRuntime, store: CapsuleStore, control: ControlConfig, *,
                 directory=None, prefix: Sequence[int] = (),
                 on_event: Optional[Callable[[CapsuleEvent], None]] = None,
                 clock_ns: Callable[[], int] = time.time_ns, enforce_deadline: bool = True):
        self.runtime = runtime
        self.store = store
        self.control = control
        self.directory = directory
        self.prefix = tuple(prefix)
        self.on_event = on_event
        self.clock_ns = clock_ns
        self.enforce_deadline = enforce_deadline   # False when a watchdog (the node) enforces it
        self.state = EpisodeState.IDLE
        self.episode_id = 0
        self.step = 0
        self.lineage = ""
        self.hold_mode = HoldMode.HOLD_LAST
        self.interrupt_capsule_id = ""
        self.counters = SessionCounters()
        self.step_latency = LatencyWindow()
        self.staging_lock = threading.Lock()
        self._boundary = threading.Lock()
        self._next_episode = 1
        self._last_applied = np.zeros(runtime.policy.action_dim, dtype=np.float32)
        self._ledger: Dict[str, _LedgerEntry] = {}
        self._timeline = _Timeline()
        self._scratch: Optional[PolicyRuntime] = None     # second arena for recompute rebuilds
        self._scratch_lock = threading.Lock()
        self._inputs_seen: set = set()
        self._input_names = tuple(runtime.staging)
        row_bytes = runtime.input_staging.numel()
        self.input_log = InputLog(control.input_log_steps, row_bytes)
        store.on_evict = self._on_evict

    # -- boundary ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def at_boundary(self, timeout_s: Optional[float] = None) -> Iterator[None]:
        """Hold the boundary lock (between steps); BUSY if no boundary comes in time."""
        timeout = self.control.service_timeout_ms / 1e3 if timeout_s is None else timeout_s
        if not self._boundary.acquire(timeout=timeout):
            raise Busy(f"no step boundary within {timeout * 1e3:.0f} ms")
        try:
            yield
        finally:
            self._boundary.release()

    # -- inputs -----------------------------------------------------------------------------
    def write_input(self, name: str, values: np.ndarray) -> None:
        """Copy a port's values into its staging buffer (shape already checked by the port)."""
        staging = self.runtime.staging[name]
        with self.staging_lock:
            np.copyto(staging, values.reshape(staging.shape), casting="unsafe")
            self._inputs_seen.add(name)

    @property
    def inputs_ready(self) -> bool:
        return len(self._inputs_seen) == len(self._input_names)

    @property
    def timeline_root_id(self) -> str:
        """The capsule the current timeline's input log starts from (held while it is)."""
        return self._timeline.root_id

    @property
    def inputs_seen(self) -> frozenset:
        """Names of the inputs that received at least one value."""
        return frozenset(self._inputs_seen)

    # -- control loop -------------------------------------------------------------------------
    def tick(self, stamp_ns: Optional[int] = None) -> Optional[ActionRecord]:
        """One control period. RUNNING: step the policy on the staged inputs; INTERRUPTED:
        the safe action of the hold mode (None when silent); IDLE or inputs missing: None."""
        stamp_ns = self.clock_ns() if stamp_ns is None else stamp_ns
        with self._boundary:
            if self.state == EpisodeState.INTERRUPTED:
                return self.safe_record(self.hold_mode, stamp_ns)
            if self.state != EpisodeState.RUNNING:
                return None
            if not self.inputs_ready:
                self.counters.ticks_waiting_for_inputs += 1
                return None
            start = time.perf_counter()
            with self.staging_lock:        # held until the outputs are read: the input copy may be async
                self.runtime.load_inputs()
                self.input_log.append(self.step, self.runtime.input_staging.numpy())
                self.runtime.step()
                out = self.runtime.read_outputs()
            seconds = time.perf_counter() - start
            self.step_latency.record(seconds)
            self.counters.steps += 1
            self.step = out.step
            deadline = self.control.effective_deadline_s() if self.enforce_deadline else None
            if deadline is not None and seconds > deadline:
                self.counters.deadline_misses += 1
                mode = HoldMode.HOLD_ZERO if self.control.deadline_action == "zero" else HoldMode.HOLD_LAST
                record = self.safe_record(mode, stamp_ns)
                return ActionRecord(record.values, None, record.source, self.episode_id, self.step, self.lineage,
                                    stamp_ns, seconds, late=True)
            self._last_applied = out.action
            return ActionRecord(out.action, out.chunk, ActionSource.POLICY, self.episode_id, self.step,
                                self.lineage, stamp_ns, seconds)

    def safe_action(self, mode: HoldMode) -> Optional[np.ndarray]:
        """The values of a safe action (hold the last applied action, or zeros)."""
        if mode == HoldMode.HOLD_SILENT:
            return None
        if mode == HoldMode.HOLD_ZERO:
            return np.zeros_like(self._last_applied)
        return self._last_applied.copy()

    def safe_record(self, mode: HoldMode, stamp_ns: Optional[int] = None) -> Optional[ActionRecord]:
        """The safe action as a record (None when silent)."""
        stamp_ns = self.clock_ns() if stamp_ns is None else stamp_ns
        values = self.safe_action(mode)
        if values is None:
            return None
        source = ActionSource.ZERO if mode == HoldMode.HOLD_ZERO else ActionSource.HOLD
        return ActionRecord(values, None, source, self.episode_id, self.step, self.lineage, stamp_ns)

    # -- verbs ---------------------------------------------------------------------------------
    # File I/O (save, load, reading a capsule that is only on disk) happens outside the
    # boundary lock, so a large capsule never stalls the control loop; only the store and
    # the arena are touched under it.

    def commit(self, label: str = "", persist: bool = False, pin: bool = False) -> Capsule:
        """Snapshot the whole state at this boundary into a new capsule (and save it).

        With ``persist`` the boundary's bytes are copied to the host and saved first; the
        capsule enters the store only once its file is written, so a failed save leaves
        the store exactly as it was."""
        _check_label(label)
        if not persist:
            with self.at_boundary():
                self._require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="commit")
                capsule = self._snapshot(label, pinned=pin)
                self.lineage = capsule.id
                self._emit(EventKind.COMMIT, capsule, detail=label)
                return capsule
        self._require_directory()
        with self.at_boundary():
            self._require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="commit")
            if not self.store.room_for(1):
                self.store.reserve()                 # raises ResourceExhausted: nothing written yet
            self.runtime.synchronize()
            data = self.runtime.arena.storage.to("cpu", copy=True)
            capsule = Capsule(new_capsule_id(self.episode_id, self.step), label, self.lineage, self.episode_id,
                              self.step, self.store.nbytes, self.store.fingerprint, time.time_ns(), pinned=pin)
            entry = _LedgerEntry(self.episode_id, self.step, self.input_log.generation)
            boundary = (self.episode_id, self.lineage)
        capsule.path = str(self.directory.save(capsule, data, self.runtime.layout.schema()))
        with self.at_boundary():
            try:
                capsule = self.store.adopt(capsule, data)
            except CapsuleRosError:                  # the store filled up meanwhile: undo the file
                self.directory.remove(capsule.id)
                raise
            self._ledger[capsule.id] = entry
            if (self.episode_id, self.lineage) == boundary:   # nothing re-based the state meanwhile
                self.lineage = capsule.id
            self._emit(EventKind.COMMIT, capsule, detail=label)
            return capsule

    def reset(self, capsule_id: str = "") -> Tuple[int, Optional[Capsule]]:
        """Start a new episode from the initial state or from a capsule's state."""
        fetched = self._prefetch(check_capsule_id(capsule_id)) if capsule_id else None
        with self.at_boundary():
            known = self.store.find(capsule_id) if capsule_id else None
            in_memory = known is not None and known.payload is not None
            if capsule_id and not in_memory and isinstance(fetched, Exception):
                self._materialize(capsule_id, fetched)       # raises the typed error, nothing changed
            if capsule_id and not in_memory and fetched is None:   # evicted since the prefetch: read it now
                fetched = self._prefetch(capsule_id, force=True)
                if isinstance(fetched, Exception):
                    self._materialize(capsule_id, fetched)
            source = known if in_memory else (fetched[0] if capsule_id else None)
            room = self._room_for_root(source, None if in_memory else (fetched[1] if capsule_id else None))
            episode = self._next_episode
            self._next_episode += 1
            if source is None:
                self.runtime.reset(episode=episode)
                if self.prefix:
                    self.runtime.prefill(self.prefix)
                step, lineage = self._read_step(), ""
            else:
                self.runtime.set_episode(episode)
                step, lineage = source.step, source.id
            self._last_applied = self.runtime.read_outputs().action
            self.episode_id, self.step, self.lineage = episode, step, lineage
            self._release_interrupt_capsule()
            root = self.store.snapshot(self.runtime, label=f"episode {episode} start", parent_id=lineage,
                                       episode_id=episode, step=step, held=True, reserved=room)
            self._start_timeline(root)
            self.state = EpisodeState.RUNNING
            self._emit(EventKind.RESET, source, detail=f"episode {episode}")
            return episode, source

    def interrupt(self, hold_mode: int = HoldMode.HOLD_LAST, commit: bool = True) -> Optional[Capsule]:
        """Stop acting at this boundary; optionally commit the boundary capsule."""
        try:
            mode = HoldMode(hold_mode)
        except ValueError:
            raise InvalidArgument(f"hold_mode {hold_mode!r}: must be one of {[m.value for m in HoldMode]}") from None
        with self.at_boundary():
            self._require(EpisodeState.RUNNING, verb="interrupt")
            capsule = None
            self._release_interrupt_capsule()
            if commit:
                capsule = self._snapshot("interrupt", held=True)
                self.interrupt_capsule_id = capsule.id
                self.lineage = capsule.id
            self.hold_mode = mode
            self.state = EpisodeState.INTERRUPTED
            self._emit(EventKind.INTERRUPT, capsule, detail=mode.name)
            return capsule

    def reenter(self, capsule_id: str = "") -> ReenterResult:
        """Restore a capsule and resume (see the module docstring for the fallback).

        A fallback rebuild runs on a scratch runtime outside the boundary lock (the control
        loop keeps stepping meanwhile); its result is then restored at the next boundary."""
        fetched = self._prefetch(check_capsule_id(capsule_id)) if capsule_id else None
        with self.at_boundary():
            if not capsule_id:
                if self.interrupt_capsule_id:
                    capsule_id = self.interrupt_capsule_id
                elif self.state == EpisodeState.INTERRUPTED:
                    self.state = EpisodeState.RUNNING     # no capsule: resume the untouched live state
                    self._emit(EventKind.REENTER, None, detail="resume")
                    return ReenterResult(None, False, False, "", 0.0, 0.0)
                else:
                    raise WrongState(f"reenter without a capsule id needs an interrupt capsule "
                                     f"(episode is {self.state.name})")
            try:
                capsule, from_disk = self._materialize(capsule_id, fetched)
                restore_s = self.store.restore(capsule.id, self.runtime,
                                               count_as=Tier.DISK if from_disk else None).seconds
                return self._resume(capsule, "", restore_s, 0.0)
            except (CorruptCapsule, NotFound, FingerprintMismatch, CapsuleIOError, PermissionDenied,
                    InvalidArgument) as exc:
                cause = exc
                plan = self._plan_rebuild(capsule_id, exc)
        start = time.perf_counter()
        try:
            self._rebuild(plan)
        except BaseException:
            if plan.room is not None:
                with self.at_boundary():
                    self.store.release(plan.room)
            raise
        recompute_s = time.perf_counter() - start
        with self.at_boundary():
            capsule = self._adopt_rebuilt(capsule_id, plan, cause, recompute_s)
            self.store.restore(capsule.id, self.runtime)
            return self._resume(capsule, str(cause), 0.0, recompute_s)

    def _resume(self, capsule: Capsule, fallback_reason: str, restore_s: float,
                recompute_s: float) -> ReenterResult:
        """After the live state became ``capsule``'s (under the lock): timeline, state, event."""
        entry = self._ledger.get(capsule.id)
        rollback = capsule.episode_id == self.episode_id and capsule.step < self.step
        self._release_interrupt_capsule()      # a later reenter("") needs a new interrupt
        if entry is not None and self.input_log.covers(entry.episode_id, entry.step, entry.generation) is None:
            self.input_log.truncate(capsule.step)
        else:
            self.store.set_held(capsule.id, True)
            self._start_timeline(capsule)
        self._last_applied = self.runtime.read_outputs().action    # HOLD_LAST holds the capsule's action
        self.episode_id, self.step, self.lineage = capsule.episode_id, capsule.step, capsule.id
        self._next_episode = max(self._next_episode, capsule.episode_id + 1)
        self.state = EpisodeState.RUNNING
        self._emit(EventKind.REENTER, capsule, rollback=rollback, fallback=bool(fallback_reason),
                   detail=fallback_reason)
        return ReenterResult(capsule, rollback, bool(fallback_reason), fallback_reason, restore_s, recompute_s)

    def fork(self, capsule_id: str = "", label: str = "") -> Capsule:
        """A new capsule id with the same state ("" = the live state at this boundary)."""
        _check_label(label)
        fetched = self._prefetch(check_capsule_id(capsule_id)) if capsule_id else None
        with self.at_boundary():
            if not capsule_id:
                self._require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="fork the live state")
                capsule = self._snapshot(label)
            else:
                source, _ = self._materialize(capsule_id, fetched)
                capsule = self.store.fork(source.id, label=label)
                if source.id in self._ledger:
                    self._ledger[capsule.id] = self._ledger[source.id]
            self._emit(EventKind.FORK, capsule, detail=label)
            return capsule

    def list_capsules(self, current_episode_only: bool = False) -> List[Capsule]:
        """Capsules in memory and in the capsule directory, newest first."""
        with self.at_boundary():
            capsules = {c.id: c for c in self.store.list()}
            episode = self.episode_id
        if self.directory is not None:
            for capsule_id in self.directory.ids():
                if capsule_id not in capsules:
                    with contextlib.suppress(CapsuleRosError):
                        capsules[capsule_id] = self.directory.describe(capsule_id)
        out = sorted(capsules.values(), key=lambda c: c.stamp_ns, reverse=True)
        return [c for c in out if c.episode_id == episode] if current_episode_only else out

    def drop(self, capsule_id: str, from_disk: bool = False) -> None:
        check_capsule_id(capsule_id)
        with self.at_boundary():
            if self.state == EpisodeState.INTERRUPTED and capsule_id == self.interrupt_capsule_id:
                raise WrongState(f"capsule {capsule_id!r} is the interrupt capsule: re-enter or reset first")
            on_disk = from_disk and self.directory is not None and self.directory.exists(capsule_id)
            if capsule_id not in self.store and not on_disk:
                raise NotFound(f"no capsule {capsule_id!r}" + (" in memory or on disk" if from_disk else " in memory"))
            capsule = self.store.drop(capsule_id) if capsule_id in self.store else None
            if on_disk:
                self.directory.remove(capsule_id)
            if self.directory is None or not self.directory.exists(capsule_id):
                self._ledger.pop(capsule_id, None)    # gone for good: no recompute brings it back
            if capsule_id == self.interrupt_capsule_id:
                self.interrupt_capsule_id = ""
            self._emit(EventKind.DROP, capsule, capsule_id=capsule_id, detail="memory and disk" if on_disk else "memory")

    def save(self, capsule_id: str) -> Capsule:
        """Write a capsule to the capsule directory (atomic, verified)."""
        check_capsule_id(capsule_id)
        self._require_directory()
        with self.at_boundary():
            capsule = self._known(capsule_id)
            if capsule.payload is None:
                raise NotFound(f"capsule {capsule_id!r} is only on disk already ({capsule.path})")
            data = self.store.host_copy(capsule_id)
        path = self.directory.save(capsule, data, self.runtime.layout.schema())
        with self.at_boundary():
            capsule.path = str(path)
            self._emit(EventKind.SAVE, capsule, detail=capsule.path)
        return capsule

    def load(self, capsule_id: str) -> Capsule:
        """Read and verify a capsule file into memory (the live state is not touched)."""
        self._require_directory()
        fetched = self._prefetch(check_capsule_id(capsule_id), force=True)
        if isinstance(fetched, Exception):          # the file itself is bad: say so, even if in memory
            if isinstance(fetched, FingerprintMismatch):
                with self.at_boundary():
                    self.store.counters.invalidations += 1
            raise fetched
        with self.at_boundary():
            capsule, _ = self._materialize(capsule_id, fetched)
            self._emit(EventKind.LOAD, capsule, detail=capsule.path or "")
            return capsule

    # -- internals -------------------------------------------------------------------------------
    def _require(self, *states: EpisodeState, verb: str) -> None:
        if self.state not in states:
            raise WrongState(f"cannot {verb} while {self.state.name} (allowed in "
                             f"{' / '.join(s.name for s in states)})")

    def _read_step(self) -> int:
        return self.runtime.read_outputs().step

    def _snapshot(self, label: str, pinned: bool = False, held: bool = False) -> Capsule:
        capsule = self.store.snapshot(self.runtime, label=label, parent_id=self.lineage,
                                      episode_id=self.episode_id, step=self.step, pinned=pinned, held=held)
        self._ledger[capsule.id] = _LedgerEntry(self.episode_id, self.step, self.input_log.generation)
        return capsule

    def _start_timeline(self, root: Capsule) -> None:
        if self._timeline.root_id and self._timeline.root_id != root.id:
            self.store.set_held(self._timeline.root_id, False)
        self._timeline.root_id = root.id
        self.input_log.start(root.episode_id, root.step)
        self._ledger[root.id] = _LedgerEntry(root.episode_id, root.step, self.input_log.generation)

    def _release_interrupt_capsule(self) -> None:
        if self.interrupt_capsule_id:
            if self.interrupt_capsule_id != self._timeline.root_id:   # a root stays held
                self.store.set_held(self.interrupt_capsule_id, False)
            self.interrupt_capsule_id = ""

    def _known(self, capsule_id: str) -> Capsule:
        """A capsule in the store, or described from its file."""
        if capsule_id in self.store:
            return self.store.get(capsule_id)
        if self.directory is not None and self.directory.exists(capsule_id):
            return self.directory.describe(capsule_id)
        raise NotFound(f"no capsule {capsule_id!r} in memory" + (" or on disk" if self.directory else ""))

    def _room_for_root(self, source: Optional[Capsule], data: Optional[torch.Tensor]):
        """Under the lock, for a reset: reserve room for the new episode's root and restore
        ``source`` (in memory, or ``data`` read from its file). ResourceExhausted when
        there is no room, before anything changed."""
        no_room = ResourceExhausted("no room for the new episode's root capsule: drop or unpin capsules, "
                                    "or raise capsules.device_budget_mb / host_budget_mb")
        if source is None or data is not None:
            if not self.store.room_for(1):
                raise no_room
            room = self.store.reserve()
            if source is not None:
                try:
                    self.store.restore_bytes(source, data, self.runtime)   # straight from the verified file
                except BaseException:
                    self.store.release(room)
                    raise
            return room
        if self.store.room_for(1, protect=[source.payload]):
            room = self.store.reserve(protect=[source.payload])
            self.store.restore(source.id, self.runtime)
            return room
        if not self.store.room_for(1):
            raise no_room
        self.store.restore(source.id, self.runtime)    # the source's own slab is the only one to free
        return self.store.reserve()

    def _require_directory(self) -> None:
        if self.directory is None:
            raise CapsuleIOError("no capsule directory configured (capsules.directory)")

    def _prefetch(self, capsule_id: str, force: bool = False):
        """Outside the boundary lock: read and verify the capsule's file when its bytes are
        not in memory (or ``force``). Returns (capsule, bytes), None (in memory, nothing to
        read), or the typed error to raise under the lock."""
        known = self.store.find(capsule_id)      # a dict lookup: safe without the lock
        if not force and known is not None and known.payload is not None:
            return None
        if self.directory is None:
            return NotFound(f"no capsule {capsule_id!r} in memory and no capsule directory configured")
        try:
            capsule, data = self.directory.load(capsule_id, expected_fingerprint=self.store.fingerprint,
                                                expected_schema=self.runtime.layout.schema())
        except FingerprintMismatch as exc:
            return exc
        except CapsuleRosError as exc:
            return exc
        if capsule.episode_id >= 2**32:
            return InvalidArgument(f"capsule {capsule_id!r}: episode id {capsule.episode_id} is out of range")
        return capsule, data

    def _materialize(self, capsule_id: str, fetched) -> Tuple[Capsule, bool]:
        """Under the lock: the capsule with its bytes in memory; True if they came from disk."""
        known = self.store.find(capsule_id)
        if known is not None and known.payload is not None and not isinstance(fetched, tuple):
            return known, False
        if isinstance(fetched, FingerprintMismatch):
            self.store.counters.invalidations += 1
        if isinstance(fetched, Exception):
            raise fetched
        if fetched is None:                       # evicted since the prefetch: read it now
            fetched = self._prefetch(capsule_id, force=True)
            return self._materialize(capsule_id, fetched)
        capsule, data = fetched
        return self.store.adopt(capsule, data), True

    def _plan_rebuild(self, capsule_id: str, cause: CapsuleRosError) -> "_Rebuild":
        """Under the lock: check that the input log can rebuild the capsule (else re-raise
        ``cause`` with the reason), and take what the rebuild needs: the timeline root's
        bytes and a copy of the logged inputs."""
        entry = self._ledger.get(capsule_id)
        reason = None
        if entry is None:
            reason = "this process did not make the capsule, so it has no input log for it"
        elif self.control.input_log_steps == 0:
            reason = "control.input_log_steps is 0"
        else:
            reason = self.input_log.covers(entry.episode_id, entry.step, entry.generation)
        root_id = self._timeline.root_id
        if reason is None and (root_id not in self.store or self.store.get(root_id).payload is None):
            reason = f"the timeline root {root_id!r} is no longer in memory"
        if reason is not None:
            raise type(cause)(f"{cause}; no recompute fallback: {reason}") from cause
        room = self.store.reserve() if capsule_id not in self.store or self.store.get(capsule_id).payload is None \
            else None                              # taken now: adopting the result cannot fail for room
        return _Rebuild(entry, root_id, self.store.host_copy(root_id), self.input_log.rows(entry.step).copy(), room)

    def _rebuild(self, plan: "_Rebuild") -> None:
        """Outside the lock: replay the logged inputs from the root on the scratch runtime."""
        with self._scratch_lock:
            scratch = self._scratch_runtime()
            scratch.load_state(plan.root_bytes)
            rows = torch.from_numpy(plan.rows).to(scratch.device)   # every logged input, uploaded once
            for row in rows:
                scratch.load_inputs(row)
                scratch.step()
            rebuilt_step = scratch.read_outputs().step
        if rebuilt_step != plan.entry.step:
            raise CorruptCapsule(f"recompute reached step {rebuilt_step}, expected {plan.entry.step}")

    def _adopt_rebuilt(self, capsule_id: str, plan: "_Rebuild", cause: CapsuleRosError,
                       seconds: float) -> Capsule:
        """Under the lock: the rebuilt state as an in-memory capsule of the same id."""
        known = self.store.find(capsule_id)
        if known is not None and known.payload is not None:        # reappeared in memory meanwhile
            if plan.room is not None:
                self.store.release(plan.room)
            capsule = known
        else:
            if known is not None:
                self.store.drop(capsule_id)        # its file is bad: forget the disk-only entry
            with self._scratch_lock:
                capsule = self.store.snapshot(self._scratch_runtime(), label="rebuilt by recompute",
                                              parent_id=plan.root_id, episode_id=plan.entry.episode_id,
                                              step=plan.entry.step, capsule_id=capsule_id, reserved=plan.room)
                self._scratch_runtime().synchronize()
        self._ledger[capsule.id] = plan.entry
        self.counters.fallback_recomputes += 1
        LOG.warning("capsule %s rebuilt by recomputing %d steps in %.1f ms (%s)", capsule_id, len(plan.rows),
                    seconds * 1e3, cause)
        return capsule

    def _scratch_runtime(self) -> PolicyRuntime:
        """A second runtime over the same weights (made on first use) for rebuilds."""
        if self._scratch is None:
            self._scratch = self.runtime.fork()
        return self._scratch

    def _on_evict(self, capsule: Capsule) -> None:
        self._emit(EventKind.EVICT, capsule, detail="evicted from memory (byte budget)")

    def _emit(self, kind: EventKind, capsule: Optional[Capsule], *, capsule_id: Optional[str] = None,
              rollback: bool = False, fallback: bool = False, detail: str = "") -> None:
        """Publish an event: episode and step are the state's after the event, except for
        COMMIT and INTERRUPT, which carry their boundary's (steps may have run since, e.g.
        while a committed capsule was being saved)."""
        if self.on_event is None:
            return
        at_boundary = kind in (EventKind.COMMIT, EventKind.INTERRUPT) and capsule is not None
        episode, step = (capsule.episode_id, capsule.step) if at_boundary else (self.episode_id, self.step)
        event = CapsuleEvent(kind, capsule_id if capsule_id is not None else (capsule.id if capsule else ""),
                             capsule.parent_id if capsule else "", episode, step, rollback, fallback, detail)
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 - an observer must not break the state machine
            LOG.exception("capsule event observer failed")


def _check_label(label: str) -> None:
    if not isinstance(label, str) or len(label) > MAX_LABEL:
        raise InvalidArgument(f"label of {len(label) if isinstance(label, str) else '?'} characters: "
                              f"at most {MAX_LABEL}")
