"""launch/policy.launch.py for real: launch_pytest tests of its arguments, and Ctrl-C on
`ros2 launch` the way a terminal sends it.

These need the ROS 2 launch tooling (launch, launch_ros, launch_pytest, the ros2 CLI), which
the package index does not have: ./setup.sh installs it when CAPSULE_ROS_LAUNCH_WHEELS names
a directory of its wheels (CI's .ci/run does). Without it this module skips with that
reason; when the variable is set, a missing install is an error, not a skip.

Every launched process inherits the test session's ROS_DOMAIN_ID (conftest.py) and gets
HOME set to the test's directory, so capsules and logs stay there; every launch must end
with each node exiting 0.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict

import pytest
import yaml
from harness import DEFAULT_PARAMS, ClientNode, ctrl_c, require_launch_tooling, wait_for

require_launch_tooling("launch_pytest")    # skips with how to install it; an error where CI asked for it

import launch_pytest  # noqa: E402
import psutil  # noqa: E402
from launch.actions import IncludeLaunchDescription, RegisterEventHandler, SetEnvironmentVariable  # noqa: E402
from launch.event_handlers import OnProcessExit, OnProcessStart  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
from launch.substitutions import PathJoinSubstitution  # noqa: E402
from launch_ros.substitutions import FindPackageShare  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402

from launch import LaunchDescription  # noqa: E402

pytestmark = pytest.mark.ros
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
INSTALLED_LAUNCH_FILE = PathJoinSubstitution([FindPackageShare("capsule_ros"), "launch", "policy.launch.py"])
START_TIMEOUT_S = 90.0           # torch import and graph set-up on a busy 2-core machine
BAD_OUTPUT = ("Traceback", "RCLError", "KeyboardInterrupt", "process has died")


class Launched:
    """What the launch did: pid and exit code of each executable (policy_node, sim_node)."""

    def __init__(self) -> None:
        self.pids: Dict[str, int] = {}
        self.exit_codes: Dict[str, int] = {}

    def on_start(self, event, _context):
        self.pids[Path(event.cmd[0]).name] = event.pid

    def on_exit(self, event, _context):
        self.exit_codes[Path(event.cmd[0]).name] = event.returncode


def policy_launch(tmp_path: Path, **arguments: str):
    """The installed policy.launch.py with ``arguments``, as `ros2 launch` would include it."""
    launched = Launched()
    description = LaunchDescription([
        SetEnvironmentVariable("HOME", str(tmp_path)),
        RegisterEventHandler(OnProcessStart(on_start=launched.on_start)),
        RegisterEventHandler(OnProcessExit(on_exit=launched.on_exit)),
        IncludeLaunchDescription(PythonLaunchDescriptionSource(INSTALLED_LAUNCH_FILE),
                                 launch_arguments=arguments.items()),
        launch_pytest.actions.ReadyToTest(),
    ])
    return description, launched


def assert_in_test_domain(launched: Launched) -> None:
    for name, pid in launched.pids.items():
        env = psutil.Process(pid).environ()
        assert env.get("ROS_DOMAIN_ID") == os.environ["ROS_DOMAIN_ID"], name
        assert env.get("ROS_AUTOMATIC_DISCOVERY_RANGE") == "LOCALHOST", name


def get_parameters(client: ClientNode, node_path: str, *names: str) -> list:
    from rcl_interfaces.srv import GetParameters
    from rclpy.parameter import parameter_value_to_python
    service = client.node.create_client(GetParameters, f"{node_path}/get_parameters")
    try:
        assert service.wait_for_service(timeout_sec=30.0), f"{node_path}/get_parameters"
        future = service.call_async(GetParameters.Request(names=list(names)))
        wait_for(future.done, timeout=10.0, what="get_parameters")
        return [parameter_value_to_python(v) for v in future.result().values]
    finally:
        client.node.destroy_client(service)


def wait_for_commit(client: ClientNode, label: str):
    """The node's ~/commit answers (waits for the node to come up)."""
    response = client.capsules.commit(label=label, server_wait_s=START_TIMEOUT_S)
    assert response.success and response.capsule.label == label
    return response


def wait_for_actions(client: ClientNode, topic: str, count: int):
    from capsule_ros.msg import Action
    actions = client.subscribe(Action, topic, RELIABLE)
    wait_for(lambda: actions.qsize() >= count, timeout=START_TIMEOUT_S, what=f"{count} actions on {topic}")
    return ClientNode.drain(actions)


# -- the default ----------------------------------------------------------------------------------
@launch_pytest.fixture
def default_launch(tmp_path):
    return policy_launch(tmp_path)


