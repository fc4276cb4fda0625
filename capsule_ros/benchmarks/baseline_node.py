"""The baseline for `capsule-ros bench loop` and `bench services`: what a user writes today.

A plain rclpy node that keeps the policy's state as ordinary tensors and calls the same
policy eagerly in its subscription callback, then publishes the action (the same
capsule_ros/msg/Action message). No arena, no graph, no capsules, no watchdog, no
deadline: the minimum a user would write. Its ``~/trigger`` (std_srvs/Trigger) answers at
once from the executor's thread: the floor a service of a Python node doing this work
can reach (``bench services`` calls it beside the capsule services).

    python -m capsule_ros.benchmarks.baseline_node --ros-args -r __ns:=/baseline
"""
from __future__ import annotations

import sys

import torch
from geometry_msgs.msg import PointStamped
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import JointState
from std_srvs.srv import Trigger

from capsule_ros.benchmarks.common import config_path
from capsule_ros.msg import Action
from capsule_ros.ros.entry import run_node
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy


class BaselinePolicyNode(Node):
    def __init__(self):
        super().__init__("baseline_policy")
        torch.set_num_threads(1)
        config = ServingConfig.from_file(config_path("policy.yaml"))
        self.policy = build_policy(config, weights="").eval()
        self.state = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in self.policy.state_spec()}
        with torch.no_grad():
            self.policy.init_state(self.state, episode=1, seed=0)
        self.pub = self.create_publisher(Action, "~/action", 10)
        self.create_subscription(PointStamped, "arm/goal", self.on_goal, 10)
        self.create_subscription(JointState, "arm/joint_states", self.on_joints, qos_profile_sensor_data)
        self.create_service(Trigger, "~/trigger", self.on_trigger)

    def on_trigger(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        response.success, response.message = True, f"step {int(self.state['step'][0])}"
        return response

    def on_goal(self, msg: PointStamped) -> None:
        self.state["goal"].copy_(torch.tensor([msg.point.x, msg.point.y]))

    def on_joints(self, msg: JointState) -> None:
        self.state["joints"].copy_(torch.tensor([*msg.position, *msg.velocity]))
        with torch.no_grad():
            self.policy.step(self.state)
        out = Action(values=self.state["action"].tolist(), chunk=self.state["chunk"].flatten().tolist(),
                     step=int(self.state["step"][0]), action_dim=self.policy.action_dim,
                     chunk_horizon=self.policy.chunk_horizon)
        out.header.stamp = msg.header.stamp
        self.pub.publish(out)


def main(argv=None) -> int:
    return run_node(BaselinePolicyNode, "baseline_node", argv)


if __name__ == "__main__":
    sys.exit(main())
