"""capsule_ros: serve a PyTorch robot policy from ROS 2 with execution-state capsules.

Layers, each importable on its own (only ``capsule_ros.ros`` and the generated
``capsule_ros.msg`` / ``capsule_ros.srv`` need ROS):

- ``capsule_ros.runtime``: state arena, policy protocol, graph plan, reference policies.
- ``capsule_ros.capsules``: capsule store (snapshot, restore, fork, tiers), fingerprint,
  on-disk format.
- ``capsule_ros.serving``: the episode session (state machine, boundary-applied
  requests, input log, recompute fallback): what the node does, without ROS.
- ``capsule_ros.ros``: the ROS 2 node, a thin layer over ``serving``.
- ``capsule_ros.bag``: rosbag2 record and step-by-step replay.
"""
import pkgutil

# The installed package is the source tree merged with the modules rosidl generates
# (msg/, srv/). When the source tree shadows it on sys.path (python run from the
# repository root), extend __path__ so `capsule_ros.msg` / `capsule_ros.srv` still resolve.
__path__ = pkgutil.extend_path(__path__, __name__)

from capsule_ros._meta import version as _version  # noqa: E402

__version__ = _version()
