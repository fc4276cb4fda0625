"""An Isaac Lab-style recurrent ``policy.onnx`` served by the installed ``policy_node``
(``config/onnx_quadruped.yaml``, ``policy.kind: onnx``), fed by real ``JointState``
(in the robot's URDF joint order), ``Imu``, ``Twist`` and ``TwistStamped`` messages:

- its actions (joint targets) are bit-identical to a plain ``InferenceSession.run`` loop
  that builds the same observation and feeds h, c and the last action back, and the
  ``Float64MultiArray`` output carries them in the controller's joint order;
- reset, rollback and fork through the services are exact;
- a bag recorded through ``~/record`` verifies with ``capsule-ros replay --verify``;
- sb3-contrib's RecurrentPPO export (its episode-start flag), with its state and flag
  renamed so that no default recognises them, serves bit for bit with
  ``policy.onnx.state`` and ``policy.onnx.episode_start`` naming them.

The tests of the Isaac Lab model share one node, put back as a fresh one before each
(``restore_node``); the sb3-contrib model gets a node of its own.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from harness import REPO, ClientNode, restore_node, start_policy_node, wait_for
from onnx_models import renamed

from capsule_ros.benchmarks.onnx_step import PlainLoop, sensor_rows
from capsule_ros.config import load_params_file
from capsule_ros.policies.ort.model import OnnxModelError
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy

pytestmark = pytest.mark.ros
PARAMS = REPO / "config" / "onnx_quadruped.yaml"
MODEL = REPO / "test" / "fixtures" / "onnx" / "rsl_rl_lstm" / "policy.onnx"
SB3_MODEL = REPO / "test" / "fixtures" / "onnx" / "sb3_lstm" / "policy.onnx"
# sb3-contrib's names (lstm_h:lstm_h_out, episode_starts) -> ones no default recognises
SB3_NAMES = {"lstm_h": "memory_h", "lstm_h_out": "memory_h_next", "lstm_c": "memory_c", "lstm_c_out": "memory_c_next",
             "episode_starts": "first_step"}
SB3_STATE = (("memory_h", "memory_h_next"), ("memory_c", "memory_c_next"))
NS = "/quad"
RELIABLE = {"qos": "reliable", "depth": 500}
OVERRIDES = {"ports": {"joints": {"topic": "joint_states", **RELIABLE}, "imu": {"topic": "imu", **RELIABLE},
                       "cmd_vel": {"topic": "cmd_vel", **RELIABLE}, "base_twist": {"topic": "base_twist", **RELIABLE}},
             "outputs": {"legs": {"topic": "legs"}},
             "control": {"deadline_ms": 5000.0,        # a slow shared CPU must not turn steps into safe actions
                         "status_rate_hz": 20.0},
             "policy": {"onnx": {"model": str(MODEL)}}, "runtime": {"device": "cpu"}}
POLICY_JOINTS = [f"{leg}_{part}_joint" for part in ("hip", "thigh", "calf") for leg in ("FL", "FR", "RL", "RR")]
ROBOT_JOINTS = [f"{leg}_{part}_joint" for leg in ("FL", "FR", "RL", "RR") for part in ("hip", "thigh", "calf")]
TO_ROBOT = [POLICY_JOINTS.index(name) for name in ROBOT_JOINTS]


class Robot:
    """Publishes a quadruped's sensors and triggers one step per joint state."""

    def __init__(self, client: ClientNode, ns: str = NS):
        from geometry_msgs.msg import Twist, TwistStamped
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import Imu, JointState
        from std_msgs.msg import Float64MultiArray

        from capsule_ros.msg import Action, RuntimeStatus
        qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        self.client, self.capsules = client, client.capsules
        self.types = {"joints": JointState, "imu": Imu, "cmd_vel": Twist, "base_twist": TwistStamped}
        self.pub = {name: client.publisher(kind, f"{ns}/{OVERRIDES['ports'][name]['topic']}", qos)
                    for name, kind in self.types.items()}
        self.actions = client.subscribe(Action, f"{ns}/capsule_policy/action", qos)
        self.legs = client.subscribe(Float64MultiArray, f"{ns}/legs", qos)
        self.status = client.subscribe(RuntimeStatus, f"{ns}/capsule_policy/status")
        for publisher in self.pub.values():
            client.wait_for_subscribers(publisher)
        self.sent = dict.fromkeys(self.types, 0)
        self.stamp = 0

    def _header(self, msg) -> None:
        self.stamp += 1
        msg.header.stamp.sec = self.stamp

    def messages(self, rows, t: int) -> dict:
        joints, imu = rows["joints"][t].astype(float), rows["imu"][t].astype(float)
        js = self.types["joints"]()
        js.name = ROBOT_JOINTS
        js.position, js.velocity = joints[:12][TO_ROBOT].tolist(), joints[12:][TO_ROBOT].tolist()
        im = self.types["imu"]()
        im.orientation.x, im.orientation.y, im.orientation.z, im.orientation.w = imu[:4].tolist()
        im.angular_velocity.x, im.angular_velocity.y, im.angular_velocity.z = imu[4:].tolist()
        cmd = self.types["cmd_vel"]()
        cmd.linear.x, cmd.linear.y, cmd.angular.z = rows["cmd_vel"][t].astype(float).tolist()
        tw = self.types["base_twist"]()
        tw.twist.linear.x, tw.twist.linear.y, tw.twist.linear.z = rows["base_twist"][t].astype(float).tolist()
        for msg in (js, im, tw):
            self._header(msg)
        return {"imu": im, "cmd_vel": cmd, "base_twist": tw, "joints": js}

    def step(self, rows, t: int):
        """The sensors of row ``t``, then (once the node has them) the joint state: the action."""
        msgs = self.messages(rows, t)
        self.client.drain(self.status)
        for name in ("imu", "cmd_vel", "base_twist"):
            self.pub[name].publish(msgs[name])
            self.sent[name] += 1

        def taken() -> bool:
            others = [name for name in self.sent if name != "joints"]
            return any(all(p.received >= self.sent[p.name] for p in s.ports if p.name in others)
                       for s in self.client.drain(self.status))
        wait_for(taken, timeout=30, interval=0.01, what="the node to take the sensors")
        self.client.drain(self.actions)
        self.pub["joints"].publish(msgs["joints"])
        self.sent["joints"] += 1
        action = self.actions.get(timeout=30)
        return action, self.legs.get(timeout=30)

    def run(self, rows, steps) -> list:
        return [self.step(rows, t) for t in steps]


