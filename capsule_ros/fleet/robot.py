"""One robot of a fleet, as its node namespace sees it: ``policy_node``'s session faces over
its slot, with a control loop that steps through the fleet.

``RobotSession.session`` is the robot's ``PolicySession`` over its slot's runtime (the
shared capsule store, the shared step boundary): its ``verbs`` (commit, reset, interrupt,
reenter, fork, list, drop, save, load: on this robot's slot only, while the others keep
stepping), ``status()``, ``episode`` and lifecycle are exactly ``policy_node``'s, so the
node's services, status and RunPolicy serve a robot as they serve a node. Feeding and
ticking go through ``RobotSession.loop`` instead (``RobotLoop``): a trigger message asks
the fleet for a step (gathered with the other trigger-mode robots, ``capsule_ros.fleet.gather``),
a tick is a fleet step, and every action record of a fleet step goes to the fleet's
``on_action`` (the node publishes it under the robot's namespace).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Mapping, Optional, Protocol

import numpy as np

from capsule_ros.capsules.store import Capsule
from capsule_ros.fleet.gather import TickGather, TickRequest
from capsule_ros.serving.config import ControlConfig
from capsule_ros.serving.loop import Fed
from capsule_ros.serving.ports import stamp_ns
from capsule_ros.serving.records import ActionRecord, EpisodePicture, SessionStatus
from capsule_ros.serving.session import PolicySession, SessionVerbs


class FleetSteps(Protocol):
    """What a robot's loop needs of its fleet (``capsule_ros.fleet.session.FleetSession``)."""

    feeding: threading.RLock            # held while a robot stages a message or asks for a step
    gather: TickGather

    def step_robots(self, requests: Mapping[str, TickRequest], why: str = "") -> Dict[str, Optional[ActionRecord]]:
        """One fleet step of these robots (their action records, also told to ``on_action``)."""
        ...

    def step_gathered(self, why: str) -> Dict[str, Optional[ActionRecord]]:
        """The gathered requests, stepped now."""
        ...


class RobotLoop:
    """A robot's control loop through its fleet (``SessionLoop``'s entries; see the module
    docstring). ``feed`` returns the robot's own record when a fleet step ran in the call
    (``Fed.record``); every record also goes to the fleet's ``on_action``: publish one of
    the two, not both."""

    def __init__(self, name: str, session: PolicySession, fleet: FleetSteps):
        self._name = name
        self._session = session
        self._fleet = fleet

    @property
    def control(self) -> ControlConfig:
        return self._session.loop.control

    def triggers(self, port: str) -> bool:
        """Whether a message on ``port`` asks for a step (trigger mode, the trigger port)."""
        control = self.control
        return control.mode == "trigger" and port == control.trigger_port

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Held while the node records a message and feeds it: the robot's waiting step, if
        any, runs first (with the fleet's other waiting robots), so that the robot's bag has
        that step's action before the message, as a ``policy_node``'s bag has it (the replay
        steps at each trigger message it reads)."""
        fleet = self._fleet
        with fleet.feeding:
            if fleet.gather.pending(self._name):
                fleet.step_gathered("flushed")
            yield

    def feed(self, port: str, msg: Any, now_ns: Optional[int] = None, *, stage_only: bool = False,
             late: bool = False) -> Fed:
        """A sensor message: staged (or dropped and counted) after the robot's waiting step,
        if any, ran (its inputs are those of its trigger); on the trigger port in trigger
        mode, a step request, and the fleet step when it completes the gather."""
        fleet = self._fleet
        with self.receiving():
            fed = self._session.loop.feed(port, msg, now_ns, stage_only=True)
            if not fed.accepted or stage_only or not self.triggers(port):
                return fed
            if not fleet.gather.add(self._name, stamp_ns(msg), late):
                return Fed(True, None, False, None)
            records = fleet.step_gathered("complete")
        return Fed(True, None, self._name in records, records.get(self._name))

    def tick(self, stamp_ns: Optional[int] = None, *, late: bool = False) -> Optional[ActionRecord]:
        """A fleet step of this robot alone (tests and tools; the fleet's ``tick`` steps many)."""
        with self._fleet.feeding:
            return self._fleet.step_robots({self._name: TickRequest(stamp_ns, late, 0.0)}).get(self._name)

    def clock_jumped(self, delta_ns: int) -> None:
        self._session.loop.clock_jumped(delta_ns)

    def observe_clock(self, now_ns: int) -> int:
        return self._session.loop.observe_clock(now_ns)

    def write_input(self, name: str, values: np.ndarray) -> None:
        """Stage values for an input directly (no port checks: tests and tools)."""
        with self.receiving():
            self._session.loop.write_input(name, values)

    def missing_inputs(self) -> List[str]:
        return self._session.loop.missing_inputs()


class RobotSession:
    """A robot of a fleet (see the module docstring): its name, its slot, its
    ``PolicySession`` and its loop through the fleet."""

    def __init__(self, name: str, slot: int, session: PolicySession, fleet: FleetSteps):
        self.name = name
        self.slot = slot
        self.session = session
        self.loop = RobotLoop(name, session, fleet)

    @property
    def verbs(self) -> SessionVerbs:
        return self.session.verbs

    @property
    def episode(self) -> EpisodePicture:
        return self.session.episode

    def status(self) -> SessionStatus:
        return self.session.status()

    def suspend(self, reason: str, hold_mode: int = 0) -> Optional[Capsule]:
        return self.session.suspend(reason, hold_mode)
