"""Start capsule_ros's policy_node with config/policy.yaml (and optionally the simulated arm).

    ros2 launch capsule_ros policy.launch.py
    ros2 launch capsule_ros policy.launch.py use_sim:=true device:=cuda namespace:=robot1
    ros2 launch capsule_ros policy.launch.py params_file:=/path/to/my_policy.yaml

``device`` is passed to the node only when given: by default ``runtime.device`` comes
from the parameter file (``auto`` in config/policy.yaml), so a user file's choice holds.
"""
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

from launch import LaunchDescription


def policy_node(context):
    """The policy node, with ``runtime.device`` overridden only when ``device`` is non-empty."""
    device = LaunchConfiguration("device").perform(context).strip()
    overrides = [{"runtime.device": device}] if device else []
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
        DeclareLaunchArgument("use_sim", default_value="false", description="also start the simulated arm"),
        DeclareLaunchArgument("log_level", default_value="info", description="ROS log level"),
        OpaqueFunction(function=policy_node),
        Node(
            package="capsule_ros", executable="sim_node", name="arm_sim", namespace=LaunchConfiguration("namespace"),
            condition=IfCondition(LaunchConfiguration("use_sim")),
            arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
            output="screen", emulate_tty=True),
    ])
