"""``~/run_policy`` (capsule_ros/action/RunPolicy): run the policy until a step budget, a
cancel, a timeout or another client ends the run; for behaviour trees.

A run, on its own worker thread:

1. starts the episode the goal names (a reset, a re-entry, or the live episode);
2. counts the policy's steps (the control loop reports each one) and publishes feedback
   at ``FEEDBACK_HZ``;
3. ends at a step boundary: the node interrupts with the goal's hold mode, commits the
   boundary capsule and publishes the safe action. The control loop ends it itself on
   the step that spends the budget, so exactly ``max_steps`` steps run; a cancel wakes
   the worker at once, so the robot gets its safe action within a step of the cancel.

One goal at a time: a goal that arrives while another runs (or while the node is not
active) ends at once, ABORTED with outcome REJECTED and the reason, and the running goal
is untouched. A run that someone else ends (a ~/interrupt or ~/reset, the node's
deactivation) ends INTERRUPTED with the capsule that interruption committed.

Cancel before the goal: a behaviour tree that halts its action node right after sending
the goal sends a cancel with the goal's id, on a different service from the goal
request, so the server can see the cancel first. rclpy answers such a cancel
UNKNOWN_GOAL_ID and then accepts and runs the goal nobody waits for (the orphaned-goal
race of Nav2 and BehaviorTree.ROS2). :class:`CancelAwareActionServer` remembers cancels
of unknown goal ids for a while and rejects those goals when they arrive.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.node import Node

from capsule_ros.action import RunPolicy
from capsule_ros.capsules.store import Capsule
from capsule_ros.errors import CapsuleRosError, ErrorCode, WrongState
from capsule_ros.msg import Action
from capsule_ros.ros.facade import NodeFacade
from capsule_ros.ros.messages import action_services_qos, capsule_info
from capsule_ros.ros.spinning import Offload
from capsule_ros.serving.records import ActionRecord, ActionSource, EpisodeState, HoldMode
from capsule_ros.serving.session import PolicySession

FEEDBACK_HZ = 10.0
EARLY_CANCEL_CAPACITY = 256         # cancels of not-yet-known goals remembered at most ...
EARLY_CANCEL_TTL_S = 60.0           # ... and for this long
Result = RunPolicy.Result


class EarlyCancels:
    """Goal ids canceled before their goal request arrived (bounded, expiring)."""

    def __init__(self, capacity: int = EARLY_CANCEL_CAPACITY, ttl_s: float = EARLY_CANCEL_TTL_S):
        self.capacity, self.ttl_s = capacity, ttl_s
        self._ids: collections.OrderedDict = collections.OrderedDict()   # goal id -> monotonic time

    def add(self, goal_id: bytes) -> None:
        self._expire()
        self._ids[goal_id] = time.monotonic()
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def pop(self, goal_id: bytes) -> bool:
        """Whether ``goal_id`` was canceled early (and forget it)."""
        self._expire()
        return self._ids.pop(goal_id, None) is not None

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._ids and next(iter(self._ids.values())) < cutoff:
            self._ids.popitem(last=False)


class CancelAwareActionServer(ActionServer):
    """rclpy's ActionServer that rejects a goal whose cancel came first (module docstring).
    Goal and cancel requests are handled on the executor's thread, one at a time."""

    def __init__(self, node: Node, action_type: Any, action_name: str, execute_callback: Any, *,
                 goal_callback: Any, **kwargs: Any):
        self.early_cancels = EarlyCancels()
        self._incoming_goal_id = b""
        super().__init__(node, action_type, action_name, execute_callback,
                         goal_callback=self._screened(goal_callback), **kwargs)

    def _screened(self, goal_callback):
        def screen(goal) -> GoalResponse:
            if self.early_cancels.pop(self._incoming_goal_id):
                self._node.get_logger().info(f"rejected goal {self._incoming_goal_id.hex()}: canceled before it came")
                return GoalResponse.REJECT
            return goal_callback(goal)
        return screen

    async def _execute_goal_request(self, request_header_and_message) -> None:
        self._incoming_goal_id = bytes(request_header_and_message[1].goal_id.uuid)
        await super()._execute_goal_request(request_header_and_message)

    async def _execute_cancel_request(self, request_header_and_message) -> None:
        goal_id = bytes(request_header_and_message[1].goal_info.goal_id.uuid)
        if any(goal_id) and goal_id not in self._goal_handles:       # all zeros: "cancel all", not one goal
            self.early_cancels.add(goal_id)
        await super()._execute_cancel_request(request_header_and_message)


