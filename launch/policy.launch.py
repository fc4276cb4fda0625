"""Start capsule_ros's policy_node with config/policy.yaml (and optionally the simulated arm).

    ros2 launch capsule_ros policy.launch.py
    ros2 launch capsule_ros policy.launch.py use_sim:=true device:=cuda namespace:=robot1
    ros2 launch capsule_ros policy.launch.py params_file:=/path/to/my_policy.yaml
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare


def generate_launch_description() -> LaunchDescription:
    params_file = LaunchConfiguration("params_file")
    namespace = LaunchConfiguration("namespace")
    return LaunchDescription([
        DeclareLaunchArgument(
            "params_file", description="ROS 2 parameter file of the policy node",
            default_value=PathJoinSubstitution([FindPackageShare("capsule_ros"), "config", "policy.yaml"])),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of both nodes"),
        DeclareLaunchArgument("device", default_value="auto", description="cpu, cuda, cuda:N or auto"),
        DeclareLaunchArgument("use_sim", default_value="false", description="also start the simulated arm"),
        DeclareLaunchArgument("log_level", default_value="info", description="ROS log level"),
        Node(
            package="capsule_ros", executable="policy_node", name="capsule_policy", namespace=namespace,
            parameters=[params_file, {"runtime.device": LaunchConfiguration("device")}],
            arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
            output="screen", emulate_tty=True),
        Node(
            package="capsule_ros", executable="sim_node", name="arm_sim", namespace=namespace,
            condition=IfCondition(LaunchConfiguration("use_sim")),
            arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
            output="screen", emulate_tty=True),
    ])
