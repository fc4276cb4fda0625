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
from typing import Callable, NamedTuple, Optional

import numpy as np

from capsule_ros.metrics import LatencyWindow
from capsule_ros.runtime.engine import PolicyRuntime, StepOutputs
from capsule_ros.runtime.mode import StepReport
from capsule_ros.serving.ports import SensorInputs
from capsule_ros.serving.records import SessionCounters, StepFault
from capsule_ros.serving.watchdog import DeadlineWatchdog

LOG = logging.getLogger(__name__)
# (the state's step before it, the inputs it read or None, its action or None): a counted step
LogStep = Callable[[int, Optional[np.ndarray], Optional[np.ndarray]], None]


@dataclass
class PendingStep:
    """A guarded step begun (``GuardedStep.begin``) whose runtime step its driver runs."""

    from_step: int
    deadline_s: Optional[float]
    forced_late: bool
    enforce: bool
    watchdog: Optional[DeadlineWatchdog]
    start: float
    uploaded: bool = True
    error: Optional[BaseException] = None      # the upload raised: the step must not run


class StepResult(NamedTuple):
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
        caches, the interpreter's specialised code for the Python in between. It runs from
        where the mode's most common steps run (``ExecutionMode.warm_up_position``: a
        chunking policy consumes; its plans ran in the state check)."""
        saved = self.runtime.arena.storage.clone()
        self.runtime.mode.warm_up_position()
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
        return self.step_alone(self.begin(from_step, deadline_s, forced_late, enforce))

    def begin(self, from_step: int, deadline_s: Optional[float], forced_late: bool = False,
              enforce: bool = True) -> PendingStep:
        """The first half of ``run``: the watchdog armed, the inputs' lock taken (until
        ``finish``: the staged inputs must not change under the step) and the inputs
        uploaded. Its driver then runs the runtime's step, alone (``step_alone``) or with
        other runtimes' in one fleet step (``capsule_ros.fleet``), and always ``finish``es it."""
        watchdog = self._watchdog if deadline_s is not None else None
        if watchdog is not None and deadline_s is not None:
            watchdog.arm(deadline_s)
        self.idle.clear()
        pending = PendingStep(from_step, deadline_s, forced_late, enforce, watchdog, time.perf_counter())
        self.inputs.lock.acquire()
        try:
            pending.uploaded = self.runtime.load_inputs()
        except Exception as exc:  # noqa: BLE001 - the step's fault: ``finish`` counts it (ERROR)
            pending.error = exc
        return pending

    def step_alone(self, pending: PendingStep) -> StepResult:
        """The runtime's own step for ``pending``, then ``finish``."""
        report, error = None, pending.error
        if error is None:
            try:
                report = self.runtime.step()
            except Exception as exc:  # noqa: BLE001 - the step's fault: ``finish`` counts it (ERROR)
                error = exc
        return self.finish(pending, report, error)

    def finish(self, pending: PendingStep, report: Optional[StepReport],
               error: Optional[BaseException] = None, finite: Optional[bool] = None) -> StepResult:
        """The second half: the step ran (``report``) or raised (``error``); its outputs
        read and judged, the step logged or undone, the lock released, the fault counted.
        ``finite``: whether the outputs are finite, when the driver checked that already
        (a fleet checks every slot's at once)."""
        try:
            return self._finish(pending, report, error, finite)
        finally:
            self.idle.set()

    def _finish(self, pending: PendingStep, report: Optional[StepReport], error: Optional[BaseException],
                finite: Optional[bool]) -> StepResult:
        fault, out, from_step, deadline_s = StepFault.NONE, None, pending.from_step, pending.deadline_s
        error = error if error is not None else pending.error
        try:
            if error is not None or report is None:
                raise error if error is not None else RuntimeError("the step did not run")
            out = self.runtime.read_step_outputs()
            if not (finite if finite is not None else out.finite()):
                fault = StepFault.NONFINITE
        except Exception as exc:
            fault = StepFault.ERROR
            self.counters.last_fault = f"{type(exc).__name__}: {exc}"
            LOG.debug("step failed", exc_info=True)
        try:
            if fault == StepFault.NONE or not self.runtime.guarded:
                self.log_step(from_step, self.runtime.input_staging.numpy() if pending.uploaded else None,
                              out.action if out is not None else None)
        finally:
            self.inputs.lock.release()
        seconds = time.perf_counter() - pending.start
        overran = pending.watchdog.disarm() if pending.watchdog is not None else False
        self.latency.record(seconds)
        if fault != StepFault.NONE or out is None:
            return StepResult(out, fault, self._after_fault(fault, from_step), seconds, overran)
        self.counters.steps += 1
        refill_late = report is not None and report.late and pending.enforce
        if refill_late:
            self.counters.late_refills += 1
            self.counters.last_fault = f"the refill taking over at step {from_step + 1} had not finished in time"
        if pending.forced_late or overran or refill_late or (deadline_s is not None and seconds > deadline_s):
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
