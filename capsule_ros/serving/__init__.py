"""The serving session (no ROS): everything the node does, ``PolicySession`` and its parts
(the control loop, the episode state machine), with its configuration (``ServingConfig``),
the options its owner gives it (``SessionOptions``) and the factory that builds it from a
config."""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "PolicySession": "capsule_ros.serving.session",
    "SessionOptions": "capsule_ros.serving.options",
    "ServingConfig": "capsule_ros.serving.config",
    "ControlConfig": "capsule_ros.serving.config",
    "PortConfig": "capsule_ros.serving.config",
    "PolicyConfig": "capsule_ros.serving.config",
    "RecordConfig": "capsule_ros.serving.config",
    "build_session": "capsule_ros.serving.factory",
    "build_runtime": "capsule_ros.serving.factory",
    "build_policy": "capsule_ros.serving.factory",
    "EpisodeState": "capsule_ros.serving.records",
    "HoldMode": "capsule_ros.serving.records",
    "ActionSource": "capsule_ros.serving.records",
    "EventKind": "capsule_ros.serving.records",
    "StepFault": "capsule_ros.serving.records",
    "ActionRecord": "capsule_ros.serving.records",
    "EventRecord": "capsule_ros.serving.records",
    "ReenterResult": "capsule_ros.serving.records",
    "SessionStatus": "capsule_ros.serving.records",
    "EpisodePicture": "capsule_ros.serving.records",
    "SaveFailed": "capsule_ros.serving.files",
    "PortDrop": "capsule_ros.serving.ports",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
