"""The port-to-feature map: which node input feeds which checkpoint input feature.

A LeRobot checkpoint names its inputs by feature key (``observation.state``,
``observation.environment_state``, ``observation.images.<camera>``); the node names its
ports. ``feature_map`` maps every checkpoint input key to the INPUT ``BufferSpec`` of the
port that feeds it, and ``bind_features`` checks it against config.json alone, before
anything else is read:

- every checkpoint input feature has a port, and every map entry is a checkpoint input
  feature (a camera is never substituted for another);
- a camera feature ``VISUAL [3, H, W]`` takes a uint8 ``[H, W, 3]`` RGB port of exactly
  that size, or of any size with ``resize_cameras`` (the policy then resizes each frame to
  ``H x W`` on the device, ``common.resize_image``); a ``STATE`` / ``ENV`` feature ``[n]``
  takes a float32 ``[n]`` port;
- ports are distinct and do not use a name the policy keeps for itself.

Each error is a ``ConfigError`` naming the feature key and what to change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Dict, List, Mapping, Tuple

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import Checkpoint
from capsule_ros.runtime.arena import BufferKind, BufferSpec, dtype_name

VISUAL, STATE, ENV = "VISUAL", "STATE", "ENV"


@dataclass(frozen=True)
class BoundInput:
    """A checkpoint input feature and the port (INPUT buffer) that feeds it."""

    key: str
    type: str                   # VISUAL, STATE or ENV
    shape: Tuple[int, ...]      # LeRobot's shape: [3, H, W] or [n]
    port: BufferSpec            # INPUT buffer: uint8 [h, w, 3] (h, w = H, W unless resized) or float32 [n]

    @property
    def is_camera(self) -> bool:
        return self.type == VISUAL

    @property
    def image_size(self) -> Tuple[int, int]:
        """(H, W) of a camera feature: the size the model sees, whatever the port's."""
        return self.shape[1], self.shape[2]


def port_shape_for(feature_type: str, shape: Tuple[int, ...]) -> Tuple[Tuple[int, ...], torch.dtype]:
    """The port shape and dtype that can feed a feature of this type and LeRobot shape."""
    if feature_type == VISUAL:
        return (shape[1], shape[2], shape[0]), torch.uint8
    return tuple(shape), torch.float32


def bind_features(checkpoint: Checkpoint, feature_map: Mapping[str, BufferSpec],
                  reserved: Collection[str] = (), resize_cameras: bool = False) -> List[BoundInput]:
    """Validate ``feature_map`` against the checkpoint's input features (config.json only).

    Returns the bound inputs in the checkpoint's feature order (which is LeRobot's camera
    order). ``reserved``: buffer names the policy uses itself. ``resize_cameras``: a camera
    port may have another size than its feature (it is resized), never another layout.
    """
    where = f"{checkpoint.directory}/config.json"
    known = list(checkpoint.inputs)
    unknown = [key for key in feature_map if key not in checkpoint.inputs]
    if unknown:
        raise ConfigError(f"feature map entry {unknown[0]!r} is not an input feature of {where}; "
                          f"its input features are {known}")
    bound: List[BoundInput] = []
    ports: Dict[str, str] = {}                       # port name -> the feature it feeds
    for key, feature in checkpoint.inputs.items():
        if feature.type not in (VISUAL, STATE, ENV):
            raise ConfigError(f"{where}: input feature {key!r} has type {feature.type!r}; "
                              "supported: VISUAL, STATE, ENV")
        if key not in feature_map:
            raise ConfigError(f"input feature {key!r} of {where} has no port in the feature map: "
                              f"map it to the {'camera' if feature.type == VISUAL else 'vector'} port that feeds it")
        spec = feature_map[key]
        if feature.type == VISUAL and (len(feature.shape) != 3 or feature.shape[0] != 3):
            raise ConfigError(f"{where}: camera feature {key!r} has shape {list(feature.shape)}; only RGB "
                              "[3, H, W] images are supported")
        if feature.type != VISUAL and len(feature.shape) != 1:
            raise ConfigError(f"{where}: feature {key!r} has shape {list(feature.shape)}; expected a vector [n]")
        shape, dtype = port_shape_for(feature.type, feature.shape)
        if resize_cameras and feature.type == VISUAL and len(spec.shape) == 3 and spec.shape[2] == 3:
            shape = tuple(spec.shape)                         # any [h, w, 3]: resized to [H, W] in the step
        if tuple(spec.shape) != shape or spec.dtype != dtype:
            what = "an RGB camera image [H, W, 3]" if feature.type == VISUAL else "a vector"
            hint = ("" if feature.type != VISUAL or resize_cameras
                    else " (or set resize_cameras to resize another size on the device)")
            raise ConfigError(f"port {spec.name!r} cannot feed {key!r}: it is {dtype_name(spec.dtype)} "
                              f"{list(spec.shape)}, the checkpoint needs {what} {dtype_name(dtype)} {list(shape)}"
                              + hint)
        if spec.name in ports:
            raise ConfigError(f"port {spec.name!r} feeds both {ports[spec.name]!r} and {key!r}; "
                              "give each feature its own port")
        if spec.name in reserved:
            raise ConfigError(f"port name {spec.name!r} (feeding {key!r}) is a buffer of the policy itself; "
                              "rename the port")
        ports[spec.name] = key
        bound.append(BoundInput(key, feature.type, feature.shape,
                                BufferSpec(spec.name, shape, dtype, BufferKind.INPUT)))
    return bound
