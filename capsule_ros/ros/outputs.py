"""Command outputs: the messages of ``serving/outputs.py``'s Commands, one publisher each."""
from __future__ import annotations

from typing import Callable, Dict

from builtin_interfaces.msg import Duration
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data, qos_profile_system_default
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray, MultiArrayDimension
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from capsule_ros.ros.messages import ros_time
from capsule_ros.serving.outputs import JOINT_STATE, MULTI_ARRAY, TRAJECTORY, Command, OutputAdapter
from capsule_ros.serving.records import ActionRecord

FIELD_OF_INTERFACE = {"position": "positions", "velocity": "velocities", "effort": "effort"}


def qos_profile(qos: str, depth: int) -> QoSProfile:
    """The named QoS profile (``sensor_data``, ``reliable``, ``system_default``) at ``depth``."""
    if qos == "sensor_data":
        return QoSProfile(depth=depth, reliability=qos_profile_sensor_data.reliability,
                          durability=qos_profile_sensor_data.durability, history=qos_profile_sensor_data.history)
    if qos == "reliable":
        return QoSProfile(depth=depth, reliability=ReliabilityPolicy.RELIABLE)
    return qos_profile_system_default


def _duration(seconds: float) -> Duration:
    nanoseconds = int(round(seconds * 1e9))
    return Duration(sec=nanoseconds // 1_000_000_000, nanosec=nanoseconds % 1_000_000_000)


def trajectory_message(adapter: OutputAdapter, command: Command) -> JointTrajectory:
    """Rows as points at (i + 1) * time_step from the step's input time; a safe action is
    stamped zero, which joint_trajectory_controller starts at once (replacing the chunk it
    runs), and carries zero velocities when it holds a position."""
    msg = JointTrajectory(joint_names=list(adapter.config.joints))
    if not command.safe:
        msg.header.stamp = ros_time(command.stamp_ns)
    field = FIELD_OF_INTERFACE[adapter.config.interface]
    for i, row in enumerate(command.rows):
        point = JointTrajectoryPoint(time_from_start=_duration((i + 1) * command.time_step_s))
        setattr(point, field, row.tolist())
        if command.safe and field == "positions":
            point.velocities = [0.0] * len(row)
        msg.points.append(point)
    return msg


def multi_array_message(adapter: OutputAdapter, command: Command) -> Float64MultiArray:
    msg = Float64MultiArray(data=command.rows[0].tolist())
    msg.layout.dim = [MultiArrayDimension(label="joints", size=adapter.size, stride=adapter.size)]
    return msg


def joint_state_message(adapter: OutputAdapter, command: Command) -> JointState:
    msg = JointState(name=list(adapter.config.joints))
    msg.header.stamp = ros_time(command.stamp_ns)
    setattr(msg, adapter.config.interface, command.rows[0].tolist())
    return msg


BUILDERS: Dict[str, Callable[[OutputAdapter, Command], object]] = {
    TRAJECTORY: trajectory_message, MULTI_ARRAY: multi_array_message, JOINT_STATE: joint_state_message,
}
MESSAGE_CLASSES = {TRAJECTORY: JointTrajectory, MULTI_ARRAY: Float64MultiArray, JOINT_STATE: JointState}


class OutputPublisher:
    """One configured output: its adapter and its publisher."""

    def __init__(self, node: Node, adapter: OutputAdapter):
        self.adapter = adapter
        config = adapter.config
        self._build = BUILDERS[config.type]
        self.publisher = node.create_publisher(MESSAGE_CLASSES[config.type], config.topic,
                                               qos_profile(config.qos, config.depth))

    def publish(self, record: ActionRecord, now_ns: int) -> None:
        command = self.adapter.command(record, now_ns)
        if command is not None:
            self.publisher.publish(self._build(self.adapter, command))