@pytest.mark.launch(fixture=default_launch)
def test_default_launch_serves_the_policy_node_alone(default_launch, rclpy_context):
    _, launched = default_launch
    client = ClientNode(rclpy_context, "launch_default_client", node_path="/capsule_policy")
    try:
        wait_for_commit(client, "launched")
        assert "launched" in [c.label for c in client.capsules.list().capsules]
        assert sorted(launched.pids) == ["policy_node"]                    # use_sim defaults to false
        names = {(ns, n) for n, ns in client.node.get_node_names_and_namespaces()}
        assert ("/", "capsule_policy") in names and ("/", "arm_sim") not in names
        assert get_parameters(client, "/capsule_policy", "runtime.device") == ["auto"]   # config/policy.yaml's
        assert_in_test_domain(launched)
    finally:
        client.close()
    yield
    assert launched.exit_codes == {"policy_node": 0}


# -- use_sim:=true --------------------------------------------------------------------------------
@launch_pytest.fixture
def sim_launch(tmp_path):
    return policy_launch(tmp_path, use_sim="true")


@pytest.mark.launch(fixture=sim_launch)
def test_use_sim_streams_actions_in_lockstep_with_the_simulated_arm(sim_launch, rclpy_context):
    from sensor_msgs.msg import JointState
    _, launched = sim_launch
    client = ClientNode(rclpy_context, "launch_sim_client")
    try:
        joints = client.subscribe(JointState, "/arm/joint_states", RELIABLE)
        actions = wait_for_actions(client, "/capsule_policy/action", 50)
        steps = [a.step for a in actions]
        assert steps == list(range(steps[0], steps[0] + len(steps)))         # one step per arm state
        assert all(len(a.values) == 2 and len(a.chunk) > 0 for a in actions)  # the policy's own actions
        states = ClientNode.drain(joints)
        assert len(states) >= len(actions) - 2 and states[-1].name == ["shoulder", "elbow"]
        assert sorted(launched.pids) == ["policy_node", "sim_node"]
        assert_in_test_domain(launched)
    finally:
        client.close()
    yield
    assert launched.exit_codes == {"policy_node": 0, "sim_node": 0}


# -- namespace:=robot1 ----------------------------------------------------------------------------
@launch_pytest.fixture
def namespaced_launch(tmp_path):
    return policy_launch(tmp_path, namespace="robot1", use_sim="true")


@pytest.mark.launch(fixture=namespaced_launch)
def test_namespace_puts_services_and_topics_under_it(namespaced_launch, rclpy_context):
    _, launched = namespaced_launch
    client = ClientNode(rclpy_context, "launch_ns_client", node_path="/robot1/capsule_policy")
    try:
        wait_for_commit(client, "robot1")
        wait_for_actions(client, "/robot1/capsule_policy/action", 20)
        graph = client.node
        nodes = set(graph.get_node_names_and_namespaces())
        assert {("capsule_policy", "/robot1"), ("arm_sim", "/robot1")} <= nodes, nodes
        # each launched node's own names (other tests' nodes on this ROS domain cannot blur this)
        names = set()
        for name in ("capsule_policy", "arm_sim"):
            for query in (graph.get_service_names_and_types_by_node, graph.get_publisher_names_and_types_by_node,
                          graph.get_subscriber_names_and_types_by_node):
                names |= {topic for topic, _ in query(name, "/robot1")}
        assert {"/robot1/capsule_policy/commit", "/robot1/capsule_policy/reenter", "/robot1/arm_sim/reset",
                "/robot1/capsule_policy/action", "/robot1/capsule_policy/status", "/robot1/arm/joint_states",
                "/robot1/arm/goal"} <= names, names
        global_by_convention = {"/rosout", "/parameter_events", "/diagnostics"}
        assert all(n.startswith("/robot1/") for n in names - global_by_convention), sorted(names)
    finally:
        client.close()
    yield
    assert launched.exit_codes == {"policy_node": 0, "sim_node": 0}


# -- params_file:= and device:= -------------------------------------------------------------------
def user_params_file(tmp_path: Path, device: str) -> Path:
    """A user's parameter file: config/policy.yaml with its own runtime.device and capsule directory."""
    params = yaml.safe_load(DEFAULT_PARAMS.read_text())
    node = params["/**/capsule_policy"]["ros__parameters"]
    node["runtime"]["device"] = device
    node["capsules"]["directory"] = str(tmp_path / "my-capsules")
    node["control"]["status_rate_hz"] = 10.0
    path = tmp_path / "my_policy.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


@launch_pytest.fixture(params=[{}, {"device": "auto"}], ids=["file-device", "device-argument"])
def params_file_launch(tmp_path, request):
    return (*policy_launch(tmp_path, params_file=str(user_params_file(tmp_path, "cpu")), **request.param),
            request.param)