@dataclass
class Run:
    """One goal's run (shared by its worker and the control loop under RunPolicyServer's lock)."""

    goal_handle: Any
    goal: Any
    episode_id: int = 0                                            # 0 until its episode started
    steps: int = 0
    wake: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False                                         # someone is ending it (set once)
    ended: Optional[Tuple[int, str, Optional[Capsule]]] = None    # (outcome, message, capsule), set once
    last_feedback: float = 0.0


class RunPolicyServer:
    """The ``~/run_policy`` action of a policy node (module docstring), served through the
    node's facade (``capsule_ros.ros.facade``)."""

    def __init__(self, node: Node, facade: NodeFacade, callback_group: Any):
        self._facade = facade
        self._lock = threading.Lock()
        self._busy = False                  # a goal holds the slot (from execute to its result)
        self._run: Optional[Run] = None     # ... and has started stepping
        self._closing = threading.Event()
        self._worker = Offload(node, 1, "capsule-run")
        self.server = CancelAwareActionServer(node, RunPolicy, "~/run_policy", self._execute,
                                              goal_callback=lambda _goal: GoalResponse.ACCEPT,
                                              cancel_callback=self._on_cancel, callback_group=callback_group,
                                              **action_services_qos())

    # -- called by the node ------------------------------------------------------------------------
    def after_action(self, record: ActionRecord) -> None:
        """The control loop published ``record``; count it, and end the run on the step that
        spends its budget (here, at that step's boundary, so no further step runs)."""
        run = self._run
        if run is None or record.source != ActionSource.POLICY or record.episode_id != run.episode_id:
            return
        run.steps += 1
        budget = run.goal.max_steps
        if budget and run.steps >= budget:
            self._stop(run, Result.OUTCOME_SUCCEEDED, f"ran {run.steps} step(s)")
        elif time.monotonic() - run.last_feedback >= 1.0 / FEEDBACK_HZ:
            run.wake.set()

    def node_deactivated(self, capsule: Optional[Capsule]) -> None:
        """The node was deactivated, its episode interrupted with ``capsule``: a running goal
        ends INTERRUPTED with it, saying so (unless its own stop is under way)."""
        run = self._run
        if run is not None:
            self._end(run, Result.OUTCOME_INTERRUPTED, self._ended_by_others(self._facade.session), capsule,
                      unless_stopping=True)

    def close(self) -> None:
        """Process exit: end a running goal (ABORTED) and join the worker."""
        self._closing.set()
        run = self._run
        if run is not None:
            run.wake.set()
        self._worker.shutdown()
        self.server.destroy()

    # -- action callbacks ------------------------------------------------------------------------
    def _on_cancel(self, goal_handle) -> CancelResponse:
        run = self._run
        if run is not None and run.goal_handle is goal_handle:
            run.wake.set()
        return CancelResponse.ACCEPT

    async def _execute(self, goal_handle):
        refusal = self._claim()
        if refusal is not None:
            goal_handle.abort()
            return self._result(Result.OUTCOME_REJECTED, refusal[1], error_code=refusal[0])
        try:
            return await self._worker.run(self._run_goal, goal_handle)
        finally:
            with self._lock:
                self._busy, self._run = False, None

    def _claim(self) -> Optional[Tuple[int, str]]:
        """Take the one run slot, or say why not (error code, message)."""
        with self._lock:
            if not self._facade.active:
                return int(ErrorCode.WRONG_STATE), "the node is not active"
            if self._busy:
                return int(ErrorCode.BUSY), "another goal is running; cancel it first"
            self._busy = True
            return None

    # -- the run (worker thread) -------------------------------------------------------------------
    def _run_goal(self, goal_handle):
        goal = goal_handle.request
        if goal_handle.is_cancel_requested:                   # canceled before it started: nothing ran
            goal_handle.canceled()
            return self._result(Result.OUTCOME_CANCELED, "canceled before it started")
        run = Run(goal_handle, goal)                  # its episode is not known yet: no step counts
        with self._lock:
            self._run = run                           # a deactivate from here on ends it (node_deactivated)
        try:
            session = self._facade.active_session()
            HoldMode(goal.hold_mode)
            self._start_episode(session, goal)
        except (CapsuleRosError, ValueError) as exc:
            with self._lock:
                self._run = None
            goal_handle.abort()
            code = exc.code if isinstance(exc, CapsuleRosError) else ErrorCode.INVALID_ARGUMENT
            return self._result(Result.OUTCOME_REJECTED, f"could not start: {exc}", error_code=int(code))
        run.episode_id = session.episode.episode_id
        deadline = time.monotonic() + goal.timeout_s if goal.timeout_s > 0 else None
        while run.ended is None:
            run.wake.wait(1.0 / FEEDBACK_HZ)
            run.wake.clear()
            self._feedback(run)
            if run.ended is not None:
                break
            if goal_handle.is_cancel_requested:
                self._stop(run, Result.OUTCOME_CANCELED, "canceled")
            elif deadline is not None and time.monotonic() >= deadline:
                self._stop(run, Result.OUTCOME_TIMED_OUT, f"timed out after {goal.timeout_s:g} s")
            elif self._closing.is_set():
                self._end(run, Result.OUTCOME_INTERRUPTED, "the node is shutting down", None, unless_stopping=True)
            elif not self._still_running(session, run):
                self._end(run, Result.OUTCOME_INTERRUPTED, self._ended_by_others(session), self._interrupt_capsule(),
                          unless_stopping=True)
        assert run.ended is not None
        outcome, message, capsule = run.ended
        {Result.OUTCOME_SUCCEEDED: goal_handle.succeed,
         Result.OUTCOME_CANCELED: goal_handle.canceled}.get(outcome, goal_handle.abort)()
        return self._result(outcome, message, steps=run.steps, episode_id=run.episode_id, capsule=capsule)

    @staticmethod
    def _start_episode(session: PolicySession, goal: Any) -> None:
        verbs, state = session.verbs, session.episode.state
        if goal.reset:
            verbs.reset(goal.start_capsule_id)
        elif goal.start_capsule_id:
            verbs.reenter(goal.start_capsule_id)
        elif state == EpisodeState.INTERRUPTED:
            verbs.reenter("")
        elif state == EpisodeState.IDLE:
            verbs.reset("")

    @staticmethod
    def _still_running(session: PolicySession, run: Run) -> bool:
        """The run's episode is still the session's, running."""
        episode = session.episode
        return episode.state == EpisodeState.RUNNING and episode.episode_id == run.episode_id

    def _stop(self, run: Run, outcome: int, message: str) -> None:
        """End the run with ``outcome``: interrupt with the goal's hold mode (committing the
        boundary capsule, publishing the safe action). The first caller does it (the control
        loop spending the budget and a cancel can race); when someone else had already
        ended the episode the run ends INTERRUPTED instead."""
        with self._lock:
            if run.stopping:
                return
            run.stopping = True
        try:
            capsule = self._facade.active_session().verbs.interrupt(run.goal.hold_mode, True)   # the node publishes
        except WrongState:                                                               # its safe action
            outcome, message, capsule = (Result.OUTCOME_INTERRUPTED, self._ended_by_others(self._facade.session),
                                         self._interrupt_capsule())
        self._end(run, outcome, message, capsule)

    def _end(self, run: Run, outcome: int, message: str, capsule: Optional[Capsule], *,
             unless_stopping: bool = False) -> None:
        """Record how the run ended (the first record wins); ``unless_stopping``: not when
        the run's own stop is under way (its interrupt is what the caller saw)."""
        with self._lock:
            if unless_stopping and run.stopping:
                return
            run.stopping = True
            if run.ended is None:
                run.ended = (outcome, message, capsule)
        run.wake.set()

    @staticmethod
    def _ended_by_others(session: Optional[PolicySession]) -> str:
        if session is None:
            return "the node was cleaned up"
        episode = session.episode
        if episode.suspended:
            return (f"the node was deactivated: the episode was interrupted at step {episode.step} "
                    "(activate resumes it)")
        return f"the episode was ended by another request (now {episode.state.name}, episode {episode.episode_id})"

    def _interrupt_capsule(self) -> Optional[Capsule]:
        session = self._facade.session
        return session.episode.interrupt_capsule if session is not None else None

    def _feedback(self, run: Run) -> None:
        session = self._facade.session
        if session is None:
            return
        run.last_feedback = time.monotonic()
        episode = session.episode
        feedback = RunPolicy.Feedback(episode_id=int(episode.episode_id), step=int(episode.step),
                                      lineage=episode.lineage, steps=run.steps,
                                      last_action=self._facade.last_action or Action())
        run.goal_handle.publish_feedback(feedback)

    @staticmethod
    def _result(outcome: int, message: str, *, error_code: int = int(ErrorCode.OK), steps: int = 0,
                episode_id: int = 0, capsule: Optional[Capsule] = None):
        result = Result(outcome=outcome, error_code=error_code, message=message, steps=steps, episode_id=episode_id)
        if capsule is not None:
            result.capsule = capsule_info(capsule)
        return result
