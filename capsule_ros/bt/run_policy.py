"""A py_trees leaf for ``~/run_policy`` (capsule_ros/action/RunPolicy): send a goal, stay
RUNNING while the policy runs, end with the run's result; never blocks a tick.

Lifecycle of one execution (``initialise`` then ``update`` on each tick):

1. ``initialise`` builds the goal; one that cannot be built (a missing blackboard key, a
   malformed capsule id) fails the first tick with ``INVALID_GOAL``, nothing sent.
2. Server not discovered within ``server_wait_s``: ``SERVER_UNREACHABLE``.
3. No goal response within ``goal_timeout_s``: ``SEND_GOAL_TIMEOUT``; the goal is canceled
   by its id, so if the node gets it late it rejects it instead of running it unwatched.
   The leaf's first goal to a server, and its first after it found the server gone, waits
   at least ``discovery_grace_s`` (``capsule_ros.ros.discovery``, as the service leaves).
4. Goal rejected: ``GOAL_REJECTED_BY_SERVER``. Accepted: RUNNING; the latest feedback is
   written to ``feedback_key`` on each tick.
5. The result: SUCCEEDED -> SUCCESS, with the committed boundary capsule's id written to
   ``capsule_key`` (so a ``Reenter`` leaf resumes from it); ABORTED -> ``ACTION_ABORTED``,
   CANCELED -> ``ACTION_CANCELLED``.

Halted while RUNNING (a parent's ``stop``: e.g. a higher-priority branch took over), the
leaf cancels its goal: the node interrupts at the next boundary, commits a capsule and
publishes the safe action. The failure kinds are BehaviorTree.ROS2's
``ActionNodeErrorCode`` names, as the service leaves use its ``ServiceNodeErrorCode``.
"""
from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import py_trees
from py_trees.common import Access, Status

from capsule_ros import srv
from capsule_ros.bt.behaviours import (
    DEFAULT_NODE,
    DEFAULT_SERVER_WAIT_S,
    INTERRUPT_KEY,
    OUTCOME_PREFIX,
    InvalidRequest,
    capsule_id_from,
)
from capsule_ros.ros.discovery import DISCOVERY_GRACE_S, DiscoveryGrace
from capsule_ros.ros.messages import action_services_qos, service_qos

FEEDBACK_KEY = "/capsule/run/feedback"         # the latest RunPolicy feedback
DEFAULT_GOAL_TIMEOUT_S = 1.0                    # BehaviorTree.ROS2's server_timeout default


class ActionFailure(str, enum.Enum):
    """Why the leaf failed: BehaviorTree.ROS2's ``BT::ActionNodeErrorCode`` names."""

    SERVER_UNREACHABLE = "SERVER_UNREACHABLE"
    SEND_GOAL_TIMEOUT = "SEND_GOAL_TIMEOUT"
    GOAL_REJECTED_BY_SERVER = "GOAL_REJECTED_BY_SERVER"
    ACTION_ABORTED = "ACTION_ABORTED"
    ACTION_CANCELLED = "ACTION_CANCELLED"
    INVALID_GOAL = "INVALID_GOAL"


@dataclass(frozen=True)
class RunOutcome:
    """How one execution of the leaf ended (written to ``outcome_key``)."""

    action: str
    success: bool
    failure: Optional[ActionFailure]
    message: str
    elapsed_s: float
    result: Any = field(default=None, repr=False, compare=False)    # RunPolicy.Result when one came

    def __str__(self) -> str:
        failure = self.failure.value if self.failure is not None else "FAILED"
        return f"{self.action}: " + ("ok" if self.success else failure) + f": {self.message}"


