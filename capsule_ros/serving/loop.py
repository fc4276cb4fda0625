"""The control loop of a session: sensor inputs in, the guarded step, the clock, and the
accounting (dropped and stale inputs, faults, clock jumps) with its throttled warnings.

A part of ``PolicySession``, with one job. It never takes the session's boundary and never
calls back into the session: each method says whether its caller holds the boundary
(``tick``, ``clock_jumped``, ``rehearse``, ``apply``, ``picture``) or needs none
(``accept``, ``observe_clock``: sensor values are staged under the inputs' own lock,
which a step holds while it reads them). The session (``capsule_ros.serving.session``)
enters the boundary around them, so a replay that drives the session counts exactly
what the node counts, where the node counted it.

What a tick hands out: the policy's action when its step was on time, raised nothing and
produced finite values; otherwise the safe action (``control.deadline_action``: hold the
last on-time policy action, or zeros); ``capsule_ros.serving.stepping`` has the rules.
With ``SessionOptions.on_safe_action`` a deadline watchdog hands the safe action out at
the deadline, while the late step still runs.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from capsule_ros.errors import InvalidArgument
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.runtime.mode import StepReport
from capsule_ros.serving.config import ControlConfig, PortConfig
from capsule_ros.serving.episode import Episode, Events
from capsule_ros.serving.notices import Notices
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.ports import PortAdapter, PortDrop, SensorInputs
from capsule_ros.serving.records import (
    ActionRecord,
    ActionSource,
    EpisodeState,
    EventKind,
    HoldMode,
    PortPicture,
    SessionCounters,
    StepFault,
    clock_jump_detail,
)
from capsule_ros.serving.stepping import GuardedStep, LogStep, PendingStep, StepResult

LOG = logging.getLogger(__name__)


class Fed(NamedTuple):
    """What became of one sensor message (``SessionLoop.feed``)."""

    accepted: bool                     # staged (else dropped and counted: ``drop`` says why)
    drop: Optional[PortDrop]
    stepped: bool                      # it was a trigger message and ran a tick
    record: Optional[ActionRecord]     # that tick's action (None: nothing to publish)


class LoopPicture(NamedTuple):
    """The control loop's part of a status picture."""

    counters: SessionCounters          # a copy
    step_ms: Dict[float, float]        # percentile -> ms
    ports: Tuple[PortPicture, ...]


class Tick:
    """A tick begun (``ControlLoop.begin_tick``): ``pending``, the guarded step it waits for
    (None: it needs none: interrupted, idle, inputs missing); ``record``, its result, once
    it has one. Its driver either lets it step its own runtime (``run``) or steps the
    runtime itself (with others, in one fleet step) and gives the outcome to ``finish``.
    Under the session's boundary from begin to finish."""

    def __init__(self, loop: ControlLoop, now_ns: int, stamp_ns: int, deadline_s: Optional[float],
                 pending: Optional[PendingStep], record: Optional[ActionRecord]):
        self._loop = loop
        self.now_ns, self.stamp_ns, self.deadline_s = now_ns, stamp_ns, deadline_s
        self.pending = pending
        self.record = record

    @property
    def needs_step(self) -> bool:
        """Whether the runtime must step before ``finish`` (and the upload did not fail)."""
        return self.pending is not None and self.pending.error is None

    def run(self) -> Optional[ActionRecord]:
        """The runtime's own step if one is pending, then ``finish``: the whole tick."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.record = self._loop.finish_tick(self, self._loop.stepper.step_alone(pending))
        return self.record

    def __enter__(self) -> Tick:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """A tick whose block ends before its driver finished it: the step counts as failed
        (undone with the guard), so the inputs' lock and the watchdog are let go; nothing
        for a finished tick."""
        if self.pending is not None:
            self.finish(None, RuntimeError("the tick's block ended before its step was finished"))

    def finish(self, report: Optional[StepReport], error: Optional[BaseException] = None,
               finite: Optional[bool] = None) -> Optional[ActionRecord]:
        """After its driver stepped the runtime (``report``) or the step raised (``error``);
        a no-op returning the record when nothing is pending. ``finite``: the driver's
        check of the outputs (``GuardedStep.finish``)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.record = self._loop.finish_tick(self, self._loop.stepper.finish(pending, report, error, finite))
        return self.record


class Ticks(List[Tick]):
    """Ticks begun together (a fleet step's); ``close``: each one's ``Tick.close``."""

    def close(self) -> None:
        for tick in self:
            tick.close()


