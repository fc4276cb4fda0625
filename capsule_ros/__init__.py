"""capsule_ros: serve a PyTorch robot policy from ROS 2 with execution-state capsules.

Layers, lowest first, each importable on its own (only ``capsule_ros.ros`` and above, and
the generated ``capsule_ros.msg`` / ``capsule_ros.srv`` / ``capsule_ros.action``, need ROS;
docs/architecture.md has the map):

- ``capsule_ros.runtime``: the core: the state arena, the policy protocol, the execution
  mode protocol (every step by default), the programs captured as CUDA graphs, the runtime
  with its step guard and its builder, the fingerprint, safetensors weights.
- ``capsule_ros.chunking``: the chunking mode above the core: a chunking policy's network
  only when a chunk is due, its schedule, refill workers and capsule mark.
- ``capsule_ros.policies``: the policy kinds: the reference hybrid policy and the shipped
  default weights, exported ``torch.export`` programs, LeRobot ACT / Diffusion, and ONNX
  models run by ONNX Runtime (``onnx``: Isaac Lab / rsl_rl and sb3-contrib exports).
- ``capsule_ros.capsules``: the capsule store (snapshot, restore, fork, drop, move between
  tiers), the on-disk format and the capsule directory.
- ``capsule_ros.serving``: the episode session (state machine, the verb table, its step
  boundary, input log, recompute fallback): what the node does, without ROS.
- ``capsule_ros.bag``: rosbag2 record and step-by-step replay.
- ``capsule_ros.ros``: the ROS 2 node, a thin layer over ``serving``; ``capsule_ros.bt``:
  py_trees leaves; ``capsule_ros.cli``: the ``capsule-ros`` command.
"""
import pkgutil

# The installed package is the source tree merged with the modules rosidl generates
# (msg/, srv/). When the source tree shadows it on sys.path (python run from the
# repository root), extend __path__ so `capsule_ros.msg` / `capsule_ros.srv` still resolve.
__path__ = pkgutil.extend_path(__path__, __name__)

from capsule_ros._meta import version as _version

__version__ = _version()
