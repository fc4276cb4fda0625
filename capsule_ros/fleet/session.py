"""FleetSession: many robots served from the batch slots of one runtime, without ROS.

One ``FleetRuntime`` (one copy of the weights, one arena with a slot per robot, one
program per execution-mode program over all slots), one capsule store and capsule
directory shared by every robot (a capsule one robot took can be re-entered by another:
same fingerprint), and a ``RobotSession`` per robot: a ``PolicySession`` over its slot.
The robots' sessions share one step boundary (``PolicySession(together_with=...)``): a
fleet step is one step for all of them, a verb on one robot is applied between two fleet
steps (it waits behind at most one), and the shared store and arena are only ever changed
there.

Timing (``capsule_ros.fleet.gather``): trigger-mode robots ask for a step with their
trigger messages and are gathered into one fleet step (complete, or after ``gather_ms``:
``poll``); timer-mode robots step together at the fleet's rate (``tick_timer``, called by
the owner's timer, with whatever trigger requests wait). A robot whose step misses its
deadline gets its safe action, as in ``policy_node`` (its session's guarded step).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Mapping, Optional

import numpy as np

from capsule_ros.capsules.store import Capsule, CapsuleStore
from capsule_ros.errors import InvalidArgument
from capsule_ros.fleet.gather import GatherCounters, TickGather, TickRequest
from capsule_ros.fleet.robot import RobotSession
from capsule_ros.metrics import LatencyWindow
from capsule_ros.runtime.fleet import FleetRuntime, StepOutcome
from capsule_ros.serving.loop import Tick
from capsule_ros.serving.records import ActionRecord, EventKind, EventRecord, HoldMode, SessionStatus
from capsule_ros.serving.session import release_together, ticking_together

OnAction = Callable[[str, ActionRecord], None]


@dataclass(frozen=True)
class FleetStatus:
    """A picture of the fleet: each robot's ``SessionStatus`` and slot, and the fleet's own
    figures (fleet steps, robot steps, the fleet step's time percentiles in ms, gathers)."""

    robots: Dict[str, SessionStatus]
    slots: Dict[str, int]
    slot_count: int
    batching: str
    fingerprint: str
    fleet_steps: int
    robot_steps: int
    step_ms: Dict[float, float]
    gathers: GatherCounters


class FleetSession:
    """See the module docstring. Built by ``capsule_ros.fleet.factory.start_fleet``."""

    def __init__(self, runtime: FleetRuntime, store: CapsuleStore, gather_s: float,
                 on_action: Optional[OnAction] = None):
        self.runtime = runtime
        self.store = store
        self.feeding = threading.RLock()
        self.gather = TickGather(gather_s, frozenset())
        self._on_action = on_action
        self._robots: Dict[str, RobotSession] = {}
        self._listeners: Dict[str, Callable[[EventRecord], None]] = {}
        self._latency = LatencyWindow()
        self._fleet_steps = 0
        self._robot_steps = 0

    # -- robots ----------------------------------------------------------------------------------
    def add(self, robot: RobotSession, on_event: Optional[Callable[[EventRecord], None]] = None) -> None:
        """A robot of this fleet (the factory adds them), with its event observer (its
        ``SessionOptions.on_event``: told the shared store's evictions too)."""
        self._robots[robot.name] = robot
        if on_event is not None:
            self._listeners[robot.name] = on_event
        self._expect()

    @property
    def robots(self) -> Mapping[str, RobotSession]:
        return self._robots

    def robot(self, name: str) -> RobotSession:
        try:
            return self._robots[name]
        except KeyError:
            raise InvalidArgument(f"no robot {name!r} in this fleet ({sorted(self._robots)})") from None

    def reconfigured(self) -> None:
        """A robot's control section changed (``session.reconfigure``): which robots a
        trigger gather waits for follows their step modes."""
        self._expect()

    # -- stepping --------------------------------------------------------------------------------
    def tick(self, robots: Optional[Iterable[str]] = None,
             stamp_ns: Optional[int] = None) -> Dict[str, Optional[ActionRecord]]:
        """One fleet step of ``robots`` (default: every robot), each stamped ``stamp_ns``
        (default: its clock now); the records by robot (also told to ``on_action``)."""
        names = list(self._robots) if robots is None else list(robots)
        with self.feeding:
            return self.step_robots({name: TickRequest(stamp_ns, False, 0.0) for name in names})

    def tick_timer(self) -> Dict[str, Optional[ActionRecord]]:
        """The fleet's timer (``control.rate_hz``): every timer-mode robot, and the trigger
        requests waiting, in one fleet step."""
        with self.feeding:
            requests = {name: TickRequest(None, False, 0.0) for name, robot in self._robots.items()
                        if robot.loop.control.mode == "timer"}
            requests.update(self.gather.take("timed_out"))
            return self.step_robots(requests) if requests else {}

    def poll(self) -> Dict[str, Optional[ActionRecord]]:
        """Step the gathered trigger requests if the oldest has waited ``gather_ms`` (call
        it at least that often, or at ``next_poll``)."""
        with self.feeding:
            return self.step_gathered("timed_out") if self.gather.due() else {}

    def next_poll(self) -> Optional[float]:
        """When ``poll`` has work (``time.monotonic``), None when no request waits."""
        return self.gather.deadline()

    def step_gathered(self, why: str) -> Dict[str, Optional[ActionRecord]]:
        """The gathered requests, stepped now (the caller holds ``feeding``)."""
        requests = self.gather.take(why)
        return self.step_robots(requests) if requests else {}

    def step_robots(self, requests: Mapping[str, TickRequest], why: str = "") -> Dict[str, Optional[ActionRecord]]:
        """One fleet step of the requesting robots (the caller holds ``feeding``): their
        ticks begun together at the shared boundary, the runtimes of those that step run as
        one fleet step, then each tick finished (safe action, undo, counters: each robot's
        own); records to ``on_action`` after the boundary is left."""
        ordered = sorted(requests, key=lambda name: self.robot(name).slot)
        slots = [self._robots[name].slot for name in ordered]
        started = time.perf_counter()
        with ticking_together([(self._robots[n].session, requests[n].stamp_ns, requests[n].late)
                               for n in ordered]) as ticks:
            stepping = [slot for slot, tick in zip(slots, ticks, strict=True) if tick.needs_step]
            outcomes: Dict[int, StepOutcome] = {}
            if stepping:
                try:
                    outcomes = self.runtime.step(stepping)
                except Exception as exc:  # noqa: BLE001 - each stepping robot counts it, gets its safe action
                    outcomes = dict.fromkeys(stepping, exc)
            finite = self._outputs_finite() if stepping else None
            records = {name: _finish(tick, outcomes.get(slot), None if finite is None else bool(finite[slot]))
                       for name, slot, tick in zip(ordered, slots, ticks, strict=True)}
        if stepping:
            self._latency.record(time.perf_counter() - started)
            self._fleet_steps += 1
            self._robot_steps += len(stepping)
        if self._on_action is not None:
            for name, record in records.items():
                if record is not None:
                    self._on_action(name, record)
        return records

    def _outputs_finite(self) -> Optional[np.ndarray]:
        """The fleet's check of every slot's outputs; None when it could not read them (each
        robot's own read then raises and counts the step's error, as it would alone)."""
        try:
            return self.runtime.outputs_finite()
        except Exception:  # noqa: BLE001 - each stepping robot's finish meets and counts it
            return None

    # -- status and the lifecycle ----------------------------------------------------------------
    def status(self) -> FleetStatus:
        return FleetStatus({name: robot.status() for name, robot in self._robots.items()},
                           {name: robot.slot for name, robot in self._robots.items()}, self.runtime.slots,
                           self.runtime.batching, self.runtime.fingerprint, self._fleet_steps, self._robot_steps,
                           self._latency.percentiles_ms(50, 95, 99), GatherCounters(**vars(self.gather.counters)))

    def suspend(self, reason: str, hold_mode: int = HoldMode.HOLD_LAST) -> Dict[str, Optional[Capsule]]:
        """Every robot's ``suspend`` (the node's deactivate): its interrupt capsule, by robot."""
        with self.feeding:
            self.step_gathered("flushed")
            return {name: robot.session.suspend(reason, hold_mode) for name, robot in self._robots.items()}

    def resume(self) -> None:
        """Every robot's ``resume`` (the node's activate)."""
        for robot in self._robots.values():
            robot.session.resume()

    def release(self, timeout_s: float = 30.0) -> None:
        """Every robot's session released at one boundary, then the fleet's runtime (the
        node's cleanup); capsule files stay."""
        sessions = [robot.session for robot in self._robots.values()]
        for session in sessions:
            session.close()
        release_together(sessions, timeout_s)
        self.runtime.close()

    def evicted(self, capsule: Capsule) -> None:
        """The shared store's ``on_evict``: an EVICT event to every robot's event observer (a
        capsule in the shared store is every robot's to re-enter)."""
        record = EventRecord(EventKind.EVICT, capsule.id, capsule.parent_id, capsule.episode_id, capsule.step,
                             False, False, "evicted from memory (byte budget)", None)
        for listener in self._listeners.values():
            listener(record)

    def _expect(self) -> None:
        self.gather.expect(name for name, robot in self._robots.items() if robot.loop.control.mode == "trigger")


def _finish(tick: Tick, outcome: Optional[StepOutcome], finite: Optional[bool]) -> Optional[ActionRecord]:
    """A robot's tick finished with its slot's outcome (a report, an error, or none: it did not
    step) and the fleet's check of its outputs."""
    if isinstance(outcome, Exception):
        return tick.finish(None, outcome)
    return tick.finish(outcome, None, finite)
