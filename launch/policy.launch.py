"""Start capsule_ros's policy_node with config/policy.yaml (and optionally the simulated arm).

    ros2 launch capsule_ros policy.launch.py
    ros2 launch capsule_ros policy.launch.py use_sim:=true device:=cuda namespace:=robot1
    ros2 launch capsule_ros policy.launch.py params_file:=/path/to/my_policy.yaml
    ros2 launch capsule_ros policy.launch.py autostart:=false     # unconfigured, for a lifecycle manager

``device`` and ``autostart`` are passed to the node only when given: by default
``runtime.device`` and ``lifecycle.autostart`` come from the parameter file (``auto`` and
true in config/policy.yaml), so a user file's choice holds. With ``autostart:=false`` the
node waits unconfigured: ``ros2 lifecycle set /capsule_policy configure`` then
``activate`` (or a lifecycle manager) starts it.
"""
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

from launch import LaunchDescription


def policy_node(context):
    """The policy node, with ``runtime.device`` / ``lifecycle.autostart`` overridden only when
    ``device`` / ``autostart`` are non-empty."""
    device = LaunchConfiguration("device").perform(context).strip()
    autostart = LaunchConfiguration("autostart").perform(context).strip().lower()
    if autostart not in ("", "true", "false"):
        raise ValueError(f"autostart:={autostart}: must be true or false")
    overrides = [{"runtime.device": device}] if device else []
    overrides += [{"lifecycle.autostart": autostart == "true"}] if autostart else []
    return [Node(
        package="capsule_ros", executable="policy_node", name="capsule_policy",
        namespace=LaunchConfiguration("namespace"),
        parameters=[LaunchConfiguration("params_file"), *overrides],
        arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
        output="screen", emulate_tty=True)]


def generate_launch_description() -> LaunchDescription:
    return LaunchDescription([
        DeclareLaunchArgument(
            "params_file", description="ROS 2 parameter file of the policy node",
            default_value=PathJoinSubstitution([FindPackageShare("capsule_ros"), "config", "policy.yaml"])),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of both nodes"),
        DeclareLaunchArgument("device", default_value="",
                              description="cpu, cuda, cuda:N or auto: overrides runtime.device of params_file; "
                                          "empty (the default): the file's runtime.device"),
        DeclareLaunchArgument("autostart", default_value="",
                              description="true: configure and activate at start; false: wait unconfigured for "
                                          "~/change_state; empty (the default): the file's lifecycle.autostart"),
        DeclareLaunchArgument("use_sim", default_value="false", description="also start the simulated arm"),
        DeclareLaunchArgument("log_level", default_value="info", description="ROS log level"),
        OpaqueFunction(function=policy_node),
        Node(
            package="capsule_ros", executable="sim_node", name="arm_sim", namespace=LaunchConfiguration("namespace"),
            condition=IfCondition(LaunchConfiguration("use_sim")),
            arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
            output="screen", emulate_tty=True),
    ])
