"""Start capsule_ros's fleet_node with config/fleet.yaml (and optionally a simulated arm per robot).

    ros2 launch capsule_ros fleet.launch.py
    ros2 launch capsule_ros fleet.launch.py use_sim:=true device:=cuda namespace:=cell1
    ros2 launch capsule_ros fleet.launch.py params_file:=/path/to/my_fleet.yaml
    ros2 launch capsule_ros fleet.launch.py autostart:=false     # unconfigured, for a lifecycle manager

Each robot of ``fleet.robots`` (read from ``params_file``) is a namespace under
``namespace``: ``/<namespace>/<robot>/capsule_policy/...`` is its interface (policy_node's),
and with ``use_sim:=true`` a ``sim_node`` runs in that namespace for each robot, its own
process. ``device`` and ``autostart`` override ``runtime.device`` and ``lifecycle.autostart``
only when given, as in policy.launch.py; with ``autostart:=false``, ``ros2 lifecycle set
/capsule_fleet configure`` then ``activate`` starts every robot.
"""
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

from launch import LaunchDescription


def fleet_robots(params_file: str) -> list:
    """``fleet.robots`` of the fleet node in ``params_file`` (the file's ``/**`` and
    ``capsule_fleet`` entries, as the node reads them)."""
    from capsule_ros.config import load_params_file
    params = load_params_file(params_file, node_name="capsule_fleet")
    return [str(robot) for robot in params.get("fleet", {}).get("robots", ["robot1"])]


def fleet_nodes(context):
    """The fleet node (``runtime.device`` / ``lifecycle.autostart`` overridden only when
    ``device`` / ``autostart`` are non-empty), and with ``use_sim`` a simulated arm per robot."""
    device = LaunchConfiguration("device").perform(context).strip()
    autostart = LaunchConfiguration("autostart").perform(context).strip().lower()
    if autostart not in ("", "true", "false"):
        raise ValueError(f"autostart:={autostart}: must be true or false")
    use_sim = LaunchConfiguration("use_sim").perform(context).strip().lower()
    if use_sim not in ("true", "false"):
        raise ValueError(f"use_sim:={use_sim}: must be true or false")
    params_file = LaunchConfiguration("params_file").perform(context)
    namespace = LaunchConfiguration("namespace").perform(context).strip().strip("/")
    log_level = ["--ros-args", "--log-level", LaunchConfiguration("log_level")]
    overrides = [{"runtime.device": device}] if device else []
    overrides += [{"lifecycle.autostart": autostart == "true"}] if autostart else []
    nodes = [Node(package="capsule_ros", executable="fleet_node", name="capsule_fleet", namespace=namespace,
                  parameters=[params_file, *overrides], arguments=log_level, output="screen", emulate_tty=True)]
    if use_sim == "true":
        nodes += [Node(package="capsule_ros", executable="sim_node", name="arm_sim",
                       namespace=f"{namespace}/{robot}".strip("/"), parameters=[{"seed": index}],
                       arguments=log_level, output="screen", emulate_tty=True)
                  for index, robot in enumerate(fleet_robots(params_file))]
    return nodes


def generate_launch_description() -> LaunchDescription:
    return LaunchDescription([
        DeclareLaunchArgument(
            "params_file", description="ROS 2 parameter file of the fleet node",
            default_value=PathJoinSubstitution([FindPackageShare("capsule_ros"), "config", "fleet.yaml"])),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the fleet and its robots"),
        DeclareLaunchArgument("device", default_value="",
                              description="cpu, cuda, cuda:N or auto: overrides runtime.device of params_file; "
                                          "empty (the default): the file's runtime.device"),
        DeclareLaunchArgument("autostart", default_value="",
                              description="true: configure and activate at start; false: wait unconfigured for "
                                          "~/change_state; empty (the default): the file's lifecycle.autostart"),
        DeclareLaunchArgument("use_sim", default_value="false",
                              description="also start a simulated arm (sim_node) per robot, each its own process"),
        DeclareLaunchArgument("log_level", default_value="info", description="ROS log level"),
        OpaqueFunction(function=fleet_nodes),
    ])