def values(run) -> list:
    return [np.asarray(action.values, np.float32).tobytes() for action, _ in run]


@pytest.fixture(scope="module")
def shared(tmp_path_factory, rclpy_context):
    tmp = tmp_path_factory.mktemp("onnx")
    proc = start_policy_node(tmp, OVERRIDES, namespace=NS, params_file=PARAMS, tag="quad")
    client = ClientNode(rclpy_context, "quad_client", node_path=f"{NS}/capsule_policy")
    yield proc, Robot(client), tmp
    client.close()
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def robot(shared):
    """The module's node, put back as a fresh one comes up (``restore_node``) before each
    test: the tests reset, commit, fork, re-enter and record on it."""
    proc, bot, tmp = shared
    restore_node(bot.client, {})
    for q in (bot.actions, bot.legs):
        ClientNode.drain(q)
    return shared


@pytest.fixture(scope="module")
def rows():
    return sensor_rows(40, seed=21)


def reference(rows, steps: int, model=MODEL, **loop) -> list:
    """The joint targets of a plain ONNX Runtime loop (``PlainLoop``: state pairs and the
    episode-start input in ``loop``), as the node's action values' bytes."""
    settings = ServingConfig.from_params(load_params_file(PARAMS)).policy_settings
    plain = PlainLoop(model, settings, **loop)
    return [plain.step(rows, t).astype(np.float32).tobytes() for t in range(steps)]


