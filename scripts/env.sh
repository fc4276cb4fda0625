# Source this file (bash) to use the package built by ./setup.sh:
#   . scripts/env.sh
# Same as `. install/setup.bash` (which also activates .venv, the ROS 2 underlay), plus
# DDS discovery kept on this machine unless you chose otherwise, and the executables on PATH.
_capsule_ros_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
# shellcheck disable=SC1091
. "$_capsule_ros_root/install/setup.bash"
export PATH="$_capsule_ros_root/install/capsule_ros/lib/capsule_ros:$PATH"
unset _capsule_ros_root
