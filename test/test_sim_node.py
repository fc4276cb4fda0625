"""sim_node (the built-in simulated robot) with policy_node, both as installed executables:
lockstep runs drive the arm from the policy's actions; realtime mode holds the arm still
when actions stop; a stream of Ctrl-Cs ends a node cleanly."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from harness import ClientNode, ManagedProcess, start_executable, start_policy_node, wait_for
from rclpy.qos import QoSProfile, ReliabilityPolicy

pytestmark = pytest.mark.ros
RELIABLE = QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE)


def start_sim(tmp_path, namespace: str, mode: str = "lockstep", **params) -> ManagedProcess:
    args = ["--ros-args", "-r", f"__ns:={namespace}", "-p", f"mode:={mode}"]
    for key, value in params.items():
        args += ["-p", f"{key}:={value}"]
    return start_executable("sim_node", args, tmp_path / f"sim-{mode}.log")


def test_lockstep_sim_and_policy_node_drive_each_other(tmp_path, rclpy_context):
    from sensor_msgs.msg import JointState

    from capsule_ros.msg import Action
    # no step deadline: a loaded machine must not turn the steps this test follows into held safe actions
    policy = start_policy_node(tmp_path, {"policy": {"weights": ""}, "ports": {"joints": {"qos": "reliable"}},
                                          "control": {"deadline_ms": 0.0}}, namespace="/lock")
    sim = start_sim(tmp_path, "/lock")
    client = ClientNode(rclpy_context, "sim_lockstep_client", node_path="/lock/capsule_policy")
    try:
        actions = client.subscribe(Action, "/lock/capsule_policy/action", RELIABLE)
        joints = client.subscribe(JointState, "/lock/arm/joint_states", RELIABLE)
        wait_for(lambda: actions.qsize() >= 30, timeout=60, what="30 lockstep actions")
        got = ClientNode.drain(actions)
        steps = [a.step for a in got]
        assert steps == list(range(steps[0], steps[0] + len(steps)))       # one step per arm state
        # the arm moves: waited for. Until the sim's action subscription is matched it republishes
        # its reset state every 0.2 s and the policy steps on each one; on a loaded machine that
        # matching took longer than the 30 actions above (every state so far the reset state).
        # Once it moves the arm may settle at its goal, so any two states received count, not
        # only the latest ones
        states: list = []

        def arm_moves() -> bool:
            states.extend(ClientNode.drain(joints))
            positions = np.array([s.position for s in states])
            return len(positions) >= 2 and float(np.ptp(positions, axis=0).max()) > 1e-3
        wait_for(arm_moves, timeout=60, what="the arm moving under the policy's actions")
        assert states[-1].name == ["shoulder", "elbow"]
    finally:
        client.close()
        assert sim.stop() == 0, sim.log()
        assert policy.stop() == 0, policy.log()


def test_realtime_sim_holds_still_when_actions_stop(tmp_path, rclpy_context):
    from sensor_msgs.msg import JointState

    from capsule_ros.msg import Action
    sim = start_sim(tmp_path, "/rt", mode="realtime", rate_hz=50.0, action_timeout_ms=100.0)
    client = ClientNode(rclpy_context, "sim_realtime_client")
    try:
        joints = client.subscribe(JointState, "/rt/arm/joint_states", RELIABLE)
        act = client.publisher(Action, "/rt/capsule_policy/action", RELIABLE)
        client.wait_for_subscribers(act)
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:                                   # command a motion ...
            act.publish(Action(values=[1.5, -1.0], action_dim=2))
            time.sleep(0.02)
        moving = wait_for(lambda: ClientNode.drain(joints), timeout=5, what="joint states")
        assert max(abs(v) for v in moving[-1].velocity) > 0.5
        stopped = time.monotonic()                                           # ... then stop sending

        def at_rest(state) -> bool:        # a zero velocity command: the joints decelerate to rest
            return max(abs(v) for v in state.velocity) < 1e-4
        wait_for(lambda: at_rest(joints.get(timeout=2)), timeout=10, what="the arm to come to rest")
        assert time.monotonic() - stopped >= 0.1           # not before action_timeout_ms (100 ms) passed
        held = [joints.get(timeout=2) for _ in range(5)]
        assert all(at_rest(s) for s in held)                                  # and it stays there
        assert np.allclose(held[0].position, held[-1].position, atol=1e-4)
    finally:
        client.close()
        assert sim.stop() == 0, sim.log()


def test_a_node_exits_cleanly_however_many_ctrl_cs_come_while_it_stops(tmp_path):
    """Under ros2 launch a node gets Ctrl-C twice (the terminal's, then launch's copy), and a
    node that cleans up fast can be exiting when the second comes; Python's exit puts the
    default SIGINT handler back, which would end it with -2. SIGINT every half millisecond
    from the first until the node is gone: it exits 0 every time."""
    for attempt in range(3):
        sim = start_sim(tmp_path, f"/ctrlc{attempt}")
        wait_for(lambda: "simulated arm" in sim.log(), timeout=60, what="sim_node up")
        deadline = time.monotonic() + 20.0
        while sim.proc.poll() is None and time.monotonic() < deadline:
            try:
                os.kill(sim.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                break
            time.sleep(0.0005)
        assert sim.stop() == 0, sim.log()
