"""Example tree: commit before the grasp; if the grasp fails, re-enter the last good capsule
and retry; give up after N tries.

    python -m capsule_ros.bt.example --node /capsule_policy --tries 3

The tree (:func:`grasp_with_retries`; the grasp is any behaviour you plug in)::

    [-] GraspWithRetries                     Sequence (memory)
        --> ClearRollbackOutcome             forget a previous run's rollback failure
        --> CommitBeforeGrasp                Commit: capsule id -> /capsule/last_good
        -^- UnlessRollbackFailed             EternalGuard: stop retrying once a rollback failed
            (-) Retry                        Retry: FAILURE only on the N-th failed try
                [o] GraspOrRollBack          Selector (memory)
                    --> <grasp>              your behaviour: SUCCESS ends the tree with SUCCESS
                    [-] RollBackThenRetry    Sequence (memory), runs when the grasp failed:
                        --> ReenterLastGood  Reenter /capsule/last_good (a rollback)
                        --> TryFailed        Failure: counts the try

Every failed try is followed by a rollback, the last one too: a tree that gives up leaves
the policy in the state committed before the grasp, not in the failed try's state. If a
rollback itself fails the state is unknown, so the guard ends the tree (FAILURE) on the
next tick instead of grasping again from it; the Reenter's ``ServiceOutcome`` (failure
kind, error code, message) is on the blackboard at ``/capsule/outcome/grasp_rollback``.

What a rollback restores is the *policy's* execution state (its KV cache, recurrent and
convolution state, action chunk, step counter), so the retry does not carry the failed
attempt in its memory. The arm itself is where the failed try left it: the policy sees
that through its joint-state input like any other start.

The grasp here is :class:`ReachGoal` on the simulated two-link arm: SUCCESS once the end
effector is within 3 cm of the goal and slower than 5 cm/s (``capsule_ros.sim.arm``'s
success test), FAILURE when that has not happened within ``step_budget`` joint-state
messages. It only observes ``<ns>/arm/joint_states`` and ``<ns>/arm/goal``, so it judges
a real arm, ``sim_node`` or the in-process :class:`LocalArm` (``--arm local``, the default:
it simulates the arm in this process, publishing the joint states and goal the policy
node's ports read and applying each ``~/action`` it publishes).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import List, Optional

import numpy as np
import py_trees
from py_trees.common import Status

from capsule_ros.bt.behaviours import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_NODE,
    DEFAULT_SERVER_WAIT_S,
    LAST_GOOD_KEY,
    OUTCOME_PREFIX,
    Commit,
    Reenter,
    spin_in_background,
    tick_until_done,
)
from capsule_ros.sim.arm import GOAL_TOLERANCE, SPEED_TOLERANCE, ArmSim, end_effector, jacobian

ROLLBACK_OUTCOME_KEY = f"{OUTCOME_PREFIX}/grasp_rollback"


def grasp_with_retries(grasp: py_trees.behaviour.Behaviour, *, tries: int = 3, node_path: str = DEFAULT_NODE,
                       capsule_key: str = LAST_GOOD_KEY, label: str = "before grasp",
                       server_wait_s: float = DEFAULT_SERVER_WAIT_S, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                       rollback_outcome_key: str = ROLLBACK_OUTCOME_KEY, node=None,
                       name: str = "GraspWithRetries") -> py_trees.behaviour.Behaviour:
    """The tree of the module docstring around ``grasp``; returns its root."""
    if tries < 1:
        raise ValueError(f"tries = {tries}: must be >= 1")
    calls = dict(node_path=node_path, server_wait_s=server_wait_s, call_timeout_s=call_timeout_s, node=node)
    commit = Commit("CommitBeforeGrasp", label=label, capsule_key=capsule_key, **calls)
    rollback = Reenter("ReenterLastGood", capsule_key=capsule_key, outcome_key=rollback_outcome_key, **calls)
    roll_back_then_retry = py_trees.composites.Sequence(
        "RollBackThenRetry", memory=True, children=[rollback, py_trees.behaviours.Failure("TryFailed")])
    attempt = py_trees.composites.Selector("GraspOrRollBack", memory=True, children=[grasp, roll_back_then_retry])
    retry = py_trees.decorators.Retry("Retry", attempt, num_failures=tries)

    def rollback_ok(blackboard) -> bool:
        return not blackboard.exists(rollback_outcome_key) or blackboard.get(rollback_outcome_key).success

    guard = py_trees.decorators.EternalGuard("UnlessRollbackFailed", retry, condition=rollback_ok,
                                             blackboard_keys=[rollback_outcome_key])
    clear = py_trees.behaviours.UnsetBlackboardVariable("ClearRollbackOutcome", key=rollback_outcome_key)
    return py_trees.composites.Sequence(name, memory=True, children=[clear, commit, guard])


class ReachGoal(py_trees.behaviour.Behaviour):
    """The example's grasp: the arm reaches its goal within ``step_budget`` joint-state
    messages (see the module docstring). Fails after ``timeout_s`` without joint states."""

    def __init__(self, name: str = "ReachGoal", *, joints_topic: str = "/arm/joint_states",
                 goal_topic: str = "/arm/goal", step_budget: int = 100, tolerance: float = GOAL_TOLERANCE,
                 speed_tolerance: float = SPEED_TOLERANCE, timeout_s: float = 10.0):
        super().__init__(name=name)
        if step_budget < 1:
            raise ValueError(f"step_budget = {step_budget}: must be >= 1")
        self.joints_topic, self.goal_topic = joints_topic, goal_topic
        self.step_budget, self.tolerance, self.speed_tolerance = step_budget, tolerance, speed_tolerance
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._joints: Optional[np.ndarray] = None
        self._goal: Optional[np.ndarray] = None
        self._count = 0
        self._start_count = 0
        self._last_message = 0.0
        self.attempts = 0

    def setup(self, **kwargs) -> None:
        from geometry_msgs.msg import PointStamped
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import JointState
        node = kwargs["node"]
        # best effort matches both best-effort and reliable publishers
        node.create_subscription(JointState, self.joints_topic, self._on_joints, qos_profile_sensor_data)
        node.create_subscription(PointStamped, self.goal_topic, self._on_goal,
                                 QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT))

    def _on_joints(self, msg) -> None:
        if len(msg.position) < 2 or len(msg.velocity) < 2:
            return
        with self._lock:
            self._joints = np.array([msg.position[0], msg.position[1], msg.velocity[0], msg.velocity[1]])
            self._count += 1
            self._last_message = time.monotonic()

    def _on_goal(self, msg) -> None:
        with self._lock:
            self._goal = np.array([msg.point.x, msg.point.y])

    def initialise(self) -> None:
        self.attempts += 1
        with self._lock:
            self._start_count = self._count
            self._last_message = time.monotonic()

    def update(self) -> Status:
        with self._lock:
            joints, goal, steps, last = self._joints, self._goal, self._count - self._start_count, self._last_message
        if joints is not None and goal is not None and steps > 0:
            q, dq = joints[:2], joints[2:]
            distance = float(np.linalg.norm(end_effector(q) - goal))
            speed = float(np.linalg.norm(jacobian(q) @ dq))
            self.feedback_message = f"step {steps}/{self.step_budget}: {distance * 100:.1f} cm, {speed * 100:.1f} cm/s"
            if distance < self.tolerance and speed < self.speed_tolerance:
                return Status.SUCCESS
        if steps >= self.step_budget:
            self.feedback_message = f"not at the goal after {steps} steps ({self.feedback_message})"
            return Status.FAILURE
        if time.monotonic() - last > self.timeout_s:
            self.feedback_message = f"no joint state on {self.joints_topic} for {self.timeout_s:.1f} s"
            return Status.FAILURE
        return Status.RUNNING


class LocalArm:
    """The simulated arm in this process, at ``rate_hz``: each period it applies the newest
    action of ``<node>/action`` (zeros before the first), then publishes the joint state
    (which, in trigger mode, makes the policy step) and the goal."""

    def __init__(self, node, *, node_path: str = DEFAULT_NODE, joints_topic: str = "/arm/joint_states",
                 goal_topic: str = "/arm/goal", rate_hz: float = 20.0, seed: int = 0):
        from geometry_msgs.msg import PointStamped
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import JointState

        from capsule_ros.msg import Action
        self.node = node
        self.JointState, self.PointStamped = JointState, PointStamped
        self.sim = ArmSim(seed)
        self.sim.reset()
        self._action = np.zeros(2)
        self._lock = threading.Lock()
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.joints_pub = node.create_publisher(JointState, joints_topic, reliable)
        self.goal_pub = node.create_publisher(PointStamped, goal_topic, reliable)
        node.create_subscription(Action, f"{node_path.rstrip('/')}/action", self._on_action, reliable)
        self.timer = node.create_timer(1.0 / rate_hz, self._tick)

    def _on_action(self, msg) -> None:
        if len(msg.values) == 2:
            with self._lock:
                self._action = np.asarray(msg.values, dtype=np.float64)

    def _tick(self) -> None:
        with self._lock:
            action = self._action.copy()
        obs = self.sim.step(action)
        stamp = self.node.get_clock().now().to_msg()
        goal = self.PointStamped()
        goal.header.stamp = stamp
        goal.point.x, goal.point.y = float(obs.goal[0]), float(obs.goal[1])
        self.goal_pub.publish(goal)
        joints = self.JointState()
        joints.header.stamp = stamp
        joints.name = ["shoulder", "elbow"]
        joints.position = [float(obs.joints[0]), float(obs.joints[1])]
        joints.velocity = [float(obs.joints[2]), float(obs.joints[3])]
        self.joints_pub.publish(joints)

    def stop(self) -> None:
        self.node.destroy_timer(self.timer)


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m capsule_ros.bt.example", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--node", default=DEFAULT_NODE, help="the policy node (namespace included)")
    parser.add_argument("--tries", type=int, default=3, help="grasp attempts before giving up")
    parser.add_argument("--arm", choices=("local", "external"), default="local",
                        help="local: simulate the arm in this process; external: a sim_node or robot publishes it")
    parser.add_argument("--step-budget", type=int, default=100, help="joint-state messages per grasp attempt")
    parser.add_argument("--rate", type=float, default=20.0, help="local arm control rate [Hz]")
    parser.add_argument("--seed", type=int, default=0, help="local arm episode seed")
    parser.add_argument("--joints-topic", default=None, help="default: <node namespace>/arm/joint_states")
    parser.add_argument("--goal-topic", default=None, help="default: <node namespace>/arm/goal")
    parser.add_argument("--server-wait", type=float, default=5.0, help="service discovery timeout [s]")
    parser.add_argument("--call-timeout", type=float, default=DEFAULT_CALL_TIMEOUT_S, help="service call timeout [s]")
    parser.add_argument("--tick-hz", type=float, default=50.0, help="tree tick rate [Hz]")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up on the whole run after [s]")
    args = parser.parse_args(argv)
    if args.tries < 1 or args.step_budget < 1 or args.rate <= 0 or args.tick_hz <= 0:
        parser.error("--tries and --step-budget must be >= 1, --rate and --tick-hz > 0")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run the example tree against a live policy node: 0 on SUCCESS, 1 on FAILURE, 2 on timeout."""
    args = _parse(argv)
    import rclpy
    node_path = "/" + args.node.strip("/")
    namespace = node_path.rsplit("/", 1)[0]
    joints_topic = args.joints_topic or f"{namespace}/arm/joint_states"
    goal_topic = args.goal_topic or f"{namespace}/arm/goal"
    rclpy.init()
    node = rclpy.create_node("capsule_bt_example")
    spinner = spin_in_background(node)
    arm = None
    try:
        grasp = ReachGoal("ReachGoal", joints_topic=joints_topic, goal_topic=goal_topic, step_budget=args.step_budget)
        root = grasp_with_retries(grasp, tries=args.tries, node_path=node_path, server_wait_s=args.server_wait,
                                  call_timeout_s=args.call_timeout)
        tree = py_trees.trees.BehaviourTree(root)
        tree.setup(node=node)
        if args.arm == "local":
            arm = LocalArm(node, node_path=node_path, joints_topic=joints_topic, goal_topic=goal_topic,
                           rate_hz=args.rate, seed=args.seed)
        started = time.monotonic()
        status = tick_until_done(tree, period_s=1.0 / args.tick_hz, timeout_s=args.timeout)
        print(py_trees.display.unicode_tree(root, show_status=True))
        for key, value in sorted(py_trees.blackboard.Blackboard.storage.items()):
            print(f"{key}: {value}")
        print(f"{root.name}: {status.value} after {grasp.attempts} grasp attempt(s) "
              f"(tries allowed: {args.tries}), {time.monotonic() - started:.2f} s")
        return {Status.SUCCESS: 0, Status.FAILURE: 1}.get(status, 2)
    finally:
        if arm is not None:
            arm.stop()
        spinner.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
