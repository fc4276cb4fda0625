"""PolicySession: the episode state machine over one runtime and one capsule store.

This is everything the node does, without ROS: ``capsule_ros.ros`` maps topics and
services onto it, and ``capsule-ros replay`` and the demo drive it directly. Policy, not
mechanism: the runtime and the store provide verbs (step, snapshot, restore, fork); the
session decides when to use them. Its verbs are the ones of ``capsule_ros.serving.verbs``
(commit, reset, interrupt, reenter, fork, list, drop, save, load), plus ``feed`` / ``tick``
for the control loop, ``clock_jumped`` when its clock jumps, ``reconfigure`` for run-time
settings, and ``suspend_serving`` / ``resume_serving`` for the node's lifecycle.

Episode states: IDLE (no episode), RUNNING (each tick steps the policy), INTERRUPTED
(each tick hands out the safe action; the state waits at its boundary).

What a tick hands out: the policy's action when its step was on time, raised nothing
and produced finite values; otherwise the safe action (``control.deadline_action``: hold
the last on-time policy action, or zeros); ``capsule_ros.serving.stepping`` has the rules.
The session also does the control loop's accounting (dropped messages, stale ports,
steps waiting for inputs) and its throttled warnings (``capsule_ros.serving.notices``),
so a replay that drives it counts exactly what the node counts.

Concurrency: the session owns its step boundary (``capsule_ros.serving.boundary``) and
this module shows every use of it: ``self.boundary.blocking()`` for a tick (one step),
``self.boundary.held()`` for a verb (BUSY after ``control.service_timeout_ms``; WRONG_STATE
while the node is inactive: ``suspend_serving``), ``self.boundary.lifecycle()`` for the
node's lifecycle and parameters, ``self.boundary.unless_busy()`` for status. The parts it composes (the capsule set and
its files, the recompute fallback, the guarded step) never take the boundary and never
call back into the session: they return plans and results, and each says whether it
runs under the boundary or outside it. File I/O (reading, writing, removing capsule
files) and a recompute's replay happen outside it. Sensor values are staged under the
inputs' own lock, which a step holds while it reads them.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.capsules.store import Capsule, CapsuleStore, Reservation, Tier
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
from capsule_ros.runtime.schema import KIND_ORDER, BufferKind
from capsule_ros.serving.boundary import Boundary
from capsule_ros.serving.capsule_set import CapsuleSet
from capsule_ros.serving.config import ControlConfig, PortConfig
from capsule_ros.serving.files import SaveFailed, SaveJob, Source
from capsule_ros.serving.notices import Notices
from capsule_ros.serving.ports import PortAdapter, PortDrop, SensorInputs, stamp_ns
from capsule_ros.serving.recompute import Recompute
from capsule_ros.serving.records import (
    ActionRecord,
    ActionSource,
    EpisodeStart,
    EpisodeState,
    EventKind,
    EventRecord,
    HoldMode,
    ReenterResult,
    SessionCounters,
    SessionStatus,
    StepFault,
    clock_jump_detail,
)
from capsule_ros.serving.stepping import GuardedStep

if TYPE_CHECKING:
    from capsule_ros.serving.regenerate import CapsuleFiles

LOG = logging.getLogger(__name__)
MAX_LABEL = 256
# Errors of a capsule that cannot be restored from its bytes: re-entering it tries the fallback.
UNRESTORABLE = (CorruptCapsule, NotFound, FingerprintMismatch, CapsuleIOError, PermissionDenied, InvalidArgument)


class Fed(NamedTuple):
    """What became of one sensor message (``PolicySession.feed``)."""

    accepted: bool                     # staged (else dropped and counted: ``drop`` says why)
    drop: Optional[PortDrop]
    stepped: bool                      # it was a trigger message and ran a tick
    record: Optional[ActionRecord]     # that tick's action (None: nothing to publish)


class PolicySession:
    """See the module docstring."""

    def __init__(self, runtime: PolicyRuntime, store: CapsuleStore, control: ControlConfig, *,
                 directory: Optional[CapsuleDirectory] = None, ports: Optional[Mapping[str, PortConfig]] = None,
                 prefix: Sequence[int] = (), on_event: Optional[Callable[[EventRecord], None]] = None,
                 clock_ns: Callable[[], int] = time.time_ns, enforce_deadline: bool = True,
                 files: Optional[CapsuleFiles] = None):
        self.runtime = runtime
        self.store = store
        self.control = control
        self.directory = directory
        self.prefix = tuple(prefix)
        self.on_event = on_event
        self.on_safe_action: Optional[Callable[[ActionRecord], None]] = None   # see start_watchdog
        self.clock_ns = clock_ns                   # the receiver's clock: ports, stamps, status
        self.enforce_deadline = enforce_deadline   # False: verify the function, not this machine's timing
        self.state = EpisodeState.IDLE
        self.episode_id = 0
        self.step = 0
        self.lineage = ""
        self.hold_mode = HoldMode.HOLD_LAST
        self.interrupt_capsule_id = ""
        self.counters = SessionCounters()
        self.notices = Notices(LOG)
        self.boundary = Boundary(control.service_timeout_ms / 1e3)
        self.inputs = SensorInputs(runtime.staging, dict(ports or {}), runtime.policy.text_inputs(), runtime.texts)
        self.recompute = Recompute(runtime, store, control.input_log_steps, control.input_log_max_mb, self.prefix)
        self.stepper = GuardedStep(runtime, self.inputs, self.counters, self.recompute.log_step)
        self.capsules = CapsuleSet(store, directory, runtime.layout.schema(), self.recompute,
                                   between_steps=self.stepper.idle)
        self._next_episode = 1
        self._last_applied = np.zeros(runtime.policy.action_dim, dtype=np.float32)
        self._status: Optional[SessionStatus] = None
        self.files = files                         # the directory's picture: stale files, recipes
        self._clock_seen_ns: Optional[int] = None       # the clock when feed / tick last read it
        self._resume_when_served = False                # suspend_serving interrupted the episode
        store.on_evict = self._on_evict

    # -- inputs ------------------------------------------------------------------------------------
    @property
    def ports(self) -> Dict[str, PortAdapter]:
        return self.inputs.ports

    def receive(self, port: str, msg: Any, now_ns: Optional[int] = None) -> np.ndarray:
        """A sensor message for ``port``: checked (against ``now_ns``, default the session's
        clock, for future stamps), converted and staged. Raises PortDrop (counted)."""
        tolerance = self.control.future_tolerance_ms
        now = self.observe_clock(self.clock_ns() if now_ns is None else now_ns)
        return self.inputs.receive(port, msg, now, int(tolerance * 1e6) if tolerance > 0 else None)

    def feed(self, port: str, msg: Any, now_ns: Optional[int] = None, *, stage_only: bool = False,
             late: bool = False) -> Fed:
        """A sensor message as the control loop gets one: staged (or dropped, counted and
        warned about), and, in trigger mode on the trigger port, the tick it triggers,
        stamped with the message's header stamp (``stage_only``: never a tick; ``late``:
        that tick counts as a deadline miss, as in ``tick``)."""
        try:
            self.receive(port, msg, now_ns)
        except PortDrop as drop:
            self.notices.warn(f"drop.{port}", f"port {port}: dropped a message ({drop.reason}): {drop}")
            return Fed(False, drop, False, None)
        control = self.control
        if stage_only or control.mode != "trigger" or port != control.trigger_port:
            return Fed(True, None, False, None)
        return Fed(True, None, True, self.tick(stamp_ns(msg), late=late))

    def observe_clock(self, now_ns: int) -> int:
        """The session's clock as the control loop reads it (``receive``, ``tick``): a time
        earlier than the last one read is a jump back (``clock_jumped``), for clocks that
        report none (a wall clock stepped back). Returns ``now_ns``."""
        seen, self._clock_seen_ns = self._clock_seen_ns, now_ns
        if seen is not None and now_ns < seen:
            self.clock_jumped(now_ns - seen)
        return now_ns

    def clock_jumped(self, delta_ns: int) -> None:
        """The session's clock jumped by ``delta_ns`` (negative: back), as a simulated clock
        does at every loop of ``ros2 bag play --clock --loop``: the ports forget their stamp
        ordering and their ages go on across the jump (``SensorInputs.clock_jumped``), so
        the sensors' new stamps are taken and staleness still applies; the jump is counted,
        warned about and published as a CLOCK_JUMP event (a replay re-enacts it there). The
        node calls it from its clock's jump callback; ``observe_clock`` for other clocks.
        At a boundary, waiting as long as it takes (like a tick)."""
        with self.boundary.blocking():
            self.inputs.clock_jumped(delta_ns)
            self._clock_seen_ns = self.clock_ns()
            self.counters.clock_jumps += 1
            self.counters.last_clock_jump_ns = delta_ns
            self.notices.warn("clock", f"the clock jumped {delta_ns / 1e9:+.3f} s (a looping bag's /clock? a "
                                       "simulator reset?): the ports' stamp ordering starts over")
            self._emit(EventKind.CLOCK_JUMP, None, detail=clock_jump_detail(delta_ns))

    def write_input(self, name: str, values: np.ndarray) -> None:
        """Stage values for an input directly (no port checks: tests and tools)."""
        self.inputs.write(name, values)

    @property
    def interrupt_capsule(self) -> Optional[Capsule]:
        """The interrupt capsule (held while interrupted), or None."""
        return self.store.find(self.interrupt_capsule_id) if self.interrupt_capsule_id else None

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
        with self.boundary.blocking():
            self.stepper.rehearse(self.step)

    def close(self) -> None:
        """Stop the watchdog thread and a background regeneration (after its capsule in progress)."""
        self.stepper.close()
        if self.files is not None:
            self.files.close()

    def release(self, timeout_s: float = 30.0) -> None:
        """Close, then free the runtime, its replica and the capsule store at a boundary (the
        node's lifecycle ``cleanup``): device memory goes back to the driver and the session
        cannot run again (its boundary answers WRONG_STATE from now on). Capsule files stay."""
        self.close()
        with self.boundary.lifecycle(timeout_s):
            self.state = EpisodeState.IDLE
            self.recompute.close()
            self.store.close()
            self.runtime.close()
            self.boundary.close()

    def tick(self, stamp_ns: Optional[int] = None, *, late: bool = False) -> Optional[ActionRecord]:
        """One control period. RUNNING: a guarded step on the staged inputs (``late`` forces a
        deadline miss, e.g. a replay re-enacting one); INTERRUPTED: the hold mode's safe
        action (None when silent); IDLE or inputs missing: None. After a policy action,
        ports older than their ``staleness_ms`` count a stale step."""
        now = self.observe_clock(self.clock_ns())
        stamp_ns = now if stamp_ns is None else stamp_ns
        with self.boundary.blocking():
            if self.state == EpisodeState.INTERRUPTED:
                return self.safe_record(self.hold_mode, stamp_ns)
            if self.state != EpisodeState.RUNNING:
                return None
            if not self.inputs.ready:
                self.counters.ticks_waiting_for_inputs += 1
                self.notices.warn("inputs", f"waiting for first message on port(s) {self.inputs.missing()}")
                return None
            deadline = self.control.effective_deadline_s() if self.enforce_deadline else None
            result = self.stepper.run(self.step, deadline, forced_late=late, enforce=self.enforce_deadline)
            self.step = result.step
            out = result.outputs
            if result.fault != StepFault.NONE or out is None:
                return self._faulted(result.fault, stamp_ns, result.overran, result.seconds, deadline)
            self._last_applied = out.action
            self._count_stale_ports(now)
            return ActionRecord(out.action, out.chunk, ActionSource.POLICY, self.episode_id, self.step, self.lineage,
                                stamp_ns, result.seconds)

    def status(self) -> SessionStatus:
        """A consistent picture taken between steps. Never waits for a service: while one
        holds the boundary, the previous picture is returned (status must not delay the
        control loop, and reading the store while a service changes it is not safe)."""
        with self.boundary.unless_busy() as entered:
            if entered:
                self._status = SessionStatus.of(self)
                return self._status
        if self._status is not None:
            return self._status
        with self.boundary.blocking():             # the very first picture: wait for it
            self._status = SessionStatus.of(self)
            return self._status

    def reconfigure(self, control: ControlConfig, ports: Optional[Mapping[str, PortConfig]] = None) -> None:
        """Run-time settings take effect at the next boundary (the node's parameters): the
        control section, and the ports' settings that do not change what fills a buffer
        (staleness, QoS...). InvalidArgument, with nothing changed, for a port that is not
        this session's or whose binding (message type, fields, shape, dtype) would change:
        those shape the graph and its fingerprint. Busy when no boundary comes in time."""
        ports = dict(ports or {})
        unknown = sorted(set(ports) - set(self.ports))
        if unknown:
            raise InvalidArgument(f"ports {unknown}: not ports of this session ({sorted(self.ports)})")
        for name, port in ports.items():
            if port.binding() != self.ports[name].config.binding():
                raise InvalidArgument(f"ports.{name}: its message type, fields, shape and dtype are fixed at start-up")
        if control.mode == "trigger" and control.trigger_port not in self.ports:
            raise InvalidArgument(f"control.trigger_port = {control.trigger_port!r}: not a port")
        with self.boundary.lifecycle():          # also while the verbs are suspended (an inactive node)
            self.control = control
            self.boundary.timeout_s = control.service_timeout_ms / 1e3
            for name, port in ports.items():
                self.ports[name].config = port

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

    # -- verbs that change the episode -----------------------------------------------------------
    def commit(self, label: str = "", persist: bool = False, pin: bool = False) -> Capsule:
        """Snapshot the whole state at this boundary into a new capsule: the lineage and the
        COMMIT event change at this boundary. With ``persist`` the capsule is then saved
        outside the boundary (the control loop keeps stepping) and this returns once its
        file is written. Raises InvalidArgument (label), WrongState (IDLE), ResourceExhausted,
        Busy, CapsuleIOError (persist without a directory), all with nothing changed; and
        SaveFailed when the capsule was made but its file could not be written."""
        _check_label(label)
        saver = self.capsules.require_saver() if persist else None
        with self.boundary.held():
            self._require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="commit")
            capsule = self._snapshot(label, pinned=pin)
            self.lineage = capsule.id
            self._emit(EventKind.COMMIT, capsule, detail=label)
            job = saver.begin(capsule) if saver is not None else None
        if job is not None:
            try:
                self._write(job)
            except CapsuleRosError as exc:
                raise SaveFailed(capsule, exc) from exc
        return capsule

    def reset(self, capsule_id: str = "") -> EpisodeStart:
        """Start a new episode from the initial state or from a capsule's state (in memory
        or read from its file). Raises InvalidArgument, NotFound, CorruptCapsule,
        FingerprintMismatch, PermissionDenied, CapsuleIOError (the capsule), ResourceExhausted
        (no room for the episode's root capsule) and Busy, with the live state unchanged."""
        if not capsule_id:
            with self.boundary.held():
                return self._start_episode(None)
        with self._held_with(check_capsule_id(capsule_id)) as source:
            return self._start_episode(source)

    def interrupt(self, hold_mode: int = HoldMode.HOLD_LAST, commit: bool = True, *,
                  timeout_s: Optional[float] = None) -> Optional[Capsule]:
        """Stop acting at this boundary; optionally commit the boundary capsule (held until
        re-entered or replaced). Raises InvalidArgument (hold mode), WrongState (not
        RUNNING), ResourceExhausted (commit without room) and Busy (no boundary within
        ``timeout_s``, default control.service_timeout_ms)."""
        mode = _hold_mode(hold_mode)
        with self.boundary.held(timeout_s):
            self._require(EpisodeState.RUNNING, verb="interrupt")
            return self._interrupt(mode, commit)

    def suspend_serving(self, reason: str, hold_mode: int = HoldMode.HOLD_LAST, *,
                        timeout_s: Optional[float] = None) -> Optional[Capsule]:
        """Stop serving the verbs (the node's lifecycle deactivate): from now on each verb
        answers WrongState(``reason``), also one already waiting for the boundary; at the
        next boundary a RUNNING episode is interrupted with ``hold_mode`` (the boundary
        capsule committed, the INTERRUPT event and its safe action), which
        ``resume_serving`` re-enters. The verbs are refused before the boundary is taken,
        so none can change the state between this interrupt and the resume. Returns the
        interrupt capsule (None when no episode was running). Busy when no boundary comes
        within ``timeout_s`` (ResourceExhausted: no room for the capsule): the verbs are
        served again and nothing changed."""
        mode = _hold_mode(hold_mode)
        self.boundary.suspend(reason)
        try:
            with self.boundary.lifecycle(timeout_s):
                self._resume_when_served = self.state == EpisodeState.RUNNING
                return self._interrupt(mode, True) if self._resume_when_served else None
        except BaseException:
            self.boundary.resume()
            raise

    def resume_serving(self, timeout_s: Optional[float] = None) -> Optional[ReenterResult]:
        """Serve the verbs again (the node's lifecycle activate), at one boundary: the
        episode ``suspend_serving`` interrupted resumes from its interrupt capsule (bit for
        bit), then the verbs are served. Busy when no boundary comes within ``timeout_s``:
        still suspended, nothing changed."""
        with self.boundary.lifecycle(timeout_s):
            result = None
            if self._resume_when_served and self.state == EpisodeState.INTERRUPTED:
                result = self._resume_interrupted()
            self._resume_when_served = False
            self.boundary.resume()
            return result

    @property
    def suspended(self) -> str:
        """Why the verbs are refused (``suspend_serving``); "" while they are served."""
        return self.boundary.suspended

    def reenter(self, capsule_id: str = "", *, only: Sequence[BufferKind] = ()) -> ReenterResult:
        """Restore a capsule and resume ("" = the interrupt capsule, or the untouched live
        state after an interrupt without one). A capsule that cannot be restored is rebuilt
        by the recompute fallback when the input log covers it, or else from its file's
        recipe under this fingerprint (on a replica, outside the boundary: the control loop
        keeps stepping meanwhile). Raises the capsule's own error (with the reasons there is
        no fallback), WrongState, ResourceExhausted, Busy.

        ``only`` (an ablation, ``capsule-ros replay --ablation``): restore just these buffer
        kinds of the capsule and keep the rest of the live state."""
        if only and capsule_id:
            return self._reenter_only(capsule_id, only)
        if not capsule_id:
            with self.boundary.held():
                return self._resume_interrupted()
        try:
            with self._held_with(check_capsule_id(capsule_id)) as source:
                capsule = self.capsules.in_store(source)
                seconds = self.store.restore(capsule.id, self.runtime,
                                             count_as=Tier.DISK if source.data is not None else None).seconds
                return self._resume(capsule, "", seconds, 0.0)
        except UNRESTORABLE as exc:
            cause = exc
        # the recompute fallback: the file's recipe read outside the boundary when the input log
        # cannot rebuild it, plan under the boundary, replay outside it, adopt under it again
        chain = None if self.recompute.knows(capsule_id) else self.capsules.recipe_chain(capsule_id)
        with self.boundary.held():
            plan = self.recompute.plan(capsule_id, cause, chain)   # re-raises ``cause`` when neither can
        try:
            seconds = self.recompute.rebuild(plan)
            with self.boundary.held():                         # Busy, or suspended meanwhile: WrongState
                capsule = self.recompute.adopt(capsule_id, plan, cause, seconds)
                self.counters.fallback_recomputes += 1
                self.store.restore(capsule.id, self.runtime)
                return self._resume(capsule, str(cause), 0.0, seconds)
        except BaseException:
            # its room must go back, whatever the wait (a no-op once adopted); after a
            # release (lifecycle cleanup) the store is gone with it
            with contextlib.suppress(WrongState), self.boundary.blocking():
                self.recompute.unreserve(plan)
            raise

    def fork(self, capsule_id: str = "", label: str = "") -> Capsule:
        """A new capsule id with the same state ("" = the live state at this boundary).
        Raises InvalidArgument, NotFound, CorruptCapsule, FingerprintMismatch,
        ResourceExhausted, WrongState (live state while IDLE) and Busy."""
        _check_label(label)
        if not capsule_id:
            with self.boundary.held():
                self._require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="fork the live state")
                capsule = self._snapshot(label)
                self._emit(EventKind.FORK, capsule, detail=label)
                return capsule
        with self._held_with(check_capsule_id(capsule_id)) as source:
            parent = self.capsules.in_store(source)
            capsule = self.store.fork(parent.id, label=label)
            self.recompute.remember(capsule, like=parent.id)
            self._emit(EventKind.FORK, capsule, detail=label)
            return capsule

    # -- verbs on the capsule set (they leave the live state alone) ------------------------------
    def list(self, current_episode_only: bool = False) -> List[Capsule]:
        """Capsules in memory and in the capsule directory, newest first."""
        with self.boundary.held():
            in_memory, episode = self.store.list(), self.episode_id
        return self.capsules.with_files(in_memory, episode if current_episode_only else None)

    def drop(self, capsule_id: str, from_disk: bool = False) -> None:
        """Forget a capsule from memory (and its file with ``from_disk``). Once this returns,
        the capsule never comes back, even if a save of it was still writing. Raises
        InvalidArgument, NotFound, WrongState (the interrupt capsule while interrupted) and Busy."""
        check_capsule_id(capsule_id)
        has_file = self.capsules.has_file(capsule_id)
        with self.boundary.held():
            if self.state == EpisodeState.INTERRUPTED and capsule_id == self.interrupt_capsule_id:
                raise WrongState(f"capsule {capsule_id!r} is the interrupt capsule: re-enter or reset first")
            capsule = self.capsules.drop(capsule_id, from_disk, has_file)
            if from_disk and self.files is not None:
                self.files.removed(capsule_id)
            self._emit(EventKind.DROP, capsule, capsule_id=capsule_id,
                       detail="memory and disk" if from_disk else "memory")
        if from_disk:
            self.capsules.remove_file(capsule_id)

    def save(self, capsule_id: str) -> Capsule:
        """Write an in-memory capsule to the capsule directory (atomic, verified) without
        holding up the control loop. Raises InvalidArgument, NotFound (unknown, only on disk
        already, or dropped while saving), Busy, CapsuleIOError, PermissionDenied."""
        check_capsule_id(capsule_id)
        self.capsules.require_saver()
        with self.boundary.held():
            job = self.capsules.begin_save(capsule_id)
        return self._write(job)

    def load(self, capsule_id: str) -> Capsule:
        """Read and verify a capsule file into memory (the live state is not touched).
        Raises NotFound, CorruptCapsule, FingerprintMismatch, PermissionDenied,
        CapsuleIOError (the file's own problem, even when the capsule is in memory),
        ResourceExhausted and Busy."""
        self.capsules.require_saver()
        fetched = self.capsules.reader.read(check_capsule_id(capsule_id))
        with self.boundary.held():
            capsule = self.capsules.in_store(self.capsules.reader.raise_error(fetched))
            self._emit(EventKind.LOAD, capsule, detail=capsule.path or "")
            return capsule

    # -- internals ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _held_with(self, capsule_id: str) -> Iterator[Source]:
        """The boundary held, with the capsule's state in memory or from its file, read and
        verified outside the boundary first. When the capsule leaves memory between the read
        and the boundary, its file is read again. Raises the capsule's typed error."""
        reader = self.capsules.reader
        for _ in range(3):
            fetched = None if reader.in_memory(capsule_id) else reader.read(capsule_id)
            with self.boundary.held():
                source = reader.resolve(capsule_id, fetched)
                if source is not None:
                    yield source
                    return
        raise Busy(f"capsule {capsule_id!r} kept leaving memory while it was being read; try again")

    def _write(self, job: SaveJob) -> Capsule:
        """Outside the boundary: the file of a save begun under it. Its loan always ends
        under the boundary, which must not give up on that (it waits behind at most a step)."""
        saver = self.capsules.require_saver()
        try:
            path = saver.write(job)
        except BaseException:
            with self.boundary.blocking():
                saver.end(job)
            raise
        with self.boundary.blocking():
            saver.end(job)
            job.capsule.path = str(path)
            if self.files is not None:
                self.files.saved(job.capsule.id, job.written)
            self._emit(EventKind.SAVE, job.capsule, detail=job.capsule.path)
        return job.capsule

    def _reenter_only(self, capsule_id: str, only: Sequence[BufferKind]) -> ReenterResult:
        """``reenter(capsule_id, only=...)``: re-enter, then put every other buffer kind back
        from a capsule of the live state taken just before."""
        with self.boundary.held():
            live = self.store.snapshot(self.runtime, label="ablation: live state", episode_id=self.episode_id,
                                       step=self.step, held=True)
        try:
            result = self.reenter(capsule_id)
            with self.boundary.held():
                for kinds in _runs_without(only):
                    self.store.restore(live.id, self.runtime, kinds=kinds)
            return result
        finally:
            with self.boundary.blocking():
                self.store.drop(live.id)

    # -- internals under the boundary ----------------------------------------------------------
    def _require(self, *states: EpisodeState, verb: str) -> None:
        if self.state not in states:
            raise WrongState(f"cannot {verb} while {self.state.name} (allowed in "
                             f"{' / '.join(s.name for s in states)})")

    def _interrupt(self, mode: HoldMode, commit: bool) -> Optional[Capsule]:
        """Stop acting at this boundary (RUNNING), with the boundary capsule if ``commit``."""
        capsule = self._snapshot("interrupt", held=True) if commit else None
        self._release_interrupt_capsule()
        if capsule is not None:
            self.interrupt_capsule_id = self.lineage = capsule.id
        self.hold_mode = mode
        self.state = EpisodeState.INTERRUPTED
        self._emit(EventKind.INTERRUPT, capsule, detail=mode.name)
        return capsule

    def _snapshot(self, label: str, pinned: bool = False, held: bool = False) -> Capsule:
        capsule = self.store.snapshot(self.runtime, label=label, parent_id=self.lineage,
                                      episode_id=self.episode_id, step=self.step, pinned=pinned, held=held)
        self.recompute.remember(capsule)
        return capsule

    def _start_episode(self, source: Optional[Source]) -> EpisodeStart:
        """The new episode's state (initial, or ``source``'s) and its root capsule, with room
        for the root reserved before anything changes."""
        capsule = source.capsule if source else None
        room: Optional[Reservation]
        if source is None:
            room = self.store.reserve()
        else:          # from memory, or straight from its file's bytes (not kept in a pool)
            room = self.store.restore(source.capsule, self.runtime, data=source.data, reserve=True).room
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
                                   episode_id=episode, step=step, held=True, into=room)
        self.recompute.start(root)
        self.inputs.reset_ordering()
        self.state = EpisodeState.RUNNING
        self._emit(EventKind.RESET, capsule, detail=f"episode {episode}")
        return EpisodeStart(episode, capsule)

    def _resume_interrupted(self) -> ReenterResult:
        """``reenter("")``: the interrupt capsule, or the untouched live state after an
        interrupt without one."""
        if self.interrupt_capsule_id:          # held: always in memory
            capsule = self.store.get(self.interrupt_capsule_id)
            return self._resume(capsule, "", self.store.restore(capsule.id, self.runtime).seconds, 0.0)
        if self.state != EpisodeState.INTERRUPTED:
            raise WrongState(f"reenter without a capsule id needs an interrupt capsule "
                             f"(episode is {self.state.name})")
        self.state = EpisodeState.RUNNING     # no capsule: resume the untouched live state
        self._emit(EventKind.REENTER, None, detail="resume")
        return ReenterResult(None, False, False, "", 0.0, 0.0)

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

    def _faulted(self, fault: StepFault, stamp_ns: int, published: bool, seconds: float,
                 deadline_s: Optional[float]) -> ActionRecord:
        """A tick whose step faulted: its safe action, and a warning saying why."""
        record = self._fault_record(fault, stamp_ns, published=published, seconds=seconds)
        detail = (f"missed its {deadline_s * 1e3:.1f} ms deadline" if fault == StepFault.LATE and deadline_s
                  else "missed its deadline" if fault == StepFault.LATE else self.counters.last_fault)
        self.notices.warn(f"fault.{fault.value}", f"step {record.step + 1} {detail}: published the safe action "
                                                   f"({self.control.deadline_action})")
        return record

    def _count_stale_ports(self, now_ns: int) -> None:
        for adapter in self.ports.values():
            if adapter.is_stale(now_ns):
                adapter.counters.stale_steps += 1
                self.notices.warn(f"stale.{adapter.name}", f"port {adapter.name} is stale "
                                  f"({adapter.age_ms(now_ns):.0f} ms > {adapter.config.staleness_ms:.0f} ms)")

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

    def _release_interrupt_capsule(self) -> None:
        if self.interrupt_capsule_id:
            if self.interrupt_capsule_id != self.recompute.root_id:   # a log root stays held
                self.store.hold(self.interrupt_capsule_id, False)
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
        except Exception:
            LOG.exception("capsule event observer failed")


def _hold_mode(value: int) -> HoldMode:
    try:
        return HoldMode(value)
    except ValueError:
        raise InvalidArgument(f"hold_mode {value!r}: must be one of {[m.value for m in HoldMode]}") from None


def _check_label(label: str) -> None:
    if not isinstance(label, str) or len(label) > MAX_LABEL:
        raise InvalidArgument(f"label of {len(label) if isinstance(label, str) else '?'} characters: "
                              f"at most {MAX_LABEL}")


def _runs_without(kinds: Sequence[BufferKind]) -> List[Tuple[BufferKind, ...]]:
    """The buffer kinds not in ``kinds``, as runs contiguous in the arena's layout order."""
    runs: List[List[BufferKind]] = [[]]
    for kind in KIND_ORDER:
        if kind in kinds:
            runs.append([])
        else:
            runs[-1].append(kind)
    return [tuple(run) for run in runs if run]
