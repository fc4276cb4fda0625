"""The ``ros2`` commands README.md and docs/behavior-trees.md show, run as a user runs them
against the installed nodes: ``ros2 lifecycle`` to bring a managed node up and down, and
``ros2 action send_goal --feedback`` on ``~/run_policy`` to its result, plus what Ctrl-C on
it does in ros2cli 0.36.1 (the goal is canceled, the CLI exits 1: ros2/ros2cli#956).

They need the ``ros2lifecycle`` / ``ros2action`` wheels of requirements/launch.txt (set-up as
test_launch.py's tooling: without CAPSULE_ROS_LAUNCH_WHEELS this module skips and says
how; with it, a missing install is an error). A cold ``ros2`` call (no CLI daemon yet)
listens for the graph for 0.5 s only and can miss the node on a busy machine, so every
discovery call here passes ``--spin-time`` (as README.md advises), and the daemon the
first call spawns is stopped at the end.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
from harness import ClientNode, ctrl_c, require_launch_tooling, start_executable, start_policy_node, wait_for

require_launch_tooling("ros2lifecycle", "ros2action")    # skips with how to install them; an error where CI asked

pytestmark = pytest.mark.ros
NODE = "/capsule_policy"                 # the names README shows: the default node, no namespace
SPIN = ["--spin-time", "5"]              # discovery without a warm daemon (module docstring)
FIND = ["--timeout", "30"]               # ros2 param: a warm daemon may see a new node late (the second node)
START_TIMEOUT_S = 90.0


def ros2(*args: str, timeout: float = 120.0, home=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **({"HOME": str(home)} if home else {}))
    return subprocess.run([shutil.which("ros2") or "ros2", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture
def managed(tmp_path, rclpy_context):
    """policy_node unconfigured (``autostart:=false``) and the simulated arm, as README's
    ``ros2 launch capsule_ros policy.launch.py use_sim:=true autostart:=false`` starts them."""
    from capsule_ros.ros.client import LifecycleClient
    node = start_policy_node(tmp_path, {"policy": {"weights": ""}, "lifecycle": {"autostart": False},
                                        "control": {"deadline_ms": 5000.0}}, tag="cli")
    sim = start_executable("sim_node", [], tmp_path / "sim.log")
    client = ClientNode(rclpy_context, "cli_test_client")
    lifecycle = LifecycleClient(client.node, NODE, server_wait_s=START_TIMEOUT_S)
    try:
        assert lifecycle.state() == "unconfigured"             # up and waiting (the services answer)
        yield client, tmp_path
    finally:
        lifecycle.destroy()
        client.close()
        ros2("daemon", "stop", home=tmp_path)
        assert sim.stop() == 0, sim.log()
        assert node.stop() == 0, node.log()


def test_ros2_lifecycle_and_ros2_action_as_the_readme_shows(managed):
    client, home = managed
    nodes = ros2("lifecycle", "nodes", *SPIN, home=home)
    assert nodes.returncode == 0 and NODE in nodes.stdout.split(), nodes.stdout + nodes.stderr
    state = ros2("lifecycle", "get", NODE, *SPIN, home=home)
    assert state.stdout.strip() == "unconfigured [1]", state.stdout + state.stderr
    for transition, expected in (("configure", "inactive [2]"), ("activate", "active [3]")):
        done = ros2("lifecycle", "set", NODE, transition, *SPIN, home=home)
        assert done.returncode == 0 and "Transitioning successful" in done.stdout, done.stdout + done.stderr
        assert ros2("lifecycle", "get", NODE, *SPIN, home=home).stdout.strip() == expected

    goal = ros2("action", "send_goal", "--feedback", f"{NODE}/run_policy", "capsule_ros/action/RunPolicy",
                "{max_steps: 30, reset: true}", home=home)
    out = goal.stdout
    assert goal.returncode == 0, out + goal.stderr
    assert "Goal accepted" in out and out.count("Feedback:") >= 1 and "Result:" in out
    assert "message: ran 30 step(s)" in out and "steps: 30" in out
    assert out.rstrip().endswith("Goal finished with status: SUCCEEDED"), out[-2000:]

    done = ros2("lifecycle", "set", NODE, "deactivate", *SPIN, home=home)
    assert done.returncode == 0 and "Transitioning successful" in done.stdout, done.stdout + done.stderr
    assert ros2("lifecycle", "get", NODE, *SPIN, home=home).stdout.strip() == "inactive [2]"
    refused = ros2("action", "send_goal", f"{NODE}/run_policy", "capsule_ros/action/RunPolicy", "{max_steps: 5}",
                   home=home)
    assert "Goal finished with status: ABORTED" in refused.stdout and "not active" in refused.stdout, refused.stdout


def test_ctrl_c_on_send_goal_cancels_the_goal_although_the_cli_exits_1(managed):
    """ros2cli 0.36.1: the cancel reaches the node (it interrupts at a boundary and commits
    the boundary capsule), then the CLI cannot wait for the cancel's answer and exits 1
    (ros2/ros2cli#956, fixed after 0.36.1). Check the cancel on the node's side."""
    from capsule_ros.msg import CapsuleEvent
    from capsule_ros.serving.records import EventKind
    client, home = managed
    for transition in ("configure", "activate"):
        assert ros2("lifecycle", "set", NODE, transition, *SPIN, home=home).returncode == 0
    events = client.subscribe(CapsuleEvent, f"{NODE}/capsule_events", 100)
    log = home / "send_goal.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([shutil.which("ros2") or "ros2", "action", "send_goal", "--feedback",
                                 f"{NODE}/run_policy", "capsule_ros/action/RunPolicy", "{max_steps: 0, reset: true}"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, HOME=str(home)))
    try:
        wait_for(lambda: log.read_text(errors="replace").count("Feedback:") >= 3, timeout=60,
                 what="feedback of the running goal")
        rc = ctrl_c(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text(errors="replace")
    assert "Canceling goal..." in output, output[-2000:]
    assert rc == 1, f"ros2cli#956 fixed? exit {rc}: update README.md and docs/behavior-trees.md\n{output[-2000:]}"
    deadline = time.monotonic() + 10
    interrupts = []
    while not interrupts and time.monotonic() < deadline:
        interrupts = [e for e in ClientNode.drain(events) if e.kind == EventKind.INTERRUPT and e.capsule_id]
        time.sleep(0.05)
    assert interrupts, "the cancel did not interrupt the run with a boundary capsule"


def test_ros2_param_dump_writes_every_parameter_and_a_node_launched_from_it_dumps_the_same(tmp_path,
                                                                                          rclpy_context):
    """`ros2 param dump` of the node wrote `ros__parameters: {}` (four parameters had no
    value) and `ros2 param get … policy.prefix` said "Parameter not set". Now the dump is
    complete and `ros2 launch … params_file:=` of it starts a node with the same parameters."""
    import yaml

    from capsule_ros.ros.client import LifecycleClient
    from capsule_ros.ros.processes import ManagedProcess
    client = ClientNode(rclpy_context, "dump_test_client")
    lifecycle = LifecycleClient(client.node, NODE, server_wait_s=START_TIMEOUT_S)
    first = start_policy_node(tmp_path, {"policy": {"weights": ""}, "lifecycle": {"autostart": False}}, tag="dump")
    launched = None
    try:
        assert lifecycle.state() == "unconfigured"
        dump = ros2("param", "dump", NODE, *SPIN, *FIND, home=tmp_path)
        assert dump.returncode == 0 and "{}" not in dump.stdout, dump.stdout + dump.stderr
        params = yaml.safe_load(dump.stdout)[NODE]["ros__parameters"]
        assert params["policy"]["prefix"] == [] and params["outputs"]["names"] == []
        assert params["ports"]["names"] == ["joints", "goal"] and params["ports"]["joints"]["names"] == []
        prefix = ros2("param", "get", NODE, "policy.prefix", *SPIN, *FIND, home=tmp_path)
        assert prefix.returncode == 0 and "not set" not in prefix.stdout, prefix.stdout + prefix.stderr
        dumped = tmp_path / "dumped.yaml"
        dumped.write_text(dump.stdout)
        assert first.stop() == 0, first.log()

        launched = ManagedProcess([shutil.which("ros2") or "ros2", "launch", "capsule_ros", "policy.launch.py",
                                   f"params_file:={dumped}"], tmp_path / "launch.log",
                                  env=dict(os.environ, HOME=str(tmp_path)))
        assert lifecycle.state() == "unconfigured", launched.log()       # lifecycle.autostart: false, as dumped
        again = ros2("param", "dump", NODE, *SPIN, *FIND, home=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        assert yaml.safe_load(again.stdout) == yaml.safe_load(dump.stdout)
    finally:
        lifecycle.destroy()
        client.close()
        ros2("daemon", "stop", home=tmp_path)
        assert first.stop() == 0, first.log()
        if launched is not None:
            assert launched.stop(timeout=30) == 0, launched.log()
