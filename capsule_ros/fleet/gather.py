"""Gathering trigger-mode robots' step requests into one fleet step, up to a bounded wait.

In trigger mode a robot steps when its trigger port receives a message. One fleet step
serves every robot that asked, so a request waits for the other trigger-mode robots' (the
gather is *complete* when all of them asked) but no longer than ``fleet.gather_ms`` after
the oldest request (then the fleet steps whoever asked: a silent robot delays the others
by at most that). The wait is spent before the step: a robot's deadline covers its step,
as in ``policy_node``.

A robot's step reads its inputs as they were staged when its trigger came, so nothing may
be staged for a robot while its request waits: any message for it runs the gathered step
first (``capsule_ros.fleet.robot``). Pure bookkeeping: the fleet session runs the steps.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Optional


@dataclass(frozen=True)
class TickRequest:
    """One robot's request: the stamp its action record carries, whether the step counts
    as late (a replay re-enacting a miss), and when it was made (the gather's clock)."""

    stamp_ns: Optional[int]
    late: bool
    since: float


@dataclass
class GatherCounters:
    complete: int = 0          # gathers every trigger-mode robot joined
    timed_out: int = 0         # gathers stepped at the bounded wait, without some robot
    flushed: int = 0           # gathers stepped early: a robot that had asked got another message


@dataclass
class TickGather:
    """The requests of the robots in ``expected`` (see the module docstring). Thread-safe."""

    wait_s: float
    expected: frozenset
    clock: Callable[[], float] = time.monotonic
    counters: GatherCounters = field(default_factory=GatherCounters)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Dict[str, TickRequest] = {}

    def pending(self, robot: str) -> bool:
        """Whether ``robot`` asked and its step has not been taken yet."""
        with self._lock:
            return robot in self._requests

    def add(self, robot: str, stamp_ns: Optional[int], late: bool = False) -> bool:
        """``robot`` asks for a step; True when the gather is complete (step it now)."""
        with self._lock:
            self._requests[robot] = TickRequest(stamp_ns, late, self.clock())
            return self.expected <= set(self._requests)

    def due(self) -> bool:
        """Whether the oldest request has waited its bounded wait."""
        deadline = self.deadline()
        return deadline is not None and self.clock() >= deadline

    def deadline(self) -> Optional[float]:
        """When the oldest request's wait ends (the gather's clock); None without requests."""
        with self._lock:
            if not self._requests:
                return None
            return min(request.since for request in self._requests.values()) + self.wait_s

    def take(self, why: str) -> Dict[str, TickRequest]:
        """The requests gathered so far, now taken out, counted by ``why`` (a
        ``GatherCounters`` field: complete, timed_out or flushed)."""
        with self._lock:
            taken, self._requests = self._requests, {}
        if taken:
            setattr(self.counters, why, getattr(self.counters, why) + 1)
        return taken

    def expect(self, robots: Iterable[str]) -> None:
        """The trigger-mode robots a gather waits for (a robot's step mode changed)."""
        with self._lock:
            self.expected = frozenset(robots)
