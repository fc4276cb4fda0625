"""PolicySession: the episode state machine over one runtime and one capsule store.

This is everything the node does, without ROS: ``capsule_ros.ros`` maps topics and
services onto it, and ``capsule-ros replay --in-process`` and the demo drive it
directly. Policy, not mechanism: the runtime and the store provide verbs (step,
snapshot, restore, fork); the session decides when to use them.

Episode states: IDLE (no episode), RUNNING (each tick steps the policy), INTERRUPTED
(each tick publishes the safe action; the state waits at its boundary).

Safety of a tick: the policy's action is handed out only when its step ended within the
deadline, raised nothing and produced finite outputs. Otherwise the tick hands out the
safe action (``control.deadline_action``: hold the last on-time policy action, or zeros)
and counts why; a failed or non-finite step is undone (``runtime.guard_steps``), a late
step keeps its state (the policy did step; only its action is withheld).

Concurrency: one FIFO boundary lock (``capsule_ros.serving.boundary``). ``tick`` holds it
for exactly one step; every other verb takes it between steps, so a state change is
never applied during a step and a service waits behind at most the step in progress
(it gives up with BUSY after ``control.service_timeout_ms``). Sensor values are staged
under a separate staging lock, which a step also holds while it reads them. File I/O
(reading, writing, removing capsule files) never happens under the boundary lock.

Recompute fallback (``capsule_ros.serving.recompute``): a capsule whose bytes cannot be
restored but whose step lies on the logged timeline is rebuilt from the input log.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from capsule_ros.capsules.ids import check_capsule_id, new_capsule_id
from capsule_ros.capsules.store import Capsule, CapsuleStore, Tier
from capsule_ros.errors import (Busy, CapsuleIOError, CapsuleRosError, CorruptCapsule, FingerprintMismatch,
                                InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, WrongState)
from capsule_ros.metrics import LatencyWindow
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.boundary import BoundaryLock
from capsule_ros.serving.config import ControlConfig, PortConfig
from capsule_ros.serving.ports import PortAdapter, port_adapters
from capsule_ros.serving.recompute import Recompute
from capsule_ros.serving.records import (ActionRecord, ActionSource, EpisodeState, EventKind, EventRecord, HoldMode,
                                         ReenterResult, SessionCounters, SessionStatus, StepFault)
from capsule_ros.serving.saving import CapsuleSaver
from capsule_ros.serving.watchdog import DeadlineWatchdog

LOG = logging.getLogger(__name__)
MAX_LABEL = 256
# Errors of a capsule that cannot be restored from its bytes: re-entering it tries the fallback.
UNRESTORABLE = (CorruptCapsule, NotFound, FingerprintMismatch, CapsuleIOError, PermissionDenied, InvalidArgument)


class SaveFailed(CapsuleIOError):
    """A persisting commit made its capsule (it stays in memory: ``save`` retries, ``drop``
    discards it) but could not write its file; ``code`` is the save's own error code."""

    def __init__(self, capsule: Capsule, cause: CapsuleRosError):
        super().__init__(f"committed {capsule.id} in memory, but saving it failed: {cause}")
        self.capsule = capsule
        self.code = cause.code


@dataclass(frozen=True)
class _Source:
    """Where a verb takes a capsule's state from: in memory (``data`` None) or the
    verified bytes of its file, read outside the lock."""

    capsule: Capsule
    data: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class _Fetched:
    """The outcome of reading a capsule's file outside the lock."""

    source: Optional[_Source] = None
    error: Optional[CapsuleRosError] = None


