"""launch/policy.launch.py through launch_pytest, on a real ROS 2 install.

The PyPI wheels this project's CI uses have no `launch` / `launch_ros` / `launch_pytest`
(see docs/install.md), so there this module skips with that reason; the same behaviour
(policy_node with config/policy.yaml under a namespace, serving its services) is covered
by test_foundation.py and test_node.py, which start the installed executable directly.
"""
import pytest

launch_pytest = pytest.importorskip(
    "launch_pytest", reason="launch_pytest is not installed (PyPI ROS wheels have no launch); "
                            "the launch file's behaviour is covered by test_foundation.py")

import launch  # noqa: E402
from launch.actions import IncludeLaunchDescription  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402

from harness import REPO  # noqa: E402


@launch_pytest.fixture
def policy_launch():
    return launch.LaunchDescription([
        IncludeLaunchDescription(PythonLaunchDescriptionSource(str(REPO / "launch" / "policy.launch.py")),
                                 launch_arguments={"namespace": "launched", "device": "cpu"}.items()),
        launch_pytest.actions.ReadyToTest(),
    ])


@pytest.mark.launch(fixture=policy_launch)
def test_launch_starts_policy_node_with_its_services(rclpy_context):
    from harness import ClientNode, wait_for
    client = ClientNode(rclpy_context, "launch_test_client", node_path="/launched/capsule_policy")
    try:
        wait_for(lambda: any(n == "/launched/capsule_policy/commit"
                             for n, _ in client.node.get_service_names_and_types()), timeout=60,
                 what="/launched/capsule_policy/commit")
        assert client.capsules.commit(label="launch").success
    finally:
        client.close()