class RunPolicy(py_trees.behaviour.Behaviour):
    """Run the policy through ``~/run_policy`` (see the module docstring).

    Args:
        max_steps, timeout_s, reset, hold_mode: the goal's fields.
        start_capsule_id / start_capsule_key: the capsule to start from (a literal id, or a
            blackboard key holding one); neither: the live episode (or the initial state
            when ``reset``).
        capsule_key: where the run's boundary capsule id goes on success ("" or None: nowhere).
        server_wait_s: how long to wait for the action server (SERVER_UNREACHABLE).
        goal_timeout_s: how long to wait for the goal to be accepted (SEND_GOAL_TIMEOUT).
        discovery_grace_s: the least a first goal to a just-discovered server waits.
    """

    def __init__(self, name: str = "RunPolicy", *, max_steps: int = 0, timeout_s: float = 0.0, reset: bool = False,
                 start_capsule_id: Optional[str] = None, start_capsule_key: Optional[str] = None,
                 hold_mode: int = srv.Interrupt.Request.HOLD_LAST, capsule_key: Optional[str] = INTERRUPT_KEY,
                 feedback_key: Optional[str] = FEEDBACK_KEY,
                 outcome_key: Optional[str] = f"{OUTCOME_PREFIX}/run_policy", node_path: str = DEFAULT_NODE,
                 server_wait_s: float = DEFAULT_SERVER_WAIT_S, goal_timeout_s: float = DEFAULT_GOAL_TIMEOUT_S,
                 discovery_grace_s: float = DISCOVERY_GRACE_S, node=None):
        super().__init__(name=name)
        self.goal_fields = {"max_steps": int(max_steps), "timeout_s": float(timeout_s), "reset": bool(reset),
                            "hold_mode": int(hold_mode)}
        self.start_capsule_id, self.start_capsule_key = start_capsule_id, start_capsule_key
        self.action_name = f"{node_path.rstrip('/')}/run_policy"
        self.server_wait_s, self.goal_timeout_s = float(server_wait_s), float(goal_timeout_s)
        self.discovery = DiscoveryGrace(discovery_grace_s)
        self.capsule_key, self.feedback_key, self.outcome_key = capsule_key, feedback_key, outcome_key
        self.blackboard = self.attach_blackboard_client(name=name)
        if start_capsule_id is None and start_capsule_key:
            self.blackboard.register_key(key=start_capsule_key, access=Access.READ)
        for key in (capsule_key, feedback_key, outcome_key):
            if key:
                self.blackboard.register_key(key=key, access=Access.WRITE)
        self._node = node
        self._action: Any = None
        self._cancel = None
        self.outcome: Optional[RunOutcome] = None
        self._clear()

    def _clear(self) -> None:
        self._goal: Any = None
        self._invalid: Optional[str] = None
        self._goal_id = b""
        self._goal_future = None
        self._handle = None
        self._result_future = None
        self._latest_feedback = None
        self._started = self._sent_at = time.monotonic()
        self._timeout_s = self.goal_timeout_s

    # -- py_trees lifecycle ------------------------------------------------------------------------
    def setup(self, **kwargs: Any) -> None:
        """Create the action client and the cancel client once (``node`` from the kwargs or
        the constructor)."""
        from action_msgs.srv import CancelGoal

        from capsule_ros.action import RunPolicy as RunPolicyAction
        from capsule_ros.ros.spinning import SpinSafeActionClient
        node = kwargs.get("node", self._node)
        if node is None:
            raise KeyError(f"{self.name}: no rclpy node: pass node= to the constructor or to setup()")
        if self._action is None or self._node is not node:
            self._node = node
            self._action = SpinSafeActionClient(node, RunPolicyAction, self.action_name, **action_services_qos())
            self.discovery.on_server_gone()            # a new client: the server has not seen it yet
            self._cancel = node.create_client(CancelGoal, f"{self.action_name}/_action/cancel_goal",
                                              qos_profile=service_qos())

    def initialise(self) -> None:
        from capsule_ros.action import RunPolicy as RunPolicyAction
        self._clear()
        self.outcome = None
        try:
            start = ""
            if self.start_capsule_id or self.start_capsule_key:
                start = capsule_id_from(self.blackboard, self.start_capsule_id, self.start_capsule_key,
                                        allow_empty=True, what="start capsule id")
            self._goal = RunPolicyAction.Goal(start_capsule_id=start, **self.goal_fields)
        except (InvalidRequest, KeyError, ValueError) as exc:
            self._invalid = str(exc)
        self.feedback_message = "building goal" if self._invalid is None else self._invalid

    def update(self) -> Status:
        if self._action is None:
            raise RuntimeError(f"{self.name}: setup() was not called")
        if self._invalid is not None:
            return self._finish(ActionFailure.INVALID_GOAL, self._invalid)
        now = time.monotonic()
        if self._goal_future is None:
            return self._send(now)
        if self._handle is None:
            if not self._goal_future.done():
                if now - self._sent_at > self._timeout_s:
                    self._cancel_pending()
                    return self._finish(ActionFailure.SEND_GOAL_TIMEOUT,
                                        f"no goal response within {self._timeout_s * 1e3:.0f} ms"
                                        f"{DiscoveryGrace.note(self._timeout_s, self.goal_timeout_s)}")
                return Status.RUNNING
            self._handle = self._goal_future.result()
            self.discovery.on_answer()
            if not self._handle.accepted:
                return self._finish(ActionFailure.GOAL_REJECTED_BY_SERVER, "the goal was rejected")
            self._result_future = self._handle.get_result_async()
        self._write_feedback()
        if not self._result_future.done():
            self.feedback_message = "running"
            return Status.RUNNING
        return self._on_result(self._result_future.result())

    def terminate(self, new_status: Status) -> None:
        if new_status == Status.INVALID:     # halted by a parent while running: cancel the run
            if self._handle is not None and self._handle.accepted and self._result_future is not None \
                    and not self._result_future.done():
                self._handle.cancel_goal_async()
            elif self._goal_future is not None and self._handle is None:
                self._cancel_pending()
            self.feedback_message = "cancelled"

    # -- steps ---------------------------------------------------------------------------------------
    def _send(self, now: float) -> Status:
        from unique_identifier_msgs.msg import UUID
        if not self._action.server_is_ready():
            self.discovery.on_server_gone()
            if now - self._started >= self.server_wait_s:
                return self._finish(ActionFailure.SERVER_UNREACHABLE,
                                    f"{self.action_name} not available after {(now - self._started) * 1e3:.0f} ms")
            self.feedback_message = f"waiting for {self.action_name}"
            return Status.RUNNING
        self._goal_id = uuid.uuid4().bytes
        self._goal_future = self._action.send_goal_async(self._goal, feedback_callback=self._on_feedback,
                                                         goal_uuid=UUID(uuid=list(self._goal_id)))
        self._sent_at = now
        self._timeout_s = self.discovery.timeout_s(self.goal_timeout_s)
        self.feedback_message = f"sent a goal to {self.action_name}"
        return Status.RUNNING

    def _on_feedback(self, message) -> None:
        self._latest_feedback = message.feedback       # the spinning thread: handed to the tick below

    def _write_feedback(self) -> None:
        feedback = self._latest_feedback
        if feedback is not None and self.feedback_key:
            self.blackboard.set(self.feedback_key, feedback)

    def _on_result(self, response) -> Status:
        from action_msgs.msg import GoalStatus
        result = response.result
        if response.status == GoalStatus.STATUS_SUCCEEDED:
            if self.capsule_key and result.capsule.id:
                self.blackboard.set(self.capsule_key, result.capsule.id)
            return self._finish(None, result.message, result)
        failure = (ActionFailure.ACTION_CANCELLED if response.status == GoalStatus.STATUS_CANCELED
                   else ActionFailure.ACTION_ABORTED)
        return self._finish(failure, result.message, result)

    def _cancel_pending(self) -> None:
        """Cancel a goal whose response has not come, by its id (the node then rejects it)."""
        from action_msgs.msg import GoalInfo
        from action_msgs.srv import CancelGoal
        from unique_identifier_msgs.msg import UUID
        if self._cancel is not None and self._goal_id:
            self._cancel.call_async(CancelGoal.Request(goal_info=GoalInfo(goal_id=UUID(uuid=list(self._goal_id)))))

    def _finish(self, failure: Optional[ActionFailure], message: str, result: Any = None) -> Status:
        self.outcome = RunOutcome(self.action_name, failure is None, failure, message,
                                  time.monotonic() - self._started, result)
        if self.outcome_key:
            self.blackboard.set(self.outcome_key, self.outcome)
        self.feedback_message = str(self.outcome)
        if failure is not None:
            self.logger.warning(str(self.outcome))
        return Status.SUCCESS if failure is None else Status.FAILURE
