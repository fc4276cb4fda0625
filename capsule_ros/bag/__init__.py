"""Rosbag2 record and step-by-step replay, through ``rosbags`` (no ROS needed to read).

- ``recorder``: ``NodeRecorder`` (behind the node's ``~/record`` service and ``record.*``
  parameters): sensor ports as received, ``~/action``, ``~/capsule_events``; ``metadata``:
  what a replay needs to rebuild the policy, in the bag's ``custom_data``.
- ``reader``: open a bag, refuse bad ones (``errors.BadBag``), pre-scan, stream;
  ``typestore``: message types (ours from ``msg/`` or from the bag itself).
- ``timeline``: where each recorded capsule event took effect between steps.
- ``targets`` / ``replay`` / ``verdict``: drive a ``PolicySession`` or a ``policy_node``
  from the bag and compare every action bit for bit (``capsule-ros replay``).
- ``record_cmd``: ``capsule-ros record`` (asks a running node to record).
- ``edit``: copy a bag, editing messages or converting its storage.

docs/rosbag-replay.md is the user's guide.
"""
