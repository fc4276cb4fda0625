"""The ROS 2 layer: the node, its parameters, status, client, simulated arm (needs rclpy)."""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "PolicyNode": "capsule_ros.ros.node",
    "CapsuleClient": "capsule_ros.ros.client",
    "ServiceError": "capsule_ros.ros.client",
    "ServiceRefused": "capsule_ros.ros.client",
    "ServiceTimeout": "capsule_ros.ros.client",
    "ServiceUnavailable": "capsule_ros.ros.client",
    "ArmSimNode": "capsule_ros.ros.sim_node",
    "run_node": "capsule_ros.ros.entry",
    "SpinThread": "capsule_ros.ros.spinning",
    "SpunNode": "capsule_ros.ros.spinning",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