def test_policy_node_serves_the_plain_onnxruntime_loop_bit_for_bit(robot, rows):
    proc, bot, _ = robot
    bot.capsules.reset()
    run = bot.run(rows, range(30))
    assert [a.step for a, _ in run] == list(range(1, 31))
    assert values(run) == reference(rows, 30)
    indices = [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]                    # outputs.legs.indices: URDF order
    for action, legs in run:
        assert list(legs.data) == np.asarray(action.values, np.float64)[indices].tolist()
    assert proc.alive(), proc.log()


def test_reset_rollback_and_fork_through_the_services_are_exact(robot, rows):
    proc, bot, _ = robot
    bot.capsules.reset()
    start = values(bot.run(rows, range(10)))
    capsule = bot.capsules.commit(label="k").capsule
    first = values(bot.run(rows, range(10, 25)))
    fork = bot.capsules.fork(capsule.id, label="branch").capsule
    assert bot.capsules.reenter(capsule.id).rollback
    assert values(bot.run(rows, range(10, 25))) == first
    bot.capsules.reenter(fork.id)
    assert values(bot.run(rows, range(10, 25))) == first
    bot.capsules.reset()
    assert values(bot.run(rows, range(10))) == start == reference(rows, 10)


def test_a_recorded_rollback_verifies_with_capsule_ros_replay(robot, rows):
    proc, bot, tmp = robot
    bag = tmp / "rollback"
    bot.capsules.record(True, str(bag), "mcap")
    bot.capsules.reset()
    bot.run(rows, range(8))
    capsule = bot.capsules.commit(label="k", persist=True).capsule
    first = values(bot.run(rows, range(8, 20)))
    bot.capsules.reenter(capsule.id)
    assert values(bot.run(rows, range(8, 20))) == first
    assert bot.capsules.record(False).messages > 0
    verify = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "replay", str(bag), "--verify", "--json"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    verdict = json.loads(verify.stdout)
    assert verdict["identical"] and verdict["steps_compared"] == verdict["steps_matched"] == 8 + 12 + 12


@pytest.fixture
def sb3_robot(tmp_path, rclpy_context):
    """A node of its own serving the renamed sb3-contrib model with policy.onnx.state and
    policy.onnx.episode_start naming its tensors."""
    model = renamed(SB3_MODEL, tmp_path / "policy.onnx", SB3_NAMES)
    ns = "/quad_sb3"
    overrides = {**OVERRIDES, "policy": {"onnx": {"model": str(model), "episode_start": "first_step",
                                                  "state": [f"{a}:{b}" for a, b in SB3_STATE]}}}
    proc = start_policy_node(tmp_path, overrides, namespace=ns, params_file=PARAMS, tag="quad_sb3")
    client = ClientNode(rclpy_context, "quad_sb3_client", node_path=f"{ns}/capsule_policy")
    yield proc, Robot(client, ns), model
    client.close()
    assert proc.stop() == 0, proc.log()


def test_an_sb3_contrib_export_with_its_own_names_serves_the_plain_onnxruntime_loop_bit_for_bit(sb3_robot, rows):
    """The episode-start flag is 1 on an episode's first step and 0 after, in the node as in
    the plain loop, also after a reset; without the two settings the model is refused
    (the defaults recognise none of its names)."""
    proc, bot, model = sb3_robot
    params = load_params_file(PARAMS)
    params["policy"]["onnx"]["model"] = str(model)
    with pytest.raises(OnnxModelError, match="memory_h"):
        build_policy(ServingConfig.from_params(params))
    bot.capsules.reset()
    first = values(bot.run(rows, range(20)))
    bot.capsules.reset()
    again = values(bot.run(rows, range(10)))
    expected = reference(rows, 20, model, state=SB3_STATE, episode_start="first_step")
    assert first == expected and again == expected[:10]
    assert len(set(first)) == len(first)
    assert proc.alive(), proc.log()
