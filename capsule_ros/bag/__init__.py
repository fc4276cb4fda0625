"""Rosbag2 record and step-by-step replay, through ``rosbags`` (no ROS needed to read).

- ``recorder``: ``NodeRecorder`` (behind the node's ``~/record`` service and ``record.*``
  parameters): sensor ports as received, ``~/action``, ``~/capsule_events``; ``metadata``:
  what a replay needs to rebuild the policy, in the bag's ``custom_data``.
- ``reader``: open a bag, refuse bad ones (``errors.BadBag``), pre-scan, stream;
  ``typestore``: message types (ours from ``msg/`` or from the bag itself).
- ``schedule``: where each recorded capsule event took effect between steps.
- ``targets`` / ``replay`` / ``verdict``: drive a ``PolicySession`` from the bag and compare
  every action bit for bit (``capsule-ros replay``; the policy_node target, which needs
  ROS, is ``capsule_ros.ros.replay_target``); ``ablation``: re-entries restoring only some
  buffer kinds.
- ``edit``: copy a bag, editing messages or converting its storage.

docs/rosbag-replay.md is the user's guide.
"""

from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "Recording": "capsule_ros.bag.reader",
    "BagScan": "capsule_ros.bag.reader",
    "replay_bag": "capsule_ros.bag.replay",
    "ReplayOptions": "capsule_ros.bag.replay",
    "Verdict": "capsule_ros.bag.verdict",
    "NodeRecorder": "capsule_ros.bag.recorder",
    "write_bag": "capsule_ros.bag.recorder",
    "rewrite_bag": "capsule_ros.bag.edit",
    "BagError": "capsule_ros.bag.errors",
    "InProcessTarget": "capsule_ros.bag.targets",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