class ControlLoop:
    """See the module docstring. ``log_step`` takes each counted step's inputs and action
    (the recompute fallback's input log)."""

    def __init__(self, runtime: PolicyRuntime, episode: Episode, events: Events, control: ControlConfig,
                 ports: Mapping[str, PortConfig], log_step: LogStep, options: SessionOptions):
        self._episode = episode
        self._events = events
        self._control = control
        self._options = options
        self._clock_seen_ns: Optional[int] = None       # the clock when the loop last read it
        self.counters = SessionCounters()
        self.notices = Notices(LOG, muted=not options.warnings)
        self.inputs = SensorInputs(runtime.staging, dict(ports), runtime.policy.text_inputs(), runtime.texts)
        self.stepper = GuardedStep(runtime, self.inputs, self.counters, log_step)
        if options.on_safe_action is not None:
            self.stepper.start_watchdog(self._on_overrun)

    @property
    def control(self) -> ControlConfig:
        """The control settings in effect (``apply`` changes them)."""
        return self._control

    @property
    def ports(self) -> Dict[str, PortAdapter]:
        return self.inputs.ports

    def now(self) -> int:
        return self._options.clock_ns()

    # -- no boundary needed ------------------------------------------------------------------------
    def accept(self, port: str, msg: Any, now_ns: int) -> Optional[PortDrop]:
        """A sensor message for ``port``: checked (against ``now_ns`` for future stamps),
        converted and staged; or dropped, counted and warned about (the drop, returned)."""
        tolerance = self._control.future_tolerance_ms
        try:
            self.inputs.receive(port, msg, now_ns, int(tolerance * 1e6) if tolerance > 0 else None)
        except PortDrop as drop:
            self.notices.warn(f"drop.{port}.{drop.reason}", functools.partial(_dropped, port, drop))
            return drop
        return None

    def triggers(self, port: str) -> bool:
        """Whether a message on ``port`` runs a tick (trigger mode, the trigger port)."""
        return self._control.mode == "trigger" and port == self._control.trigger_port

    def observe_clock(self, now_ns: int) -> Optional[int]:
        """The clock as the loop reads it: a time earlier than the last one read is a jump
        back, for clocks that report none (a wall clock stepped back): its size, which the
        caller applies (``clock_jumped``) at a boundary; None when the clock did not go back."""
        seen, self._clock_seen_ns = self._clock_seen_ns, now_ns
        return now_ns - seen if seen is not None and now_ns < seen else None

    def safe_record(self, mode: HoldMode, stamp_ns: Optional[int] = None, *, fault: StepFault = StepFault.NONE,
                    published: bool = False, step: Optional[int] = None) -> Optional[ActionRecord]:
        """The safe action of ``mode`` as a record (None when silent): zeros, or the last
        on-time policy action held. ``step`` is the state's step it reports (default: now)."""
        if mode == HoldMode.HOLD_SILENT:
            return None
        episode, zero = self._episode, mode == HoldMode.HOLD_ZERO
        held = episode.last_action
        return ActionRecord(np.zeros_like(held) if zero else held.copy(), None,
                            ActionSource.ZERO if zero else ActionSource.HOLD, episode.episode_id,
                            episode.step if step is None else step, episode.lineage,
                            self.now() if stamp_ns is None else stamp_ns, fault, published)

    def write_input(self, name: str, values: np.ndarray) -> None:
        """Stage values for an input directly (no port checks: tests and tools)."""
        self.inputs.write(name, values)

    def check(self, control: ControlConfig, ports: Mapping[str, PortConfig]) -> None:
        """InvalidArgument, with nothing changed, for settings ``apply`` cannot take: a port
        that is not this loop's or whose binding (message type, fields, shape, dtype) would
        change (those shape the graph and its fingerprint), a trigger port that is not a port."""
        unknown = sorted(set(ports) - set(self.ports))
        if unknown:
            raise InvalidArgument(f"ports {unknown}: not ports of this session ({sorted(self.ports)})")
        for name, port in ports.items():
            if port.binding() != self.ports[name].config.binding():
                raise InvalidArgument(f"ports.{name}: its message type, fields, shape and dtype are fixed at start-up")
        if control.mode == "trigger" and control.trigger_port not in self.ports:
            raise InvalidArgument(f"control.trigger_port = {control.trigger_port!r}: not a port")

    def close(self) -> None:
        """Stop the watchdog's thread."""
        self.stepper.close()

    # -- under the boundary --------------------------------------------------------------------------
    def tick(self, now_ns: int, stamp_ns: Optional[int], late: bool) -> Optional[ActionRecord]:
        """One control period at ``now_ns`` (the record stamped ``stamp_ns``, default now).
        RUNNING: a guarded step on the staged inputs (``late`` forces a deadline miss, e.g. a
        replay re-enacting one); INTERRUPTED: the hold mode's safe action (None when silent);
        IDLE or inputs missing: None. After a policy action, ports older than their
        ``staleness_ms`` count a stale step."""
        return self.begin_tick(now_ns, stamp_ns, late).run()

    def begin_tick(self, now_ns: int, stamp_ns: Optional[int], late: bool) -> Tick:
        """``tick`` in two halves: what it does up to its runtime's step (a ``Tick`` whose
        driver steps the runtime, alone with ``Tick.run``, or with other sessions' runtimes in
        one fleet step and then ``Tick.finish``)."""
        episode = self._episode
        stamp_ns = now_ns if stamp_ns is None else stamp_ns
        if episode.state == EpisodeState.INTERRUPTED:
            return Tick(self, now_ns, stamp_ns, None, None, self.safe_record(episode.hold_mode, stamp_ns))
        if episode.state != EpisodeState.RUNNING:
            return Tick(self, now_ns, stamp_ns, None, None, None)
        if not self.inputs.ready:
            self.notices.warn("inputs", f"waiting for first message on port(s) {self.inputs.missing()}")
            return Tick(self, now_ns, stamp_ns, None, None, None)
        enforce = self._options.enforce_deadline
        deadline = self._control.effective_deadline_s() if enforce else None
        pending = self.stepper.begin(episode.step, deadline, forced_late=late, enforce=enforce)
        return Tick(self, now_ns, stamp_ns, deadline, pending, None)

    def finish_tick(self, tick: Tick, result: StepResult) -> Optional[ActionRecord]:
        """The second half of a tick whose guarded step ended with ``result``."""
        episode = self._episode
        episode.step = result.step
        out = result.outputs
        if result.fault != StepFault.NONE or out is None:
            return self._faulted(result.fault, tick.stamp_ns, result.overran, tick.deadline_s)
        episode.last_action = out.action
        self._count_stale_ports(tick.now_ns)
        return ActionRecord(out.action, out.chunk, ActionSource.POLICY, episode.episode_id, episode.step,
                            episode.lineage, tick.stamp_ns)

    def clock_jumped(self, delta_ns: int) -> None:
        """The clock jumped by ``delta_ns`` (negative: back): the ports forget their stamp
        ordering and their ages go on across the jump (``SensorInputs.clock_jumped``), the
        jump is counted, warned about and published as a CLOCK_JUMP event."""
        self.inputs.clock_jumped(delta_ns)
        self._clock_seen_ns = self.now()
        self.counters.clock_jumps += 1
        self.counters.last_clock_jump_ns = delta_ns
        self.notices.warn("clock", f"the clock jumped {delta_ns / 1e9:+.3f} s (a looping bag's /clock? a "
                                   "simulator reset?): the ports' stamp ordering starts over")
        self._events.emit(EventKind.CLOCK_JUMP, None, detail=clock_jump_detail(delta_ns))

    def rehearse(self) -> None:
        """Rehearse the step path and put the state back (``GuardedStep.rehearse``)."""
        self.stepper.rehearse(self._episode.step)

    def apply(self, control: ControlConfig, ports: Mapping[str, PortConfig]) -> None:
        """Take settings ``check`` accepted."""
        self._control = control
        for name, port in ports.items():
            self.ports[name].config = port

    def picture(self, now_ns: int) -> LoopPicture:
        ports = tuple(PortPicture(a.name, a.config.topic, a.counters.received, dict(a.counters.dropped),
                                  a.counters.stale_steps, a.age_ms(now_ns)) for a in self.ports.values())
        return LoopPicture(SessionCounters(**vars(self.counters)), self.stepper.latency.percentiles_ms(50, 95, 99),
                           ports)

    def _faulted(self, fault: StepFault, stamp_ns: int, published: bool, deadline_s: Optional[float]) -> ActionRecord:
        """A tick whose step faulted: its safe action, and a warning saying why."""
        record = self._fault_record(fault, stamp_ns, published=published)
        detail = (f"missed its {deadline_s * 1e3:.1f} ms deadline" if fault == StepFault.LATE and deadline_s
                  else "missed its deadline" if fault == StepFault.LATE else self.counters.last_fault)
        self.notices.warn(f"fault.{fault.value}", f"step {record.step + 1} {detail}: published the safe action "
                                                   f"({self._control.deadline_action})")
        return record

    def _count_stale_ports(self, now_ns: int) -> None:
        for adapter in self.ports.values():
            if adapter.is_stale(now_ns):
                adapter.counters.stale_steps += 1
                self.notices.warn(f"stale.{adapter.name}", f"port {adapter.name} is stale "
                                  f"({adapter.age_ms(now_ns):.0f} ms > {adapter.config.staleness_ms:.0f} ms)")

    def _on_overrun(self) -> None:
        """The watchdog's thread, while a step overruns: hand out the safe action now. It
        reports the step in progress, as the tick does after a late step (whose state is
        kept), so a recording does not depend on which of the two published it."""
        on_safe_action = self._options.on_safe_action
        if on_safe_action is not None:
            on_safe_action(self._fault_record(StepFault.LATE, self.now(), published=True, step=self._episode.step + 1))

    def _fault_record(self, fault: StepFault, stamp_ns: int, **kwargs: Any) -> ActionRecord:
        """The configured safe action (``control.deadline_action``: never silent) for a fault."""
        mode = HoldMode.HOLD_ZERO if self._control.deadline_action == "zero" else HoldMode.HOLD_LAST
        record = self.safe_record(mode, stamp_ns, fault=fault, **kwargs)
        assert record is not None          # only HOLD_SILENT gives none
        return record


def _dropped(port: str, drop: PortDrop, count: int) -> str:
    """The warning of ``count`` drops of one port and cause since the last such warning."""
    if count == 1:
        return f"port {port}: dropped a message ({drop.reason}): {drop}"
    return f"port {port}: dropped {count} messages ({drop.reason}) since the last warning of it; the latest: {drop}"