class PolicySession:
    """See the module docstring."""

    def __init__(self, runtime: PolicyRuntime, store: CapsuleStore, control: ControlConfig, *,
                 directory=None, ports: Optional[Mapping[str, PortConfig]] = None, prefix: Sequence[int] = (),
                 on_event: Optional[Callable[[EventRecord], None]] = None,
                 clock_ns: Callable[[], int] = time.time_ns, enforce_deadline: bool = True):
        self.runtime = runtime
        self.store = store
        self.control = control
        self.directory = directory
        self.ports: Dict[str, PortAdapter] = port_adapters(dict(ports or {}))
        self.prefix = tuple(prefix)
        self.on_event = on_event
        self.on_safe_action: Optional[Callable[[ActionRecord], None]] = None   # see start_watchdog
        self.clock_ns = clock_ns
        self.enforce_deadline = enforce_deadline   # False: verify the function, not this machine's timing
        self.state = EpisodeState.IDLE
        self.episode_id = 0
        self.step = 0
        self.lineage = ""
        self.hold_mode = HoldMode.HOLD_LAST
        self.interrupt_capsule_id = ""
        self.counters = SessionCounters()
        self.step_latency = LatencyWindow()
        self.staging_lock = threading.Lock()
        self._boundary = BoundaryLock()
        self._next_episode = 1
        self._last_applied = np.zeros(runtime.policy.action_dim, dtype=np.float32)
        self._inputs_seen: set = set()
        self._input_names = tuple(runtime.staging)
        self._watchdog: Optional[DeadlineWatchdog] = None
        self._status: Optional[SessionStatus] = None
        self.recompute = Recompute(runtime, store, control.input_log_steps)
        self.saver = CapsuleSaver(directory, store, runtime.layout.schema()) if directory is not None else None
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
    def receive(self, port: str, msg: Any, now_ns: Optional[int] = None) -> np.ndarray:
        """A sensor message for ``port``: checked, converted and staged. Raises PortDrop
        (counted on the port) for a message the port refuses. ``now_ns``: the receiver's
        clock for the future-stamp check (default: the session's clock)."""
        tolerance = self.control.future_tolerance_ms
        values = self.ports[port].accept(msg, self.clock_ns() if now_ns is None else now_ns,
                                         int(tolerance * 1e6) if tolerance > 0 else None)
        self.write_input(port, values)
        return values

    def write_input(self, name: str, values: np.ndarray) -> None:
        """Copy values into an input's staging buffer (its shape already checked)."""
        staging = self.runtime.staging[name]
        with self.staging_lock:
            np.copyto(staging, values.reshape(staging.shape), casting="unsafe")
            self._inputs_seen.add(name)

    @property
    def inputs_ready(self) -> bool:
        return len(self._inputs_seen) == len(self._input_names)

    @property
    def inputs_seen(self) -> frozenset:
        """Names of the inputs that received at least one value."""
        return frozenset(self._inputs_seen)

    @property
    def log_root_id(self) -> str:
        """The capsule the input log starts from (held while it is)."""
        return self.recompute.root_id

    # -- control loop -------------------------------------------------------------------------
    def start_watchdog(self, on_safe_action: Callable[[ActionRecord], None]) -> None:
        """Enforce deadlines while a step runs: when one overruns, the watchdog's thread hands
        the safe action to ``on_safe_action`` at once (the tick's record then says
        ``published``). Without it a late step is found when it ends."""
        self.on_safe_action = on_safe_action
        if self._watchdog is None:
            self._watchdog = DeadlineWatchdog(self._on_overrun)

    def close(self) -> None:
        """Stop the watchdog thread."""
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    def tick(self, stamp_ns: Optional[int] = None, *, late: bool = False) -> Optional[ActionRecord]:
        """One control period. RUNNING: step the policy on the staged inputs (see the module
        docstring for when the safe action replaces its output; ``late`` forces a deadline
        miss, e.g. a replay re-enacting one); INTERRUPTED: the hold mode's safe action
        (None when silent); IDLE or inputs missing: None."""
        stamp_ns = self.clock_ns() if stamp_ns is None else stamp_ns
        with self._boundary:
            if self.state == EpisodeState.INTERRUPTED:
                return self.safe_record(self.hold_mode, stamp_ns)
            if self.state != EpisodeState.RUNNING:
                return None
            if not self.inputs_ready:
                self.counters.ticks_waiting_for_inputs += 1
                return None
            return self._step(stamp_ns, late)

    def _step(self, stamp_ns: int, forced_late: bool) -> ActionRecord:
        """Under the lock: one guarded step (see the module docstring)."""
        deadline = self.control.effective_deadline_s() if self.enforce_deadline else None
        watched = deadline is not None and self._watchdog is not None
        if watched:
            self._watchdog.arm(deadline)
        fault, out, start = StepFault.NONE, None, time.perf_counter()
        with self.staging_lock:        # held until the outputs are read: the input copy may be async
            try:
                self.runtime.load_inputs()
                self.runtime.step()
                out = self.runtime.read_outputs()
                if not (np.isfinite(out.action).all() and np.isfinite(out.chunk).all()):
                    fault = StepFault.NONFINITE
            except Exception as exc:  # noqa: BLE001 - a step must never take the node down
                fault = StepFault.ERROR
                self.counters.last_fault = f"{type(exc).__name__}: {exc}"
                LOG.debug("step failed", exc_info=True)
            if fault == StepFault.NONE or not self.runtime.guarded:
                self.recompute.log_step(self.step, self.runtime.input_staging.numpy())
        seconds = time.perf_counter() - start
        fired = self._watchdog.disarm() if watched else False
        self.step_latency.record(seconds)
        if fault != StepFault.NONE:
            self._count_fault(fault, out)
        elif out is not None:
            self.counters.steps += 1
            self.step = out.step
        if fault == StepFault.NONE and (forced_late or fired or (deadline is not None and seconds > deadline)):
            fault = StepFault.LATE
            self.counters.deadline_misses += 1
        if fault != StepFault.NONE:
            return self._safe_for(fault, stamp_ns, seconds, published=fired)
        self._last_applied = out.action
        return ActionRecord(out.action, out.chunk, ActionSource.POLICY, self.episode_id, self.step, self.lineage,
                            stamp_ns, seconds)

    def _count_fault(self, fault: StepFault, out) -> None:
        """A failed or non-finite step: undone when guarded, else its state stands."""
        if fault == StepFault.NONFINITE:
            self.counters.nonfinite_steps += 1
            self.counters.last_fault = f"non-finite outputs at step {self.step + 1}"
        else:
            self.counters.step_errors += 1
        if self.runtime.guarded:
            self.runtime.undo_step()
        else:
            self.step = self.runtime.read_outputs().step
        LOG.warning("step %d: %s; published the safe action%s", self.step + 1, self.counters.last_fault,
                    " and kept the state as before it" if self.runtime.guarded else "")

    def _safe_for(self, fault: StepFault, stamp_ns: int, seconds: float, published: bool,
                  step: Optional[int] = None) -> ActionRecord:
        """The configured safe action standing in for a step's output; ``step`` is the
        state's step counter it reports (default: the state's now)."""
        mode = HoldMode.HOLD_ZERO if self.control.deadline_action == "zero" else HoldMode.HOLD_LAST
        record = self.safe_record(mode, stamp_ns)
        return ActionRecord(record.values, None, record.source, self.episode_id,
                            self.step if step is None else step, self.lineage, stamp_ns, seconds, fault=fault,
                            published=published)

    def _on_overrun(self) -> None:
        """The watchdog's thread, while a step overruns: publish the safe action now. It
        reports the step in progress (a late step's state is kept, so the counter the tick
        reports after it is the same: a recording does not depend on which one published)."""
        if self.on_safe_action is not None:
            record = self._safe_for(StepFault.LATE, self.clock_ns(), 0.0, published=True, step=self.step + 1)
            self.on_safe_action(record)

    def safe_action(self, mode: HoldMode) -> Optional[np.ndarray]:
        """The values of a safe action (hold the last on-time policy action, or zeros)."""
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

    # -- status ------------------------------------------------------------------------------------
    def status(self) -> SessionStatus:
        """A consistent picture taken between steps. Never waits for a service: while one
        holds the boundary, the previous picture is returned (status must not delay the
        control loop, and reading the store while a service changes it is not safe)."""
        if not self._boundary.acquire(blocking=False):
            if self._status is not None:
                return self._status
            self._boundary.acquire()               # the very first picture: wait for it
        try:
            store, c = self.store, self.store.counters
            store.flush_timings()
            self._status = SessionStatus(
                state=self.state, episode_id=self.episode_id, step=self.step, lineage=self.lineage,
                counters=SessionCounters(**vars(self.counters)),
                step_ms=self.step_latency.percentiles_ms(50, 95, 99),
                restore_ms=store.restore_latency.percentiles_ms(50, 95, 99),
                capsules={int(t): store.count(t) for t in Tier}, hits={int(t): c.hits[t] for t in Tier},
                restores=c.restores, misses=c.misses, invalidations=c.invalidations, evictions=c.evictions,
                demotions=c.demotions, stamp_ns=self.clock_ns())
            return self._status
        finally:
            self._boundary.release()

    # -- verbs ---------------------------------------------------------------------------------
    def commit(self, label: str = "", persist: bool = False, pin: bool = False) -> Capsule:
        """Snapshot the whole state at this boundary into a new capsule: the lineage and the
        COMMIT event change at this boundary. With ``persist`` the capsule is then saved
        outside the lock (the control loop keeps stepping) and this returns once its file
        is written. Raises InvalidArgument (label), WrongState (IDLE), ResourceExhausted,
        Busy, CapsuleIOError (persist without a directory), all with nothing changed; and
        SaveFailed when the capsule was made but its file could not be written."""
        _check_label(label)
        if persist:
            self._require_directory()
        with self.at_boundary():
            self._require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="commit")
            capsule = self._snapshot(label, pinned=pin)
            self.lineage = capsule.id
            self._emit(EventKind.COMMIT, capsule, detail=label)
            job = self.saver.begin(capsule) if persist else None
        if job is not None:
            try:
                self._write(job)
            except CapsuleRosError as exc:
                raise SaveFailed(capsule, exc) from exc
        return capsule

    def reset(self, capsule_id: str = "") -> Tuple[int, Optional[Capsule]]:
        """Start a new episode from the initial state or from a capsule's state (in memory
        or read from its file). Raises InvalidArgument, NotFound, CorruptCapsule,
        FingerprintMismatch, PermissionDenied, CapsuleIOError (the capsule), ResourceExhausted
        (no room for the episode's root capsule) and Busy, with the live state unchanged."""
        if not capsule_id:
            with self.at_boundary():
                return self._start_episode(None)
        with self._at_boundary_with(check_capsule_id(capsule_id)) as source:
            return self._start_episode(source)

    def interrupt(self, hold_mode: int = HoldMode.HOLD_LAST, commit: bool = True) -> Optional[Capsule]:
        """Stop acting at this boundary; optionally commit the boundary capsule (held until
        re-entered or replaced). Raises InvalidArgument (hold mode), WrongState (not
        RUNNING), ResourceExhausted (commit without room) and Busy."""
        try:
            mode = HoldMode(hold_mode)
        except ValueError:
            raise InvalidArgument(f"hold_mode {hold_mode!r}: must be one of {[m.value for m in HoldMode]}") from None
        with self.at_boundary():
            self._require(EpisodeState.RUNNING, verb="interrupt")
            capsule = self._snapshot("interrupt", held=True) if commit else None
            self._release_interrupt_capsule()
            if capsule is not None:
                self.interrupt_capsule_id = capsule.id
                self.lineage = capsule.id
            self.hold_mode = mode
            self.state = EpisodeState.INTERRUPTED
            self._emit(EventKind.INTERRUPT, capsule, detail=mode.name)
            return capsule

    def reenter(self, capsule_id: str = "") -> ReenterResult:
        """Restore a capsule and resume ("" = the interrupt capsule, or the untouched live
        state after an interrupt without one). A capsule that cannot be restored is rebuilt
        by the recompute fallback when the input log covers it (on a replica, outside the
        lock: the control loop keeps stepping meanwhile). Raises the capsule's own error
        (with the reason there is no fallback), WrongState, ResourceExhausted, Busy."""
        if not capsule_id:
            with self.at_boundary():
                if self.interrupt_capsule_id:          # held: always in memory
                    capsule = self.store.get(self.interrupt_capsule_id)
                    seconds = self.store.restore(capsule.id, self.runtime).seconds
                    return self._resume(capsule, "", seconds, 0.0)
                if self.state != EpisodeState.INTERRUPTED:
                    raise WrongState(f"reenter without a capsule id needs an interrupt capsule "
                                     f"(episode is {self.state.name})")
                self.state = EpisodeState.RUNNING     # no capsule: resume the untouched live state
                self._emit(EventKind.REENTER, None, detail="resume")
                return ReenterResult(None, False, False, "", 0.0, 0.0)
        try:
            with self._at_boundary_with(check_capsule_id(capsule_id)) as source:
                capsule = source.capsule if source.data is None else self.store.adopt(source.capsule, source.data)
                seconds = self.store.restore(capsule.id, self.runtime,
                                             count_as=Tier.DISK if source.data is not None else None).seconds
                return self._resume(capsule, "", seconds, 0.0)
        except UNRESTORABLE as exc:
            cause = exc
        with self.at_boundary():
            plan = self.recompute.plan(capsule_id, cause)
        start = time.perf_counter()
        try:
            self.recompute.rebuild(plan)
        except BaseException:
            with self._boundary:
                self.recompute.release(plan)
            raise
        seconds = time.perf_counter() - start
        with self.at_boundary():
            capsule = self.recompute.adopt(capsule_id, plan, cause, seconds)
            self.counters.fallback_recomputes += 1
            self.store.restore(capsule.id, self.runtime)
            return self._resume(capsule, str(cause), 0.0, seconds)

    def fork(self, capsule_id: str = "", label: str = "") -> Capsule:
        """A new capsule id with the same state ("" = the live state at this boundary).
        Raises InvalidArgument, NotFound, CorruptCapsule, FingerprintMismatch,
        ResourceExhausted, WrongState (live state while IDLE) and Busy."""
        _check_label(label)
        if not capsule_id:
            with self.at_boundary():
                self._require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="fork the live state")
                capsule = self._snapshot(label)
                self._emit(EventKind.FORK, capsule, detail=label)
                return capsule
        with self._at_boundary_with(check_capsule_id(capsule_id)) as source:
            parent = source.capsule if source.data is None else self.store.adopt(source.capsule, source.data)
            capsule = self.store.fork(parent.id, label=label)
            self.recompute.remember(capsule, like=parent.id)
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
        """Forget a capsule from memory (and its file with ``from_disk``). Once this returns,
        the capsule never comes back, even if a save of it was still writing. Raises
        InvalidArgument, NotFound, WrongState (the held interrupt capsule) and Busy."""
        check_capsule_id(capsule_id)
        has_file = self.directory is not None and self.directory.exists(capsule_id)
        with self.at_boundary():
            if self.state == EpisodeState.INTERRUPTED and capsule_id == self.interrupt_capsule_id:
                raise WrongState(f"capsule {capsule_id!r} is the interrupt capsule: re-enter or reset first")
            saving = self.saver is not None and self.saver.is_saving(capsule_id)
            if capsule_id not in self.store and not (from_disk and (has_file or saving)):
                raise NotFound(f"no capsule {capsule_id!r}" + (" in memory or on disk" if from_disk else " in memory"))
            capsule = self.store.drop(capsule_id) if capsule_id in self.store else None
            if from_disk and self.saver is not None:
                self.saver.cancel(capsule_id)
            if from_disk or not has_file:
                self.recompute.forget(capsule_id)    # gone for good: no recompute brings it back
            if capsule_id == self.interrupt_capsule_id:
                self.interrupt_capsule_id = ""
            self._emit(EventKind.DROP, capsule, capsule_id=capsule_id, detail="memory and disk" if from_disk else "memory")
        if from_disk and self.directory is not None:
            with contextlib.suppress(NotFound):      # also a file a save published just before the drop
                self.directory.remove(capsule_id)

    def save(self, capsule_id: str) -> Capsule:
        """Write an in-memory capsule to the capsule directory (atomic, verified) without
        holding up the control loop. Raises InvalidArgument, NotFound (unknown, only on disk
        already, or dropped while saving), Busy, CapsuleIOError, PermissionDenied."""
        check_capsule_id(capsule_id)
        self._require_directory()
        with self.at_boundary():
            capsule = self.store.find(capsule_id)
            if capsule is None:
                raise NotFound(f"no capsule {capsule_id!r} in memory")
            if capsule.payload is None:
                raise NotFound(f"capsule {capsule_id!r} is only on disk already ({capsule.path})")
            job = self.saver.begin(capsule)
        return self._write(job)

    def load(self, capsule_id: str) -> Capsule:
        """Read and verify a capsule file into memory (the live state is not touched).
        Raises NotFound, CorruptCapsule, FingerprintMismatch, PermissionDenied,
        CapsuleIOError (the file's own problem, even when the capsule is in memory),
        ResourceExhausted and Busy."""
        self._require_directory()
        fetched = self._read_file(check_capsule_id(capsule_id))
        with self.at_boundary():
            if fetched.error is not None:
                self._count_invalid(fetched.error)
                raise fetched.error
            capsule = self.store.adopt(fetched.source.capsule, fetched.source.data)
            self._emit(EventKind.LOAD, capsule, detail=capsule.path or "")
            return capsule

    # -- internals -------------------------------------------------------------------------------
    def _require(self, *states: EpisodeState, verb: str) -> None:
        if self.state not in states:
            raise WrongState(f"cannot {verb} while {self.state.name} (allowed in "
                             f"{' / '.join(s.name for s in states)})")

    def _require_directory(self) -> None:
        if self.directory is None:
            raise CapsuleIOError("no capsule directory configured (capsules.directory)")

    def _snapshot(self, label: str, pinned: bool = False, held: bool = False) -> Capsule:
        capsule = self.store.snapshot(self.runtime, label=label, parent_id=self.lineage,
                                      episode_id=self.episode_id, step=self.step, pinned=pinned, held=held)
        self.recompute.remember(capsule)
        return capsule

    def _write(self, job) -> Capsule:
        """Outside the lock: a save begun under it; its loan always ends (under the lock,
        which it must not give up on: it waits behind at most one step)."""
        try:
            path = self.saver.write(job)
        except BaseException:
            with self._boundary:
                self.saver.end(job)
            raise
        with self._boundary:
            self.saver.end(job)
            job.capsule.path = str(path)
            self._emit(EventKind.SAVE, job.capsule, detail=job.capsule.path)
        return job.capsule

    def _start_episode(self, source: Optional[_Source]) -> Tuple[int, Optional[Capsule]]:
        """Under the lock: the new episode's state (initial, or ``source``'s), its root capsule."""
        room = self._restore_for_reset(source)
        episode = self._next_episode
        self._next_episode += 1
        if source is None:
            self.runtime.reset(episode=episode)
            if self.prefix:
                self.runtime.prefill(self.prefix)
            step, lineage = self.runtime.read_outputs().step, ""
        else:
            self.runtime.set_episode(episode)
            step, lineage = source.capsule.step, source.capsule.id
        self._last_applied = self.runtime.read_outputs().action
        self.episode_id, self.step, self.lineage = episode, step, lineage
        self._release_interrupt_capsule()
        root = self.store.snapshot(self.runtime, label=f"episode {episode} start", parent_id=lineage,
                                   episode_id=episode, step=step, held=True, reserved=room)
        self.recompute.start(root)
        for port in self.ports.values():            # a new episode: sensor clocks may have restarted
            port.reset_ordering()
        self.state = EpisodeState.RUNNING
        self._emit(EventKind.RESET, source.capsule if source else None, detail=f"episode {episode}")
        return episode, source.capsule if source else None

    def _restore_for_reset(self, source: Optional[_Source]):
        """Under the lock, for a reset: reserve room for the new episode's root and restore
        ``source`` (from memory, or straight from its file's verified bytes). Raises
        ResourceExhausted when there is no room, before anything changed."""
        no_room = ResourceExhausted("no room for the new episode's root capsule: drop or unpin capsules, "
                                    "or raise capsules.device_budget_mb / host_budget_mb")
        if source is None or source.data is not None:
            if not self.store.room_for(1):
                raise no_room
            room = self.store.reserve()
            if source is not None:
                try:
                    self.store.restore_bytes(source.capsule, source.data, self.runtime)
                except BaseException:
                    self.store.release(room)
                    raise
            return room
        payload = source.capsule.payload
        if self.store.room_for(1, protect=[payload]):
            room = self.store.reserve(protect=[payload])
            self.store.restore(source.capsule.id, self.runtime)
            return room
        if not self.store.room_for(1):
            raise no_room
        self.store.restore(source.capsule.id, self.runtime)    # the source's own slab is the only one to free
        return self.store.reserve()

    def _resume(self, capsule: Capsule, fallback_reason: str, restore_s: float,
                recompute_s: float) -> ReenterResult:
        """Under the lock, after the live state became ``capsule``'s: log, state, event."""
        rollback = capsule.episode_id == self.episode_id and capsule.step < self.step
        self._release_interrupt_capsule()      # a later reenter("") needs a new interrupt
        self.recompute.resumed_at(capsule)
        self._last_applied = self.runtime.read_outputs().action    # HOLD_LAST holds the capsule's action
        self.episode_id, self.step, self.lineage = capsule.episode_id, capsule.step, capsule.id
        self._next_episode = max(self._next_episode, capsule.episode_id + 1)
        self.state = EpisodeState.RUNNING
        self._emit(EventKind.REENTER, capsule, rollback=rollback, fallback=bool(fallback_reason),
                   detail=fallback_reason)
        return ReenterResult(capsule, rollback, bool(fallback_reason), fallback_reason, restore_s, recompute_s)

    def _release_interrupt_capsule(self) -> None:
        if self.interrupt_capsule_id:
            if self.interrupt_capsule_id != self.recompute.root_id:   # a log root stays held
                self.store.set_held(self.interrupt_capsule_id, False)
            self.interrupt_capsule_id = ""

    @contextlib.contextmanager
    def _at_boundary_with(self, capsule_id: str) -> Iterator[_Source]:
        """The boundary lock held, with the capsule's state in memory or read from its
        verified file (the reading happens outside the lock; when the capsule leaves memory
        between the two, it is read again). Raises the capsule's typed error."""
        for _ in range(3):
            fetched = None if self._in_memory(capsule_id) else self._read_file(capsule_id)
            with self.at_boundary():
                if self._in_memory(capsule_id):     # in memory now: a file read meanwhile is not needed
                    yield _Source(self.store.get(capsule_id))
                    return
                if fetched is not None:
                    if fetched.error is not None:
                        self._count_invalid(fetched.error)
                        raise fetched.error
                    yield fetched.source
                    return
        raise Busy(f"capsule {capsule_id!r} kept leaving memory while it was being read; try again")

    def _in_memory(self, capsule_id: str) -> bool:
        known = self.store.find(capsule_id)      # a dict lookup: safe without the lock
        return known is not None and known.payload is not None

    def _read_file(self, capsule_id: str) -> _Fetched:
        """Outside the lock: read and verify the capsule's file."""
        if self.directory is None:
            return _Fetched(error=NotFound(f"no capsule {capsule_id!r} in memory and no capsule directory "
                                           "configured"))
        try:
            capsule, data = self.directory.load(capsule_id, expected_fingerprint=self.store.fingerprint,
                                                expected_schema=self.runtime.layout.schema())
        except CapsuleRosError as exc:
            return _Fetched(error=exc)
        if capsule.episode_id >= 2**32:
            return _Fetched(error=InvalidArgument(f"capsule {capsule_id!r}: episode id {capsule.episode_id} "
                                                  "is out of range"))
        return _Fetched(source=_Source(capsule, data))

    def _count_invalid(self, error: CapsuleRosError) -> None:
        if isinstance(error, FingerprintMismatch):
            self.store.counters.invalidations += 1

    def _on_evict(self, capsule: Capsule) -> None:
        self._emit(EventKind.EVICT, capsule, detail="evicted from memory (byte budget)")

    def _emit(self, kind: EventKind, capsule: Optional[Capsule], *, capsule_id: Optional[str] = None,
              rollback: bool = False, fallback: bool = False, detail: str = "") -> None:
        """Publish an event: episode and step are the state's after the event, except for
        COMMIT, INTERRUPT and SAVE, which carry their capsule's boundary."""
        if self.on_event is None:
            return
        at_capsule = kind in (EventKind.COMMIT, EventKind.INTERRUPT, EventKind.SAVE) and capsule is not None
        episode, step = (capsule.episode_id, capsule.step) if at_capsule else (self.episode_id, self.step)
        event = EventRecord(kind, capsule_id if capsule_id is not None else (capsule.id if capsule else ""),
                            capsule.parent_id if capsule else "", episode, step, rollback, fallback, detail)
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 - an observer must not break the state machine
            LOG.exception("capsule event observer failed")


def _check_label(label: str) -> None:
    if not isinstance(label, str) or len(label) > MAX_LABEL:
        raise InvalidArgument(f"label of {len(label) if isinstance(label, str) else '?'} characters: "
                              f"at most {MAX_LABEL}")
