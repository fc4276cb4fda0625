"""PolicySession: the episode state machine over one runtime and one capsule store.

This is everything the node does, without ROS: ``capsule_ros.ros`` maps topics and
services onto it, and ``capsule-ros replay`` and the demo drive it directly. Policy, not
mechanism: the runtime and the store provide verbs (step, snapshot, restore, fork); the
session decides when to use them.

Episode states: IDLE (no episode), RUNNING (each tick steps the policy), INTERRUPTED
(each tick hands out the safe action; the state waits at its boundary).

What a tick hands out: the policy's action when its step was on time, raised nothing
and produced finite values; otherwise the safe action (``control.deadline_action``: hold
the last on-time policy action, or zeros); ``capsule_ros.serving.stepping`` has the rules.

Concurrency: one FIFO boundary lock (``capsule_ros.serving.boundary``). ``tick`` holds it
for one step; every other verb takes it between steps, so a state change is never
applied during a step and a service waits behind at most the step in progress (then
BUSY after ``control.service_timeout_ms``). Sensor values are staged under the inputs'
own lock, which a step holds while it reads them. File I/O (reading, writing, removing
capsule files: ``capsule_ros.serving.files``) never happens under the boundary lock.

A capsule that cannot be restored from its bytes but lies on the logged timeline is
rebuilt from the input log (``capsule_ros.serving.recompute``).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.capsules.store import Capsule, CapsuleStore, Tier
from capsule_ros.errors import (
    Busy,
    CapsuleIOError,
    CapsuleRosError,
    CorruptCapsule,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    WrongState,
)
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.boundary import BoundaryLock
from capsule_ros.serving.capsule_set import CapsuleSet
from capsule_ros.serving.config import ControlConfig, PortConfig
from capsule_ros.serving.files import SaveFailed, Source
from capsule_ros.serving.ports import PortAdapter, SensorInputs
from capsule_ros.serving.recompute import Recompute
from capsule_ros.serving.records import (
    ActionRecord,
    ActionSource,
    EpisodeState,
    EventKind,
    EventRecord,
    HoldMode,
    ReenterResult,
    SessionCounters,
    SessionStatus,
    StepFault,
)
from capsule_ros.serving.stepping import GuardedStep

LOG = logging.getLogger(__name__)
MAX_LABEL = 256
SAVE_GAP_WAIT_S = 0.01       # a save waits at most this long for the gap after a step
# Errors of a capsule that cannot be restored from its bytes: re-entering it tries the fallback.
UNRESTORABLE = (CorruptCapsule, NotFound, FingerprintMismatch, CapsuleIOError, PermissionDenied, InvalidArgument)


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
        self.inputs = SensorInputs(runtime.staging, dict(ports or {}))
        self.recompute = Recompute(runtime, store, control.input_log_steps, control.input_log_max_mb)
        self.stepper = GuardedStep(runtime, self.inputs, self.counters, self.recompute.log_step)
        self._boundary = BoundaryLock()
        self.capsules = CapsuleSet(store, directory, runtime.layout.schema(), self.recompute, self._boundary,
                                   self.at_boundary, self._emit, held=self._holds,
                                   between_steps=lambda: self.stepper.idle.wait(SAVE_GAP_WAIT_S))
        self._next_episode = 1
        self._last_applied = np.zeros(runtime.policy.action_dim, dtype=np.float32)
        self._status: Optional[SessionStatus] = None
        store.on_evict = self._on_evict

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

    # -- inputs ------------------------------------------------------------------------------------
    @property
    def ports(self) -> Dict[str, PortAdapter]:
        return self.inputs.ports

    def receive(self, port: str, msg: Any, now_ns: Optional[int] = None) -> np.ndarray:
        """A sensor message for ``port``: checked (against ``now_ns``, default the session's
        clock, for future stamps), converted and staged. Raises PortDrop (counted)."""
        tolerance = self.control.future_tolerance_ms
        return self.inputs.receive(port, msg, self.clock_ns() if now_ns is None else now_ns,
                                   int(tolerance * 1e6) if tolerance > 0 else None)

    def write_input(self, name: str, values: np.ndarray) -> None:
        """Stage values for an input directly (no port checks: tests and tools)."""
        self.inputs.write(name, values)

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
        self.stepper.start_watchdog(self._on_overrun)

    def warm_up(self) -> None:
        """Rehearse the step path and put the state back (``GuardedStep.rehearse``), at a
        boundary; call it right before stepping starts, so the first step is not a cold one."""
        with self._boundary:
            self.stepper.rehearse(self.step)

    def close(self) -> None:
        """Stop the watchdog thread."""
        self.stepper.close()

    def release(self, timeout_s: float = 30.0) -> None:
        """Close, then free the runtime, its replica and the capsule store at a boundary (the
        node's lifecycle ``cleanup``): device memory goes back to the driver and the session
        cannot run again. Capsule files stay on disk."""
        self.close()
        with self.at_boundary(timeout_s):
            self.state = EpisodeState.IDLE
            self.recompute.close()
            self.store.close()
            self.runtime.close()

    def tick(self, stamp_ns: Optional[int] = None, *, late: bool = False) -> Optional[ActionRecord]:
        """One control period. RUNNING: a guarded step on the staged inputs (``late`` forces a
        deadline miss, e.g. a replay re-enacting one); INTERRUPTED: the hold mode's safe
        action (None when silent); IDLE or inputs missing: None."""
        stamp_ns = self.clock_ns() if stamp_ns is None else stamp_ns
        with self._boundary:
            if self.state == EpisodeState.INTERRUPTED:
                return self.safe_record(self.hold_mode, stamp_ns)
            if self.state != EpisodeState.RUNNING:
                return None
            if not self.inputs.ready:
                self.counters.ticks_waiting_for_inputs += 1
                return None
            deadline = self.control.effective_deadline_s() if self.enforce_deadline else None
            result = self.stepper.run(self.step, deadline, forced_late=late, enforce=self.enforce_deadline)
            self.step = result.step
            out = result.outputs
            if result.fault != StepFault.NONE or out is None:
                return self._fault_record(result.fault, stamp_ns, published=result.overran, seconds=result.seconds)
            self._last_applied = out.action
            return ActionRecord(out.action, out.chunk, ActionSource.POLICY, self.episode_id, self.step, self.lineage,
                                stamp_ns, result.seconds)

    def _on_overrun(self) -> None:
        """The watchdog's thread, while a step overruns: publish the safe action now. It
        reports the step in progress, as the tick does after a late step (whose state is
        kept), so a recording does not depend on which of the two published it."""
        if self.on_safe_action is not None:
            self.on_safe_action(self._fault_record(StepFault.LATE, self.clock_ns(), published=True,
                                                   step=self.step + 1))

    def _fault_record(self, fault: StepFault, stamp_ns: int, **kwargs: Any) -> ActionRecord:
        """The configured safe action (``control.deadline_action``: never silent) for a fault."""
        mode = HoldMode.HOLD_ZERO if self.control.deadline_action == "zero" else HoldMode.HOLD_LAST
        record = self.safe_record(mode, stamp_ns, fault=fault, **kwargs)
        assert record is not None          # only HOLD_SILENT gives none
        return record

    def safe_record(self, mode: HoldMode, stamp_ns: Optional[int] = None, *, fault: StepFault = StepFault.NONE,
                    published: bool = False, step: Optional[int] = None,
                    seconds: float = 0.0) -> Optional[ActionRecord]:
        """The safe action of ``mode`` as a record (None when silent): zeros, or the last
        on-time policy action held. ``step`` is the state's step it reports (default: now)."""
        if mode == HoldMode.HOLD_SILENT:
            return None
        zero = mode == HoldMode.HOLD_ZERO
        return ActionRecord(np.zeros_like(self._last_applied) if zero else self._last_applied.copy(), None,
                            ActionSource.ZERO if zero else ActionSource.HOLD, self.episode_id,
                            self.step if step is None else step, self.lineage,
                            self.clock_ns() if stamp_ns is None else stamp_ns, seconds, fault, published)

    def status(self) -> SessionStatus:
        """A consistent picture taken between steps. Never waits for a service: while one
        holds the boundary, the previous picture is returned (status must not delay the
        control loop, and reading the store while a service changes it is not safe)."""
        if not self._boundary.acquire(blocking=False):
            if self._status is not None:
                return self._status
            self._boundary.acquire()               # the very first picture: wait for it
        try:
            self._status = SessionStatus.of(self)
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
        saver = self.capsules.require_saver() if persist else None
        with self.at_boundary():
            self._require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="commit")
            capsule = self._snapshot(label, pinned=pin)
            self.lineage = capsule.id
            self._emit(EventKind.COMMIT, capsule, detail=label)
            job = saver.begin(capsule) if saver is not None else None
        if job is not None:
            try:
                self.capsules.write(job)
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
        with self.capsules.reader.at_boundary_with(check_capsule_id(capsule_id), self.at_boundary) as source:
            return self._start_episode(source)

    def interrupt(self, hold_mode: int = HoldMode.HOLD_LAST, commit: bool = True, *,
                  timeout_s: Optional[float] = None) -> Optional[Capsule]:
        """Stop acting at this boundary; optionally commit the boundary capsule (held until
        re-entered or replaced). Raises InvalidArgument (hold mode), WrongState (not
        RUNNING), ResourceExhausted (commit without room) and Busy (no boundary within
        ``timeout_s``, default control.service_timeout_ms)."""
        try:
            mode = HoldMode(hold_mode)
        except ValueError:
            raise InvalidArgument(f"hold_mode {hold_mode!r}: must be one of {[m.value for m in HoldMode]}") from None
        with self.at_boundary(timeout_s):
            self._require(EpisodeState.RUNNING, verb="interrupt")
            capsule = self._snapshot("interrupt", held=True) if commit else None
            self._release_interrupt_capsule()
            if capsule is not None:
                self.interrupt_capsule_id = self.lineage = capsule.id
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
                    return self._resume(capsule, "", self.store.restore(capsule.id, self.runtime).seconds, 0.0)
                if self.state != EpisodeState.INTERRUPTED:
                    raise WrongState(f"reenter without a capsule id needs an interrupt capsule "
                                     f"(episode is {self.state.name})")
                self.state = EpisodeState.RUNNING     # no capsule: resume the untouched live state
                self._emit(EventKind.REENTER, None, detail="resume")
                return ReenterResult(None, False, False, "", 0.0, 0.0)
        try:
            with self.capsules.reader.at_boundary_with(check_capsule_id(capsule_id), self.at_boundary) as source:
                capsule = self.capsules.in_store(source)
                seconds = self.store.restore(capsule.id, self.runtime,
                                             count_as=Tier.DISK if source.data is not None else None).seconds
                return self._resume(capsule, "", seconds, 0.0)
        except UNRESTORABLE as exc:
            cause = exc

        def resume_rebuilt(capsule: Capsule, seconds: float) -> ReenterResult:
            self.counters.fallback_recomputes += 1
            self.store.restore(capsule.id, self.runtime)
            return self._resume(capsule, str(cause), 0.0, seconds)
        return self.recompute.recover(capsule_id, cause, self.at_boundary, self._boundary, resume_rebuilt)

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
        with self.capsules.reader.at_boundary_with(check_capsule_id(capsule_id), self.at_boundary) as source:
            parent = self.capsules.in_store(source)
            capsule = self.store.fork(parent.id, label=label)
            self.recompute.remember(capsule, like=parent.id)
            self._emit(EventKind.FORK, capsule, detail=label)
            return capsule

    # the capsule set (``capsule_ros.serving.capsule_set``): verbs that leave the live state alone
    def list_capsules(self, current_episode_only: bool = False) -> List[Capsule]:
        """Capsules in memory and in the capsule directory, newest first."""
        return self.capsules.list(self.episode_id if current_episode_only else None)

    def drop(self, capsule_id: str, from_disk: bool = False) -> None:
        """``CapsuleSet.drop``; the interrupt capsule is held while interrupted."""
        self.capsules.drop(capsule_id, from_disk)

    def save(self, capsule_id: str) -> Capsule:
        """``CapsuleSet.save``."""
        return self.capsules.save(capsule_id)

    def load(self, capsule_id: str) -> Capsule:
        """``CapsuleSet.load``."""
        return self.capsules.load(capsule_id)

    # -- internals (under the lock unless said otherwise) ------------------------------------------
    def _require(self, *states: EpisodeState, verb: str) -> None:
        if self.state not in states:
            raise WrongState(f"cannot {verb} while {self.state.name} (allowed in "
                             f"{' / '.join(s.name for s in states)})")

    def _snapshot(self, label: str, pinned: bool = False, held: bool = False) -> Capsule:
        capsule = self.store.snapshot(self.runtime, label=label, parent_id=self.lineage,
                                      episode_id=self.episode_id, step=self.step, pinned=pinned, held=held)
        self.recompute.remember(capsule)
        return capsule

    def _start_episode(self, source: Optional[Source]) -> Tuple[int, Optional[Capsule]]:
        """The new episode's state (initial, or ``source``'s) and its root capsule."""
        capsule = source.capsule if source else None
        room = self.store.restore_reserving(self.runtime, capsule, source.data if source else None)
        episode = self._next_episode
        self._next_episode += 1
        if capsule is None:
            self.runtime.reset(episode=episode)
            if self.prefix:
                self.runtime.prefill(self.prefix)
            step, lineage = self.runtime.read_outputs().step, ""
        else:
            self.runtime.set_episode(episode)
            step, lineage = capsule.step, capsule.id
        self._last_applied = self.runtime.read_outputs().action
        self.episode_id, self.step, self.lineage = episode, step, lineage
        self._release_interrupt_capsule()
        root = self.store.snapshot(self.runtime, label=f"episode {episode} start", parent_id=lineage,
                                   episode_id=episode, step=step, held=True, reserved=room)
        self.recompute.start(root)
        self.inputs.reset_ordering()
        self.state = EpisodeState.RUNNING
        self._emit(EventKind.RESET, capsule, detail=f"episode {episode}")
        return episode, capsule

    def _resume(self, capsule: Capsule, fallback_reason: str, restore_s: float,
                recompute_s: float) -> ReenterResult:
        """After the live state became ``capsule``'s: log, state, event."""
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

    def _holds(self, capsule_id: str) -> bool:
        """The interrupt capsule, while interrupted: a drop must not take it."""
        return self.state == EpisodeState.INTERRUPTED and capsule_id == self.interrupt_capsule_id

    def _release_interrupt_capsule(self) -> None:
        if self.interrupt_capsule_id:
            if self.interrupt_capsule_id != self.recompute.root_id:   # a log root stays held
                self.store.set_held(self.interrupt_capsule_id, False)
            self.interrupt_capsule_id = ""

    def _on_evict(self, capsule: Capsule) -> None:
        self._emit(EventKind.EVICT, capsule, detail="evicted from memory (byte budget)")

    def _emit(self, kind: EventKind, capsule: Optional[Capsule], *, capsule_id: Optional[str] = None,
              rollback: bool = False, fallback: bool = False, detail: str = "") -> None:
        """Publish an event: episode and step are the state's after the event, except for
        COMMIT, INTERRUPT and SAVE, which carry their capsule's boundary."""
        if self.on_event is None:
            return
        episode, step = self.episode_id, self.step
        if capsule is not None and kind in (EventKind.COMMIT, EventKind.INTERRUPT, EventKind.SAVE):
            episode, step = capsule.episode_id, capsule.step
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
