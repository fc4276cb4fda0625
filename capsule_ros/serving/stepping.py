"""One guarded control step, and what decides whether its action may reach the robot.

A step's output is the policy's action only when the step ended within its deadline,
raised nothing, and produced finite values. Otherwise the caller publishes the safe
action (``control.deadline_action``) and the fault is counted:

- ``LATE``: the step ended after its deadline. Its state is kept (the policy did step);
  only its action is withheld. With the deadline watchdog running, the safe action goes
  out *at* the deadline from the watchdog's thread, while the step still runs.
- ``LATE`` also when a chunking policy's step takes over a chunk whose asynchronous
  refill had not finished by then (``late_refills``): the step waits for it, so its
  state is exact whatever the timing, and hands out the safe action. That is a timing
  event, so only a session that enforces deadlines has it (``enforce``; a replay instead
  re-enacts the recorded ones, ``forced_late``).
- ``ERROR``: the step raised. ``NONFINITE``: its outputs held NaN or Inf. With the step
  guard (``runtime.guard_steps``) the state is put back exactly as before the step, so
  later steps behave as if it never ran; without it the state is left as the step left it.

Only steps that count are logged for the recompute fallback (a step that was undone is
not part of the timeline).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from capsule_ros.metrics import LatencyWindow
from capsule_ros.runtime.engine import PolicyRuntime, StepOutputs
from capsule_ros.serving.ports import SensorInputs
from capsule_ros.serving.records import SessionCounters, StepFault
from capsule_ros.serving.watchdog import DeadlineWatchdog

LOG = logging.getLogger(__name__)
# (the state's step before it, the inputs it read or None, its action or None): a counted step
LogStep = Callable[[int, Optional[np.ndarray], Optional[np.ndarray]], None]


@dataclass(frozen=True)
class StepResult:
    outputs: Optional[StepOutputs]     # None when the step raised
    fault: StepFault
    step: int                          # the state's step counter after the tick
    seconds: float
    overran: bool                      # the watchdog published the safe action during the step


class GuardedStep:
    """Runs the runtime's step under its guards (see the module docstring); the caller
    serialises calls (the session's boundary lock)."""

    def __init__(self, runtime: PolicyRuntime, inputs: SensorInputs, counters: SessionCounters,
                 log_step: LogStep):
        self.runtime = runtime
        self.inputs = inputs
        self.counters = counters
        self.log_step = log_step
        self.latency = LatencyWindow()
        self.idle = threading.Event()    # set between steps: background work (saves) starts then
        self.idle.set()
        self._watchdog: Optional[DeadlineWatchdog] = None

    def start_watchdog(self, on_overrun: Callable[[], None]) -> None:
        """Call ``on_overrun`` from the watchdog's thread as soon as a step passes its deadline."""
        if self._watchdog is None:
            self._watchdog = DeadlineWatchdog(on_overrun)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    def rehearse(self, from_step: int, runs: int = 2) -> None:
        """Run the whole guarded step path (inputs in, guard copy, step or graph replay,
        outputs out and checked) on a throwaway stepper, then put the arena back byte for
        byte: counters, the input log and the state stay as they were. Right before stepping
        starts it makes the first step not a cold one: no first touch of the guard copy or
        host buffers, no first launch of the captured graph, the weights back in the CPU
        caches, the interpreter's specialised code for the Python in between."""
        saved = self.runtime.arena.storage.clone()
        rehearsal = GuardedStep(self.runtime, self.inputs, SessionCounters(), lambda step, row, action: None)
        try:
            for _ in range(runs):
                rehearsal.run(from_step, None)
        finally:
            self.runtime.load_state(saved)

    def run(self, from_step: int, deadline_s: Optional[float], forced_late: bool = False,
            enforce: bool = True) -> StepResult:
        """One step from state step ``from_step`` (``deadline_s`` None: no deadline;
        ``forced_late``: count it late whatever its time, e.g. a replay re-enacting a miss;
        ``enforce`` False: timing makes no step late, a late refill included)."""
        watchdog = self._watchdog if deadline_s is not None else None
        if watchdog is not None and deadline_s is not None:
            watchdog.arm(deadline_s)
        self.idle.clear()
        try:
            return self._run(from_step, deadline_s, forced_late, watchdog, enforce)
        finally:
            self.idle.set()

    def _run(self, from_step: int, deadline_s: Optional[float], forced_late: bool,
             watchdog: Optional[DeadlineWatchdog], enforce: bool) -> StepResult:
        fault, out, start = StepFault.NONE, None, time.perf_counter()
        refill_late, uploaded = False, True
        with self.inputs.lock:
            try:
                uploaded = self.runtime.load_inputs()
                refill_late = self.runtime.step().late
                out = self.runtime.read_step_outputs()
                if not (np.isfinite(out.action).all() and np.isfinite(out.chunk).all()):
                    fault = StepFault.NONFINITE
            except Exception as exc:
                fault = StepFault.ERROR
                self.counters.last_fault = f"{type(exc).__name__}: {exc}"
                LOG.debug("step failed", exc_info=True)
            if fault == StepFault.NONE or not self.runtime.guarded:
                self.log_step(from_step, self.runtime.input_staging.numpy() if uploaded else None,
                              out.action if out is not None else None)
        seconds = time.perf_counter() - start
        overran = watchdog.disarm() if watchdog is not None else False
        self.latency.record(seconds)
        if fault != StepFault.NONE or out is None:
            return StepResult(out, fault, self._after_fault(fault, from_step), seconds, overran)
        self.counters.steps += 1
        refill_late = refill_late and enforce
        if refill_late:
            self.counters.late_refills += 1
            self.counters.last_fault = f"the refill taking over at step {from_step + 1} had not finished in time"
        if forced_late or overran or refill_late or (deadline_s is not None and seconds > deadline_s):
            fault = StepFault.LATE
            self.counters.deadline_misses += 1
        return StepResult(out, fault, out.step, seconds, overran)

    def _after_fault(self, fault: StepFault, from_step: int) -> int:
        """Count a failed or non-finite step and undo it (guarded); the state's step after."""
        if fault == StepFault.NONFINITE:
            self.counters.nonfinite_steps += 1
            self.counters.last_fault = f"non-finite outputs at step {from_step + 1}"
        else:
            self.counters.step_errors += 1
        if self.runtime.guarded:
            self.runtime.undo_step()
            step = from_step
        else:
            step = self.runtime.read_outputs().step
        LOG.warning("step %d: %s; published the safe action%s", from_step + 1, self.counters.last_fault,
                    " and put the state back as it was" if self.runtime.guarded else "")
        return step
