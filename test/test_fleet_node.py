"""fleet_node for real: the installed executable serving four robots, each robot's simulated
arm (sim_node, lockstep) a process of its own in the robot's namespace, as robots on other
machines would reach it over DDS.

- every robot has policy_node's interface under its namespace (the same names and types);
- commit, interrupt, re-enter and fork act on one robot while the others keep stepping;
- a capsule committed on one robot is re-entered by another (an episode moves);
- each robot's bag, recorded through its ``~/record`` as policy_node's tests record,
  verifies BIT-IDENTICAL with ``capsule-ros replay --verify`` in a fresh process (at the
  fleet's shape, the moved capsule read from the fleet's capsule directory);
- Ctrl-C (SIGINT to the process group) under ``ros2 launch capsule_ros fleet.launch.py
  use_sim:=true`` stops the fleet node and every simulated arm cleanly.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

import pytest
import yaml
from harness import (
    REPO,
    ClientNode,
    ManagedProcess,
    ctrl_c,
    require_launch_tooling,
    start_executable,
    unique_ns,
    wait_for,
)
from rclpy.qos import QoSProfile, ReliabilityPolicy

pytestmark = pytest.mark.ros
ROBOTS = ("arm1", "arm2", "arm3", "arm4")
FLEET_PARAMS = REPO / "config" / "fleet.yaml"
RELIABLE = QoSProfile(depth=5000, reliability=ReliabilityPolicy.RELIABLE)
START_TIMEOUT_S = 120.0          # torch import, the fleet's warm-up and DDS discovery on a busy 2-core machine
CLI = [sys.executable, "-m", "capsule_ros.cli.main"]


def start_fleet_node(tmp_path: Path, namespace: str) -> ManagedProcess:
    """fleet_node with config/fleet.yaml, capsules and bags in the test's directory, no
    step deadline (a loaded machine must not turn the steps compared into held actions)."""
    overlay = tmp_path / "fleet-overrides.yaml"
    overlay.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "capsules": {"directory": str(tmp_path / "capsules")}, "control": {"deadline_ms": 0.0},
        "record": {"directory": str(tmp_path / "bags")}}}}))
    return start_executable("fleet_node", ["--ros-args", "--params-file", str(FLEET_PARAMS), "--params-file",
                                           str(overlay), "-r", f"__ns:={namespace}"], tmp_path / "fleet.log")


def start_sim(tmp_path: Path, namespace: str, seed: int) -> ManagedProcess:
    return start_executable("sim_node", ["--ros-args", "-r", f"__ns:={namespace}", "-p", "mode:=lockstep",
                                         "-p", f"seed:={seed}"], tmp_path / f"sim{seed}.log")


class Robot:
    """One robot of the fleet as its clients see it: its capsule services and its actions."""

    def __init__(self, client: ClientNode, ns: str, name: str):
        from capsule_ros.msg import Action
        from capsule_ros.ros.client import CapsuleClient
        self.name, self.path = name, f"{ns}/{name}/capsule_policy"
        self.capsules = CapsuleClient(client.node, self.path, server_wait_s=START_TIMEOUT_S, call_timeout_s=30.0)
        self.actions: queue.Queue = queue.Queue()
        client.node.create_subscription(Action, f"{self.path}/action", self.actions.put, RELIABLE)

    def next_actions(self, count: int, timeout: float = 60.0) -> List:
        """The next ``count`` actions published after this call."""
        ClientNode.drain(self.actions)
        return [self.actions.get(timeout=timeout) for _ in range(count)]

    def actions_from(self, first: Callable[[Any], bool], count: int, timeout: float = 60.0) -> List:
        """After a verb: the first action for which ``first`` holds (the verb's effect) and the
        ``count - 1`` after it. The actions before it, published before the verb took effect
        and still in transit (a loaded machine's client falls behind a lockstep arm), are
        passed over; AssertionError when none shows the effect within ``timeout``."""
        ClientNode.drain(self.actions)
        deadline = time.monotonic() + timeout
        action = self.actions.get(timeout=timeout)
        while not first(action):
            assert time.monotonic() < deadline, f"{self.name}: no action showed the verb's effect in {timeout} s"
            action = self.actions.get(timeout=timeout)
        return [action] + [self.actions.get(timeout=timeout) for _ in range(count - 1)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, rclpy_context):
    tmp = tmp_path_factory.mktemp("fleet")
    ns = unique_ns("fleet")
    node = start_fleet_node(tmp, ns)
    sims = [start_sim(tmp, f"{ns}/{name}", seed) for seed, name in enumerate(ROBOTS)]
    client = ClientNode(rclpy_context, "fleet_test_client", node_path=f"{ns}/{ROBOTS[0]}/capsule_policy")
    try:
        robots = {name: Robot(client, ns, name) for name in ROBOTS}
        for robot in robots.values():
            robot.actions.get(timeout=START_TIMEOUT_S)              # its arm and its slot step
        yield SimpleNamespace(tmp=tmp, ns=ns, node=node, client=client, robots=robots)
    finally:
        client.close()
        for sim in sims:
            assert sim.stop() == 0, sim.log()
        assert node.stop() == 0, node.log()
        log = node.log()
        assert "Traceback" not in log and "RCLError" not in log, log


def test_each_robot_has_policy_nodes_interface_under_its_namespace(fleet):
    """The robot's node is ``<ns>/<robot>/capsule_policy`` with policy_node's topics,
    services and action, typed as policy_node's; its ports are in its namespace."""
    from capsule_ros.msg import RuntimeStatus
    node = fleet.client.node
    expected = {("capsule_policy", f"{fleet.ns}/{name}") for name in ROBOTS}
    wait_for(lambda: expected <= set(node.get_node_names_and_namespaces()), timeout=30, what="every robot's node")
    want_services = {f"{fleet.ns}/{name}/capsule_policy/{service}": [f"capsule_ros/srv/{kind}"]
                     for name in ROBOTS
                     for service, kind in (("commit", "Commit"), ("reset", "Reset"), ("interrupt", "Interrupt"),
                                           ("reenter", "Reenter"), ("fork", "Fork"),
                                           ("save_capsule", "SaveCapsule"), ("load_capsule", "LoadCapsule"),
                                           ("list_capsules", "ListCapsules"), ("drop_capsule", "DropCapsule"),
                                           ("record", "Record"))}
    want_topics = {}
    for name in ROBOTS:
        path = f"{fleet.ns}/{name}/capsule_policy"
        want_topics.update({f"{path}/action": ["capsule_ros/msg/Action"],
                            f"{path}/status": ["capsule_ros/msg/RuntimeStatus"],
                            f"{path}/capsule_events": ["capsule_ros/msg/CapsuleEvent"],
                            f"{path}/run_policy/_action/status": ["action_msgs/msg/GoalStatusArray"],
                            f"{fleet.ns}/{name}/arm/joint_states": ["sensor_msgs/msg/JointState"]})
    # discovery brings names one by one: wait until all are known, then compare their types
    wait_for(lambda: set(want_services) <= set(dict(node.get_service_names_and_types()))
             and set(want_topics) <= set(dict(node.get_topic_names_and_types())),
             timeout=60, what="every robot's services and topics")
    services = dict(node.get_service_names_and_types())
    topics = dict(node.get_topic_names_and_types())
    assert {name: services[name] for name in want_services} == want_services
    assert {name: topics[name] for name in want_topics} == want_topics
    status: queue.Queue = queue.Queue()
    node.create_subscription(RuntimeStatus, f"{fleet.ns}/arm3/capsule_policy/status", status.put, 10)
    picture = status.get(timeout=30)
    assert picture.lifecycle_state == "active" and picture.actions_published > 0


def test_verbs_act_per_robot_while_the_others_step_a_capsule_moves_and_every_bag_verifies(fleet):
    from capsule_ros.msg import Action
    from capsule_ros.srv import Interrupt
    robots: Dict[str, Robot] = fleet.robots
    bags = {name: fleet.tmp / f"bag-{name}" for name in ROBOTS}
    for name, robot in robots.items():
        robot.capsules.record(True, str(bags[name]), "mcap")
        robot.capsules.reset()                                       # each bag starts at a RESET (an anchor)
    arm1, arm2, arm3, arm4 = (robots[name] for name in ROBOTS)
    for robot in robots.values():
        robot.next_actions(10)

    # arm1 commits (saved to the fleet's directory), arm2 is interrupted: the others keep stepping
    moved = arm1.capsules.commit(label="moved", persist=True).capsule
    interrupted = arm2.capsules.interrupt(hold_mode=Interrupt.Request.HOLD_LAST, commit=True)
    assert interrupted.success, interrupted.message
    held = arm2.actions_from(lambda a: a.source == Action.SOURCE_HOLD, 5)
    assert {a.source for a in held} == {Action.SOURCE_HOLD}              # safe actions, its arm held
    for robot in (arm1, arm3, arm4):
        stepping = robot.next_actions(10)
        assert {a.source for a in stepping} == {Action.SOURCE_POLICY}, robot.name
        steps = [a.step for a in stepping]
        assert steps == list(range(steps[0], steps[0] + 10)), (robot.name, steps)
    assert all(a.step == held[0].step for a in arm2.next_actions(5))     # arm2's state did not advance

    # arm2 re-enters its interrupt capsule; arm3 forks its live state; arm4 takes arm1's capsule
    assert arm2.capsules.reenter("").success
    resumed = arm2.actions_from(lambda a: a.source == Action.SOURCE_POLICY, 5)
    assert {a.source for a in resumed} == {Action.SOURCE_POLICY}
    steps = [a.step for a in resumed]                                  # on from where it was held
    assert steps == list(range(steps[0], steps[0] + 5)) and steps[0] > held[0].step, (held[0].step, steps)
    forked = arm3.capsules.fork("", "branch")
    assert forked.success and forked.capsule.id and forked.capsule.label == "branch", forked.message
    reentered = arm4.capsules.reenter(moved.id)
    assert reentered.success and not reentered.fallback, reentered.message     # restored, not recomputed
    after = arm4.actions_from(lambda a: a.lineage == moved.id, 10)
    assert {a.lineage for a in after} == {moved.id} and after[-1].step > moved.step
    for robot in (arm1, arm2, arm3):
        assert {a.source for a in robot.next_actions(5)} == {Action.SOURCE_POLICY}, robot.name
    listed = {c.id for c in arm4.capsules.list().capsules}
    assert moved.id in listed                                            # one store for the fleet

    for robot in robots.values():
        robot.capsules.record(False)
    procs = {name: subprocess.Popen([*CLI, "replay", str(bag), "--verify", "--json"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=REPO) for name, bag in bags.items()}
    reports = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, out[-3000:], err[-3000:])
        report = reports[name] = json.loads(out)
        assert report["identical"] and report["first_divergence"] is None, (name, report)
        assert report["steps_compared"] >= 20 and report["steps_skipped"] == 0, (name, report)
        assert "fleet of 4 slots" in report["target"], report["target"]
    assert reports["arm1"]["events_replayed"].get("COMMIT") == 1
    assert reports["arm2"]["events_replayed"].get("INTERRUPT") == 1 and reports["arm2"]["events_replayed"]["REENTER"]
    assert reports["arm3"]["events_replayed"].get("FORK") == 1
    assert reports["arm4"]["events_replayed"].get("REENTER") == 1        # the moved capsule, read from its file


# -- Ctrl-C under ros2 launch ------------------------------------------------------------------------
def test_ctrl_c_stops_ros2_launch_the_fleet_and_every_simulated_arm_cleanly(tmp_path, rclpy_context):
    """`ros2 launch capsule_ros fleet.launch.py use_sim:=true` in its own process group
    (fleet_node and four sim_node processes), SIGINT to the group while every robot's
    actions stream: each process gets SIGINT twice (terminal and launch) and exits 0."""
    require_launch_tooling("ros2launch")
    psutil = pytest.importorskip("psutil", reason="the process tree of ros2 launch is read with psutil")
    env = dict(os.environ, HOME=str(tmp_path))
    log_path = tmp_path / "ros2-launch.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["ros2", "launch", "capsule_ros", "fleet.launch.py", "use_sim:=true",
                                 "namespace:=" + unique_ns("launched").strip("/")],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    pgid = os.getpgid(proc.pid)
    client = ClientNode(rclpy_context, "fleet_launch_client")
    try:
        from capsule_ros.msg import Action
        ns = proc.args[-1].split(":=", 1)[1]
        actions = {name: client.subscribe(Action, f"/{ns}/{name}/capsule_policy/action", RELIABLE) for name in ROBOTS}
        wait_for(lambda: all(q.qsize() >= 20 for q in actions.values()), timeout=START_TIMEOUT_S,
                 what="20 actions of every launched robot")
        children = [c for c in psutil.Process(proc.pid).children(recursive=True)
                    if any(Path(arg).name in ("fleet_node", "sim_node") for arg in c.cmdline()[:2])]
        names = sorted(Path(next(a for a in c.cmdline()[:2] if Path(a).name in ("fleet_node", "sim_node"))).name
                       for c in children)
        assert names == ["fleet_node"] + ["sim_node"] * len(ROBOTS), names
        assert all(os.getpgid(c.pid) == pgid for c in children)
        rc = ctrl_c(proc, log_path)                                          # a terminal's Ctrl-C
    finally:
        client.close()
        if proc.poll() is None:
            os.killpg(pgid, signal.SIGKILL)
            proc.wait()
    output = log_path.read_text(errors="replace")
    assert rc == 0, output
    assert "[fleet_node-1]: process has finished cleanly" in output, output
    assert output.count("sim_node") and output.count("process has finished cleanly") == 1 + len(ROBOTS), output
    for bad in ("Traceback", "RCLError", "KeyboardInterrupt", "process has died"):
        assert bad not in output, output
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
