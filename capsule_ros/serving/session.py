"""PolicySession: one runtime and one capsule store served, without ROS.

``capsule_ros.ros`` maps topics and services onto it; ``capsule-ros replay`` and the demo drive it
directly. Policy, not mechanism: the runtime and the store provide verbs (step, snapshot, restore, fork);
the session decides when to use them. It composes parts with one job each, the control loop
(``capsule_ros.serving.loop``) and the episode state machine (``capsule_ros.serving.machine``: the verbs
over the capsule set and the recompute fallback), and owns the step boundary and the lifecycle itself.
Its faces: ``verbs`` (the table of ``capsule_ros.serving.verbs``), ``loop`` (``feed``, ``tick``,
``clock_jumped``), ``status()`` and ``episode``, and the lifecycle (``warm_up``, ``suspend`` /
``resume``, ``reconfigure``, ``release``, ``close``). What its owner decides about it is one frozen
``SessionOptions``, given at construction. A fleet's robots (``capsule_ros.fleet``) are sessions that
share one boundary (``together_with``), ticked together (``ticking_together``).

Concurrency: this module shows every use of the boundary (``capsule_ros.serving.boundary``):
``blocking()`` for a tick, ``held()`` for a verb (BUSY after ``control.service_timeout_ms``;
WRONG_STATE while suspended), ``lifecycle()`` for the node's transitions and parameters,
``unless_busy()`` for status. The parts never take it and never call back into the session
(test_layers.py and test_session_parts.py hold both): they return plans and results, and each says
whether it runs under the boundary or outside it. File I/O and a recompute's replay happen outside it.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.capsules.store import Capsule, CapsuleStore
from capsule_ros.errors import Busy, CapsuleRosError, WrongState
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.runtime.schema import BufferKind
from capsule_ros.serving.boundary import Boundary
from capsule_ros.serving.capsule_set import CapsuleSet, DirectoryWatch
from capsule_ros.serving.config import ControlConfig, PortConfig
from capsule_ros.serving.episode import Episode, Events
from capsule_ros.serving.files import SaveFailed, SaveJob, Source
from capsule_ros.serving.loop import ControlLoop, Fed, Tick, Ticks
from capsule_ros.serving.machine import EpisodeMachine
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.parts import SessionParts
from capsule_ros.serving.ports import stamp_ns
from capsule_ros.serving.recompute import UNRESTORABLE, Recompute
from capsule_ros.serving.records import (
    ActionRecord,
    EpisodePicture,
    EpisodeStart,
    EpisodeState,
    HoldMode,
    ReenterResult,
    SessionStatus,
    StalePicture,
)
from capsule_ros.serving.statecheck import StateVerdict
from capsule_ros.serving.verbs import check_label, hold_mode_of


class PolicySession:
    """See the module docstring."""

    def __init__(self, runtime: PolicyRuntime, store: CapsuleStore, control: ControlConfig, *,
                 directory: Optional[CapsuleDirectory] = None, ports: Optional[Mapping[str, PortConfig]] = None,
                 prefix: Sequence[int] = (), watch: Optional[DirectoryWatch] = None,
                 options: Optional[SessionOptions] = None, together_with: Optional[PolicySession] = None,
                 state_check: Optional[StateVerdict] = None):
        """``together_with``: share its boundary (a fleet's robots: ``ticking_together``); ``state_check``: the
        start-up state check beside serving, which restores wait for (``capsule_ros.serving.statecheck``)."""
        options = options or SessionOptions()
        boundary = together_with.parts.boundary if together_with else Boundary(control.service_timeout_ms / 1e3)
        episode = Episode(np.zeros(runtime.policy.action_dim, dtype=np.float32))
        events = Events(episode, options.on_event)
        recompute = Recompute(runtime, store, control.input_log_steps, control.input_log_max_mb, tuple(prefix))
        loop = ControlLoop(runtime, episode, events, control, ports or {}, recompute.log_step, options)
        capsules = CapsuleSet(store, directory, runtime.layout.schema(), recompute, between_steps=loop.stepper.idle)
        machine = EpisodeMachine(runtime, store, episode, events, loop, capsules, recompute, prefix, watch)
        store.on_evict = events.evicted
        self._parts = SessionParts(runtime, store, directory, boundary, loop, machine, capsules, recompute)
        self._watch = watch
        self._options = options
        self._status: Optional[SessionStatus] = None
        self._state_check = state_check or StateVerdict()
        self._verbs = SessionVerbs(self._parts, self._state_check)
        self._loop = SessionLoop(boundary, loop)

    @property
    def verbs(self) -> SessionVerbs:
        """The capsule verbs, each at the boundary (``capsule_ros.serving.verbs``' table)."""
        return self._verbs

    @property
    def loop(self) -> SessionLoop:
        """The control loop's entries: ``feed``, ``tick``, ``clock_jumped``."""
        return self._loop

    @property
    def parts(self) -> SessionParts:
        """What the session composes (``SessionParts``: for tests and tools)."""
        return self._parts

    @property
    def episode(self) -> EpisodePicture:
        """The live episode without waiting for the boundary (``EpisodePicture`` says what that means)."""
        return self._parts.machine.picture(self._parts.boundary.suspended)

    def status(self) -> SessionStatus:
        """A consistent picture taken between steps. Never waits for a service: while one holds the
        boundary, the previous one (status must not delay the loop, nor read the store under a verb)."""
        boundary = self._parts.boundary
        with boundary.unless_busy() as entered:
            if entered:
                self._status = self._picture()
                return self._status
        if self._status is not None:
            return self._status
        with boundary.blocking():             # the very first picture: wait for it
            self._status = self._picture()
            return self._status

    # -- the lifecycle ------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Rehearse the step path and put the state back (``GuardedStep.rehearse``), at a
        boundary; call it right before stepping starts, so the first step is not a cold one."""
        with self._parts.boundary.blocking():
            self._parts.loop.rehearse()

    def suspend(self, reason: str, hold_mode: int = HoldMode.HOLD_LAST, *,
                timeout_s: Optional[float] = None) -> Optional[Capsule]:
        """Stop serving the verbs (the node's lifecycle deactivate): from now on each verb answers
        WrongState(``reason``), also one already waiting (none changes the state before ``resume``);
        at the next boundary a RUNNING episode is interrupted with ``hold_mode`` and its capsule
        committed, which ``resume`` re-enters. The interrupt capsule, or None. Busy when no boundary
        comes within ``timeout_s`` (ResourceExhausted: no room for the capsule): nothing changed."""
        mode, boundary = hold_mode_of(hold_mode), self._parts.boundary
        boundary.suspend(reason)
        try:
            with boundary.lifecycle(timeout_s):
                return self._parts.machine.suspend(mode)
        except BaseException:
            boundary.resume()
            raise

    def resume(self, timeout_s: Optional[float] = None) -> Optional[ReenterResult]:
        """Serve the verbs again (the node's lifecycle activate), at one boundary: the episode ``suspend``
        interrupted resumes from its interrupt capsule (bit for bit), then the verbs are served. Busy
        when no boundary comes within ``timeout_s``: still suspended, nothing changed."""
        boundary = self._parts.boundary
        with boundary.lifecycle(timeout_s):
            result = self._parts.machine.resume()
            boundary.resume()
            return result

    def reconfigure(self, control: ControlConfig, ports: Optional[Mapping[str, PortConfig]] = None) -> None:
        """Run-time settings take effect at the next boundary (the node's parameters): the control section, and the
        ports' settings that do not change what fills a buffer (staleness, QoS...). InvalidArgument, with nothing
        changed, for what the control loop cannot take (``ControlLoop.check``). Busy when no boundary comes in time."""
        ports, loop, boundary = dict(ports or {}), self._parts.loop, self._parts.boundary
        loop.check(control, ports)
        with boundary.lifecycle():          # also while the verbs are suspended (an inactive node)
            loop.apply(control, ports)
            boundary.timeout_s = control.service_timeout_ms / 1e3

    def close(self) -> None:
        """Stop the watchdog thread, a background regeneration (after its capsule in progress) and the state check."""
        self._parts.loop.close()
        self._state_check.close()
        if self._watch is not None:
            self._watch.close()

    def release(self, timeout_s: float = 30.0) -> None:
        """Close, then free the runtime, its replica and the capsule store at a boundary (lifecycle
        ``cleanup``): the session cannot run again (WRONG_STATE from now on). Capsule files stay."""
        self.close()
        parts = self._parts
        with parts.boundary.lifecycle(timeout_s):
            parts.machine.release()
            parts.recompute.close()
            parts.store.close()
            parts.runtime.close()
            parts.boundary.close()

    def _picture(self) -> SessionStatus:
        """Under the boundary: the status picture from the parts'."""
        parts, now = self._parts, self._options.clock_ns()
        loop = parts.loop.picture(now)
        return SessionStatus.of(parts.machine.picture(parts.boundary.suspended), loop.counters, loop.step_ms,
                                loop.ports, parts.store.stats(), parts.runtime,
                                self._watch.picture() if self._watch is not None else StalePicture(), now)


class SessionLoop:
    """A session's control loop, as its driver sees it (the node's subscriptions and timer,
    a replay): each entry at the boundary it needs."""

    def __init__(self, boundary: Boundary, loop: ControlLoop):
        self._boundary = boundary
        self._loop = loop

    @property
    def control(self) -> ControlConfig:
        """The control settings in effect (``PolicySession.reconfigure`` changes them)."""
        return self._loop.control

    def receiving(self) -> ContextManager[None]:
        """Held while a driver records and feeds a message (a fleet robot's: ``RobotLoop.receiving``)."""
        return contextlib.nullcontext()

    def feed(self, port: str, msg: Any, now_ns: Optional[int] = None, *, stage_only: bool = False,
             late: bool = False) -> Fed:
        """A sensor message at ``now_ns`` (default: the session's clock): staged (or dropped, counted and warned about)
        and, in trigger mode on the trigger port, the tick it triggers, stamped with its header stamp (``stage_only``:
        no tick; ``late``: that tick counts as a deadline miss)."""
        now = self.observe_clock(self._loop.now() if now_ns is None else now_ns)
        drop = self._loop.accept(port, msg, now)
        if drop is not None:
            return Fed(False, drop, False, None)
        if stage_only or not self._loop.triggers(port):
            return Fed(True, None, False, None)
        return Fed(True, None, True, self.tick(stamp_ns(msg), late=late))

    def tick(self, stamp_ns: Optional[int] = None, *, late: bool = False) -> Optional[ActionRecord]:
        """One control period, at a boundary waiting as long as it takes (``ControlLoop.tick``)."""
        now = self.observe_clock(self._loop.now())
        with self._boundary.blocking():
            return self._loop.tick(now, stamp_ns, late)

    def observe_clock(self, now_ns: int) -> int:
        """The session's clock as the control loop reads it (``feed``, ``tick``; the node before it
        records a message): a time earlier than the last one read is a jump back (``clock_jumped``),
        for clocks that report none. Returns ``now_ns``."""
        jump = self._loop.observe_clock(now_ns)
        if jump is not None:
            self.clock_jumped(jump)
        return now_ns

    def clock_jumped(self, delta_ns: int) -> None:
        """The session's clock jumped by ``delta_ns`` (negative: back), as a simulated clock does at
        every loop of ``ros2 bag play --clock --loop``: ``ControlLoop.clock_jumped`` (a replay re-enacts
        its CLOCK_JUMP event there), from the node's clock's jump callback. At a boundary, like a tick."""
        with self._boundary.blocking():
            self._loop.clock_jumped(delta_ns)

    def write_input(self, name: str, values: np.ndarray) -> None:
        """Stage values for an input directly (no port checks: tests and tools)."""
        self._loop.write_input(name, values)

    def missing_inputs(self) -> List[str]:
        """Ports that have not received a value yet (a tick waits for all of them)."""
        return self._loop.inputs.missing()


class SessionVerbs:
    """A session's capsule verbs, one method per verb of ``capsule_ros.serving.verbs``
    (named after it; a request's fields are its parameters): each reads files outside the
    boundary and changes the state under it (``EpisodeMachine``)."""

    def __init__(self, parts: SessionParts, state_check: StateVerdict):
        self._state_check = state_check
        self._boundary = parts.boundary
        self._store = parts.store
        self._machine = parts.machine
        self._capsules = parts.capsules
        self._recompute = parts.recompute

    # -- verbs that change the episode ---------------------------------------------------------------
    def commit(self, label: str = "", persist: bool = False, pin: bool = False) -> Capsule:
        """Snapshot the whole state at this boundary into a new capsule: the lineage and the COMMIT event change at this
        boundary. With ``persist`` the capsule is then saved outside the boundary (the control loop keeps stepping) and
        this returns once its file is written. Raises InvalidArgument (label), WrongState (IDLE), ResourceExhausted,
        Busy, CapsuleIOError (persist without a directory), all with nothing changed; and SaveFailed when the capsule
        was made but its file could not be written."""
        check_label(label)
        saver = self._capsules.require_saver() if persist else None
        with self._boundary.held():
            capsule = self._machine.commit(label, pin)
            job = saver.begin(capsule) if saver is not None else None
        if job is not None:
            try:
                self._write(job)
            except CapsuleRosError as exc:
                raise SaveFailed(capsule, exc) from exc
        return capsule

    def reset(self, capsule_id: str = "") -> EpisodeStart:
        """Start a new episode from the initial state or from a capsule's state (in memory or read from its file).
        Raises InvalidArgument, NotFound, CorruptCapsule, FingerprintMismatch, PermissionDenied, CapsuleIOError (the
        capsule), ResourceExhausted (no room for the episode's root capsule), Busy and WrongState (``StateVerdict``),
        with the live state unchanged."""
        if not capsule_id:
            with self._boundary.held():
                return self._machine.start(None)
        self._state_check.require()
        with self._held_with(check_capsule_id(capsule_id)) as source:
            return self._machine.start(source)

    def interrupt(self, hold_mode: int = HoldMode.HOLD_LAST, commit: bool = True, *,
                  timeout_s: Optional[float] = None) -> Optional[Capsule]:
        """Stop acting at this boundary; optionally commit the boundary capsule (held until re-entered or replaced).
        Raises InvalidArgument (hold mode), WrongState (not RUNNING), ResourceExhausted (commit without room) and Busy
        (no boundary within ``timeout_s``, default control.service_timeout_ms)."""
        mode = hold_mode_of(hold_mode)
        with self._boundary.held(timeout_s):
            self._machine.require(EpisodeState.RUNNING, verb="interrupt")
            return self._machine.interrupt(mode, commit)

    def reenter(self, capsule_id: str = "", *, only: Sequence[BufferKind] = ()) -> ReenterResult:
        """Restore a capsule and resume ("" = the interrupt capsule, or the untouched live state after an interrupt
        without one). A capsule that cannot be restored is rebuilt by the recompute fallback when the input log covers
        it, or else from its file's recipe under this fingerprint (on a replica, outside the boundary: the control loop
        keeps stepping meanwhile). Raises the capsule's own error (with the reasons there is no fallback), WrongState
        (also ``StateVerdict``'s), ResourceExhausted, Busy.  ``only`` (an ablation, ``capsule-ros replay --ablation``):
        restore just these buffer kinds of the capsule and keep the rest of the live state."""
        if only and capsule_id:
            return self._reenter_only(capsule_id, only)
        if not capsule_id:
            with self._boundary.held():
                return self._machine.resume_interrupted()
        self._state_check.require()
        try:
            with self._held_with(check_capsule_id(capsule_id)) as source:
                return self._machine.reenter(source)
        except UNRESTORABLE as exc:
            cause = exc
        chain = None if self._recompute.knows(capsule_id) else self._capsules.recipe_chain(capsule_id)
        while True:     # the recompute fallback (``Recompute.begin_rebuild``): files are read outside the boundary
            with self._boundary.held():
                if (job := self._recompute.begin_rebuild(capsule_id, cause, chain)) is not None:
                    break
            chain = self._capsules.recipe_chain(capsule_id)        # the log's root left memory since ``knows``
        try:
            seconds = self._recompute.rebuild(job, cause)
            with self._boundary.held():                         # Busy, or suspended meanwhile: WrongState
                return self._machine.adopt(capsule_id, job, cause, seconds)
        except BaseException:
            # its room goes back, whatever the wait (a no-op once adopted; after a release, gone with the store)
            with contextlib.suppress(WrongState), self._boundary.blocking():
                self._recompute.unreserve(job)
            raise

    def fork(self, capsule_id: str = "", label: str = "") -> Capsule:
        """A new capsule id with the same state ("" = the live state at this boundary).
        Raises InvalidArgument, NotFound, CorruptCapsule, FingerprintMismatch,
        ResourceExhausted, WrongState (live state while IDLE) and Busy."""
        check_label(label)
        if not capsule_id:
            with self._boundary.held():
                return self._machine.fork_live(label)
        with self._held_with(check_capsule_id(capsule_id)) as source:
            return self._machine.fork(source, label)

    # -- verbs on the capsule set (they leave the live state alone) ----------------------------------
    def list(self, current_episode_only: bool = False) -> List[Capsule]:
        """Capsules in memory and in the capsule directory, newest first."""
        with self._boundary.held():
            in_memory, episode = self._store.list(), self._machine.episode_id
        return self._capsules.with_files(in_memory, episode if current_episode_only else None)

    def drop(self, capsule_id: str, from_disk: bool = False) -> None:
        """Forget a capsule from memory (and its file with ``from_disk``). Once this returns,
        the capsule never comes back, even if a save of it was still writing. Raises
        InvalidArgument, NotFound, WrongState (the interrupt capsule while interrupted) and Busy."""
        check_capsule_id(capsule_id)
        has_file = self._capsules.has_file(capsule_id)
        with self._boundary.held():
            self._machine.drop(capsule_id, from_disk, has_file)
        if from_disk:
            self._capsules.remove_file(capsule_id)

    def save(self, capsule_id: str) -> Capsule:
        """Write an in-memory capsule to the capsule directory (atomic, verified) without
        holding up the control loop. Raises InvalidArgument, NotFound (unknown, only on disk
        already, or dropped while saving), Busy, CapsuleIOError, PermissionDenied."""
        check_capsule_id(capsule_id)
        self._capsules.require_saver()
        with self._boundary.held():
            job = self._capsules.begin_save(capsule_id)
        return self._write(job)

    def load(self, capsule_id: str) -> Capsule:
        """Read and verify a capsule file into memory (the live state is not touched). Raises NotFound,
        CorruptCapsule, FingerprintMismatch, PermissionDenied, CapsuleIOError (the file's own problem,
        even when the capsule is in memory), ResourceExhausted and Busy."""
        self._capsules.require_saver()
        fetched = self._capsules.reader.read(check_capsule_id(capsule_id))
        with self._boundary.held():
            return self._machine.loaded(fetched)

    @contextlib.contextmanager
    def _held_with(self, capsule_id: str) -> Iterator[Source]:
        """The boundary held, with the capsule's state in memory or from its file, read and
        verified outside the boundary first. When the capsule leaves memory between the read
        and the boundary, its file is read again. Raises the capsule's typed error."""
        reader = self._capsules.reader
        for _ in range(3):
            fetched = None if reader.in_memory(capsule_id) else reader.read(capsule_id)
            with self._boundary.held():
                source = reader.resolve(capsule_id, fetched)
                if source is not None:
                    yield source
                    return
        raise Busy(f"capsule {capsule_id!r} kept leaving memory while it was being read; try again")

    def _write(self, job: SaveJob) -> Capsule:
        """Outside the boundary: the file of a save begun under it. Its loan always ends under
        the boundary, which must not give up on that (it waits behind at most a step)."""
        saver = self._capsules.require_saver()
        try:
            path = saver.write(job)
        except BaseException:
            with self._boundary.blocking():
                saver.end(job)
            raise
        with self._boundary.blocking():
            self._machine.saved(job, str(path))
        return job.capsule

    def _reenter_only(self, capsule_id: str, only: Sequence[BufferKind]) -> ReenterResult:
        """``reenter(capsule_id, only=...)``: re-enter, then the other kinds back from the live state's."""
        with self._boundary.held():
            live = self._machine.snapshot_live("ablation: live state")
        try:
            result = self.reenter(capsule_id)
            with self._boundary.held():
                self._machine.restore_kinds(live.id, only)
            return result
        finally:
            with self._boundary.blocking():
                self._store.drop(live.id)


@contextlib.contextmanager
def ticking_together(ticks: Sequence[Tuple[PolicySession, Optional[int], bool]]) -> Iterator[List[Tick]]:
    """Ticks (session, stamp, late) of sessions sharing one boundary (a fleet's robots), begun at one
    boundary held for the block: the driver steps them in one fleet step, then ``Tick.finish``es each."""
    nows = [session.loop.observe_clock(session._parts.loop.now()) for session, _, _ in ticks]
    with ticks[0][0]._parts.boundary.blocking(), contextlib.closing(Ticks()) as begun:
        begun.extend(session._parts.loop.begin_tick(now, stamp, late)
                     for (session, stamp, late), now in zip(ticks, nows, strict=True))
        yield begun


def release_together(sessions: Sequence[PolicySession], timeout_s: float = 30.0) -> None:
    """``release`` of closed sessions sharing one boundary and store (a fleet's robots; the fleet closes
    the runtime), at one boundary, which from then on answers WRONG_STATE to all of them."""
    with sessions[0]._parts.boundary.lifecycle(timeout_s):
        for parts in (session._parts for session in sessions):
            parts.machine.release()
            parts.recompute.close()
        sessions[0]._parts.store.close()
        sessions[0]._parts.boundary.close()
