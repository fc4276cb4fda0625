"""Many robots, one policy, one GPU (no ROS): a fleet of robots served from the batch slots
of one runtime (``capsule_ros.runtime.fleet``), each robot with ``policy_node``'s session
faces over its slot, one capsule store shared by all (docs/fleet.md).

``build_fleet`` (or ``prepare_fleet`` then ``start_fleet``, a node's configure and
activate) makes a ``FleetSession``: ``robot(name)`` is a ``RobotSession`` (``verbs``,
``status()``, ``episode``, ``session``: its ``PolicySession``; ``loop``: feed and tick
through the fleet); ``tick`` / ``tick_timer`` / ``poll`` step the fleet.
"""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "FleetConfig": "capsule_ros.fleet.config",
    "FleetRobot": "capsule_ros.fleet.config",
    "FleetSession": "capsule_ros.fleet.session",
    "FleetStatus": "capsule_ros.fleet.session",
    "RobotSession": "capsule_ros.fleet.robot",
    "RobotLoop": "capsule_ros.fleet.robot",
    "TickGather": "capsule_ros.fleet.gather",
    "PreparedFleet": "capsule_ros.fleet.factory",
    "prepare_fleet": "capsule_ros.fleet.factory",
    "start_fleet": "capsule_ros.fleet.factory",
    "build_fleet": "capsule_ros.fleet.factory",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