@pytest.mark.launch(fixture=params_file_launch)
def test_params_file_is_honoured_and_device_overrides_it_only_when_given(params_file_launch, rclpy_context,
                                                                          tmp_path):
    from capsule_ros.msg import RuntimeStatus
    _, launched, arguments = params_file_launch
    expected = arguments.get("device", "cpu")             # the file says cpu; device:=auto overrides it
    client = ClientNode(rclpy_context, "launch_params_client")
    try:
        response = client.capsules.commit(label="mine", persist=True, server_wait_s=START_TIMEOUT_S)
        assert response.success and f"saved to {tmp_path / 'my-capsules'}/" in response.message   # the file's directory
        assert get_parameters(client, "/capsule_policy", "runtime.device", "control.status_rate_hz") \
            == [expected, 10.0]
        status = client.subscribe(RuntimeStatus, "/capsule_policy/status")
        assert status.get(timeout=10.0).device == "cpu"     # auto resolves to cpu here: no GPU on this machine
    finally:
        client.close()
    yield
    assert launched.exit_codes == {"policy_node": 0}


# -- autostart:= ----------------------------------------------------------------------------------
@launch_pytest.fixture
def managed_launch(tmp_path):
    return policy_launch(tmp_path, autostart="false")


@pytest.mark.launch(fixture=managed_launch)
def test_autostart_false_waits_for_the_lifecycle_services(managed_launch, rclpy_context):
    """The node comes up unconfigured; `ros2 service call .../change_state` (what `ros2
    lifecycle set` calls) configures and activates it."""
    from capsule_ros.ros.client import LifecycleClient
    _, launched = managed_launch
    client = ClientNode(rclpy_context, "launch_managed_client")
    lifecycle = LifecycleClient(client.node, "/capsule_policy", server_wait_s=START_TIMEOUT_S)
    try:
        assert lifecycle.state() == "unconfigured"
        assert get_parameters(client, "/capsule_policy", "lifecycle.autostart") == [False]
        for transition in ("configure", "activate"):
            done = subprocess.run(["ros2", "service", "call", "/capsule_policy/change_state",
                                   "lifecycle_msgs/srv/ChangeState", f"{{transition: {{label: {transition}}}}}"],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and "success=True" in done.stdout, done.stdout + done.stderr
        assert lifecycle.state() == "active"
        wait_for_commit(client, "managed")
    finally:
        lifecycle.destroy()
        client.close()
    yield
    assert launched.exit_codes == {"policy_node": 0}


# -- Ctrl-C ---------------------------------------------------------------------------------------
def test_ctrl_c_stops_ros2_launch_and_both_nodes_cleanly(tmp_path, rclpy_context):
    """`ros2 launch ... use_sim:=true` in its own process group, SIGINT to the whole group
    while actions stream: each node gets SIGINT twice (terminal and launch) and must exit 0."""
    log_path = tmp_path / "ros2-launch.log"
    env = dict(os.environ, HOME=str(tmp_path))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["ros2", "launch", "capsule_ros", "policy.launch.py", "use_sim:=true"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    pgid = os.getpgid(proc.pid)
    client = ClientNode(rclpy_context, "launch_ctrl_c_client")
    try:
        wait_for_actions(client, "/capsule_policy/action", 50)               # the arm and the policy run
        nodes = {}
        for child in psutil.Process(proc.pid).children(recursive=True):
            names = [Path(arg).name for arg in child.cmdline()[:2]]
            nodes.update({name: child for name in names if name in ("policy_node", "sim_node")})
        assert sorted(nodes) == ["policy_node", "sim_node"], nodes
        assert all(os.getpgid(p.pid) == pgid for p in nodes.values())       # Ctrl-C reaches them directly too
        assert all(p.environ().get("ROS_DOMAIN_ID") == os.environ["ROS_DOMAIN_ID"] for p in nodes.values())
        started = time.monotonic()
        rc = ctrl_c(proc, log_path)                                          # a terminal's Ctrl-C
        stop_s = time.monotonic() - started
    finally:
        client.close()
        if proc.poll() is None:
            os.killpg(pgid, signal.SIGKILL)
            proc.wait()
    output = log_path.read_text(errors="replace")
    assert rc == 0, output
    assert "user interrupted with ctrl-c (SIGINT)" in output, output                   # launch got it too
    assert "[policy_node-1]: process has finished cleanly" in output, output
    assert "[sim_node-2]: process has finished cleanly" in output, output
    for bad in BAD_OUTPUT:
        assert bad not in output, output
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in nodes.values())
    assert stop_s < 10.0, f"stopping took {stop_s:.1f} s (launch escalates to SIGTERM after 5 s)"
