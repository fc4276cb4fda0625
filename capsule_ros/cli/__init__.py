"""`capsule-ros`: the command line (demo, replay, record, inspect, bench); ``main`` dispatches."""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {"main": "capsule_ros.cli.main"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
