"""Output adapters: the action as JointTrajectory / Float64MultiArray / JointState commands.

The mapping itself ROS-free (serving/outputs.py), then the installed policy_node publishing
all three on real topics next to ~/action, including the safe actions of an interrupt.
"""
from __future__ import annotations

import numpy as np
import pytest

from capsule_ros.errors import ConfigError
from capsule_ros.serving.config import ServingConfig, default_config_path
from capsule_ros.serving.outputs import JOINT_STATE, MULTI_ARRAY, TRAJECTORY, OutputAdapter, OutputConfig
from capsule_ros.serving.records import ActionRecord, ActionSource

CHUNK = np.arange(12, dtype=np.float32).reshape(4, 3) / 10      # [H=4, A=3]


def policy_record(chunk=CHUNK, stamp_ns=123) -> ActionRecord:
    return ActionRecord(chunk[0].copy(), chunk.copy(), ActionSource.POLICY, 1, 5, "", stamp_ns)


def safe_record(source=ActionSource.ZERO) -> ActionRecord:
    return ActionRecord(np.zeros(3, np.float32), None, source, 1, 5, "", 0)


def adapter(period_s=0.05, **settings) -> OutputAdapter:
    config = OutputConfig.from_mapping({"topic": "/cmd", **settings}, section="outputs.cmd")
    return OutputAdapter("cmd", config, action_dim=3, control_period_s=period_s)


def test_a_trajectory_carries_the_chunk_as_future_points_from_the_step_input_time():
    out = adapter(type=TRAJECTORY, joints=["a", "c"], indices=[0, 2], points=3)
    command = out.command(policy_record(), now_ns=999)
    np.testing.assert_array_equal(command.rows, CHUNK[:3][:, [0, 2]].astype(np.float64))
    assert (command.time_step_s, command.stamp_ns, command.safe) == (0.05, 123, False)


def test_safe_actions_hold_the_last_commanded_position():
    out = adapter(type=MULTI_ARRAY, interface="position")
    assert out.command(safe_record(), now_ns=7) is None, "no position commanded yet: nothing to hold"
    out.command(policy_record(), now_ns=8)
    for source in (ActionSource.HOLD, ActionSource.ZERO):          # zero must not mean "go to 0 rad"
        held = out.command(safe_record(source), now_ns=9)
        np.testing.assert_array_equal(held.rows, CHUNK[:1].astype(np.float64))
        assert held.safe and held.stamp_ns == 9


@pytest.mark.parametrize("interface", ["velocity", "effort"])
def test_safe_actions_command_zero_velocity_and_effort(interface):
    out = adapter(type=JOINT_STATE, interface=interface, joints=["a", "b", "c"])
    out.command(policy_record(), now_ns=1)
    for source in (ActionSource.HOLD, ActionSource.ZERO):          # hold must not keep a velocity going
        np.testing.assert_array_equal(out.command(safe_record(source), now_ns=2).rows, np.zeros((1, 3)))


@pytest.mark.parametrize("settings, message", [
    ({"type": TRAJECTORY}, "needs joint names"),
    ({"type": MULTI_ARRAY, "indices": [3]}, "out of range for the policy's action_dim 3"),
    ({"type": JOINT_STATE, "joints": ["a", "b"]}, "2 names for 3 action values"),
    ({"type": MULTI_ARRAY, "joints": ["a", "a"], "indices": [0, 1]}, "names repeat"),
    ({"type": "trajectory_msgs/JointTrajectory", "joints": ["a", "b", "c"], "period": None},
     "must be set when control.mode is 'trigger'"),
])
def test_misconfigured_outputs_are_refused_at_start(settings, message):
    settings = dict(settings)
    period = settings.pop("period", 0.05)
    with pytest.raises(ConfigError, match=message):
        adapter(period_s=period, **settings)


def test_outputs_are_listed_by_name_like_ports():
    from capsule_ros.config import load_params_file
    params = load_params_file(default_config_path())
    params["outputs"] = {"names": ["arm"], "arm": {"topic": "/x", "type": "std_msgs/Float64MultiArray"}}
    assert ServingConfig.from_params(params).outputs["arm"].type == MULTI_ARRAY
    params["outputs"]["gripper"] = {"topic": "/y"}
    with pytest.raises(ConfigError, match=r"\['gripper'\] configured but not listed in outputs.names"):
        ServingConfig.from_params(params)


# -- through ROS ----------------------------------------------------------------------------------

@pytest.mark.ros
def test_policy_node_publishes_commands_a_controller_takes(tmp_path, rclpy_context):
    from harness import ClientNode, Driver, observations, start_policy_node, unique_ns, wait_for
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray
    from trajectory_msgs.msg import JointTrajectory
    reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    ns = unique_ns("outputs")
    outputs = {"names": ["arm", "wrist", "joints"],
               "arm": {"topic": "arm_controller/joint_trajectory", "type": TRAJECTORY,
                       "joints": ["shoulder", "elbow"], "time_step_ms": 50.0},
               "wrist": {"topic": "wrist_controller/commands", "type": MULTI_ARRAY, "interface": "velocity",
                         "indices": [1]},
               "joints": {"topic": "joint_commands", "type": JOINT_STATE, "joints": ["shoulder", "elbow"]}}
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}, "control": {"deadline_ms": 5000.0},
                                        "outputs": outputs}, namespace=ns)
    client = ClientNode(rclpy_context, f"outputs_client_{ns.strip('/')}", node_path=f"{ns}/capsule_policy")
    try:
        trajectories = client.subscribe(JointTrajectory, f"{ns}/arm_controller/joint_trajectory", reliable)
        velocities = client.subscribe(Float64MultiArray, f"{ns}/wrist_controller/commands", reliable)
        commands = client.subscribe(JointState, f"{ns}/joint_commands", reliable)
        driver = Driver(client, ns)
        driver.send_goal()
        actions = driver.run(observations(4, 1))
        wait_for(lambda: trajectories.qsize() >= 4 and velocities.qsize() >= 4 and commands.qsize() >= 4,
                 timeout=10, what="a command on every output for every action")
        for action in actions:
            chunk = np.asarray(action.chunk, np.float32).reshape(action.chunk_horizon, action.action_dim)
            trajectory, velocity, command = trajectories.get(), velocities.get(), commands.get()
            assert trajectory.header.stamp == action.header.stamp, "the chunk starts at the step's input time"
            assert trajectory.joint_names == ["shoulder", "elbow"]
            assert [list(p.positions) for p in trajectory.points] == chunk.astype(np.float64).tolist()
            assert [p.time_from_start.nanosec for p in trajectory.points] == [
                50_000_000 * (i + 1) for i in range(action.chunk_horizon)]
            assert list(velocity.data) == [float(action.values[1])]
            assert list(command.name) == ["shoulder", "elbow"] and command.header.stamp == action.header.stamp
            assert list(command.position) == [float(v) for v in action.values]

        client.capsules.interrupt(hold_mode=1)      # HOLD_ZERO: positions still hold, velocities stop
        held = trajectories.get(timeout=10)
        assert held.header.stamp.sec == 0 and held.header.stamp.nanosec == 0, "a stop starts at once"
        assert [list(p.positions) for p in held.points] == [[float(v) for v in actions[-1].values]]
        assert list(held.points[0].velocities) == [0.0, 0.0]
        assert list(velocities.get(timeout=10).data) == [0.0]
        assert list(commands.get(timeout=10).position) == [float(v) for v in actions[-1].values]
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()
