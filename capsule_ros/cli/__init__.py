"""`capsule-ros`: the command line (demo, replay, record, inspect, export, check, regenerate,
bench); ``main`` dispatches, ``command.COMMANDS`` holds each command's exit statuses."""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {"main": "capsule_ros.cli.main"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
