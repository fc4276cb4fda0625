"""The built-in simulated robot: a planar two-link arm reaching goals (numpy)."""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "ArmSim": "capsule_ros.sim.arm",
    "Observation": "capsule_ros.sim.arm",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
