"""`sim_node`: the built-in simulated robot (capsule_ros.sim.arm.ArmSim) on ROS 2.

Publishes ``arm/joint_states`` (JointState: shoulder, elbow; position and velocity) and
``arm/goal`` (PointStamped, the goal before the joint state of every step) and applies
the ``values`` of ``capsule_policy/action`` (Action) as joint-velocity commands. Topic
names are relative: they follow the node's namespace, like policy_node's default ports.

Modes (parameter ``mode``):
- ``lockstep``: the arm advances one control period per action received and then
  publishes its new state, so a run is deterministic and as fast as the policy (the
  policy node in trigger mode on ``arm/joint_states``). Until the first action arrives
  the state is re-published every 0.2 s (discovery).
- ``realtime``: a timer at ``rate_hz`` advances the arm with the latest action; when no
  action came for ``action_timeout_ms`` it holds (zero velocity): the safe state.

``~/reset`` (std_srvs/Trigger) starts the next seeded episode; ``arm/set_goal``
(PointStamped) replaces the goal.
"""
from __future__ import annotations

import sys
import time
from typing import Any, List, Optional

import numpy as np
from geometry_msgs.msg import PointStamped
from rcl_interfaces.msg import FloatingPointRange, ParameterDescriptor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
from std_srvs.srv import Trigger

from capsule_ros.msg import Action
from capsule_ros.ros.entry import run_node
from capsule_ros.sim.arm import DT, ArmSim, Observation

JOINT_NAMES = ["shoulder", "elbow"]
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


def joint_state_message(obs: Observation, stamp, frame_id: str) -> JointState:
    msg = JointState(name=JOINT_NAMES, position=obs.joints[:2].astype(float).tolist(),
                     velocity=obs.joints[2:].astype(float).tolist())
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    return msg


def goal_message(obs: Observation, stamp, frame_id: str) -> PointStamped:
    msg = PointStamped()
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    msg.point.x, msg.point.y = float(obs.goal[0]), float(obs.goal[1])
    return msg


class ArmSimNode(Node):
    def __init__(self, node_name: str = "arm_sim", **kwargs: Any):
        super().__init__(node_name, **kwargs)
        p = self.declare_parameter
        self.seed: int = p("seed", 0, ParameterDescriptor(description="seed of the episode sequence",
                                                           read_only=True)).value
        self.mode: str = p("mode", "lockstep", ParameterDescriptor(
            description="lockstep (one period per action) or realtime (a timer at rate_hz)", read_only=True)).value
        rate: float = p("rate_hz", 1.0 / DT, ParameterDescriptor(
            description="realtime mode: steps per second", read_only=True,
            floating_point_range=[FloatingPointRange(from_value=0.1, to_value=1000.0, step=0.0)])).value
        self.action_timeout_s = p("action_timeout_ms", 200.0, ParameterDescriptor(
            description="realtime mode: hold (zero velocity) when no action came for this long")).value / 1e3
        self.frame_id: str = p("frame_id", "arm_base", ParameterDescriptor(read_only=True)).value
        action_topic: str = p("action_topic", "capsule_policy/action", ParameterDescriptor(read_only=True)).value
        if self.mode not in ("lockstep", "realtime"):
            raise ValueError(f"mode = {self.mode!r}: must be 'lockstep' or 'realtime'")
        self.sim = ArmSim(seed=self.seed)
        self.obs = self.sim.reset()
        self.joints_pub = self.create_publisher(JointState, "arm/joint_states", RELIABLE)
        self.goal_pub = self.create_publisher(PointStamped, "arm/goal", RELIABLE)
        self.create_subscription(Action, action_topic, self._on_action, RELIABLE)
        self.create_subscription(PointStamped, "arm/set_goal", self._on_set_goal, RELIABLE)
        self.create_service(Trigger, "~/reset", self._on_reset)
        self._last_action: Optional[List[float]] = None
        self._last_action_time = 0.0
        self._started = False
        if self.mode == "realtime":
            self.create_timer(1.0 / rate, self._on_timer)
        else:
            self._kick = self.create_timer(0.2, self._publish)     # until the first action arrives
        self.get_logger().info(f"simulated arm, {self.mode} mode, episode seed {self.sim.episode_seed}")

    def _publish(self) -> None:
        stamp = self.get_clock().now().to_msg()
        self.goal_pub.publish(goal_message(self.obs, stamp, self.frame_id))
        self.joints_pub.publish(joint_state_message(self.obs, stamp, self.frame_id))

    def _on_action(self, msg: Action) -> None:
        values = list(msg.values)
        if len(values) != 2:
            self.get_logger().warning(f"ignoring an action with {len(values)} values (the arm takes 2)",
                                      throttle_duration_sec=5.0)
            return
        if self.mode == "lockstep":
            if not self._started:
                self._started = True
                self.destroy_timer(self._kick)
            self.obs = self.sim.step(np.asarray(values))
            self._publish()
        else:
            self._last_action, self._last_action_time = values, time.monotonic()

    def _on_timer(self) -> None:
        fresh = self._last_action is not None and time.monotonic() - self._last_action_time < self.action_timeout_s
        self.obs = self.sim.step(np.asarray(self._last_action)) if fresh else self.sim.hold()
        self._publish()

    def _on_set_goal(self, msg: PointStamped) -> None:
        self.obs = self.sim.set_goal(np.array([msg.point.x, msg.point.y]))

    def _on_reset(self, request, response):
        self.obs = self.sim.reset()
        self._publish()
        response.success, response.message = True, f"episode seed {self.sim.episode_seed}"
        return response


def main(argv=None) -> int:
    return run_node(ArmSimNode, "sim_node", argv)


if __name__ == "__main__":
    sys.exit(main())
