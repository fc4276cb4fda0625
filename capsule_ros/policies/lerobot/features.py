"""The port-to-feature map: which node input feeds which checkpoint input feature.

A LeRobot checkpoint names its inputs by feature key (``observation.state``,
``observation.environment_state``, ``observation.images.<camera>``); the node names its
ports. The map (``policy.<kind>.features``, or a {feature key: port buffer} mapping in
Python) is checked against config.json alone, before anything else is read, by the
binding checker (``capsule_ros.policies.binding``) with ``feature_rules``:

- every checkpoint input feature has a port, and every map entry is a checkpoint input
  feature (a camera is never substituted for another); every declared port feeds one;
- a camera feature ``VISUAL [3, H, W]`` takes a uint8 ``[H, W, 3]`` RGB port
  (``sensor_msgs/msg/Image``) of exactly that size, or of any size with
  ``resize_cameras`` (the policy then resizes each frame to ``H x W`` on the device,
  ``common.resize_image``); a ``STATE`` / ``ENV`` feature ``[n]`` takes a float32 ``[n]``
  port of any other message type;
- LeRobot's ACT and Diffusion read vectors only from ``observation.state`` (STATE) and
  ``observation.environment_state`` (ENV): any other vector feature would be ignored by
  LeRobot (or break it), so it is refused rather than silently dropped;
- ports are distinct and do not use a name the policy keeps for itself.

Each error is a ``ConfigError`` naming the feature key or port and what to change
(``WORDING``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, List, Mapping, Optional, Tuple

import torch

from capsule_ros.policies.binding import (
    IMAGE_MESSAGES,
    RGB_IMAGE,
    VECTOR,
    VECTOR_MESSAGES,
    BindingRules,
    Port,
    Role,
    RoleRule,
    Tensor,
    Wording,
    bind,
)
from capsule_ros.policies.lerobot.checkpoint import Checkpoint
from capsule_ros.runtime.arena import BufferSpec

VISUAL, STATE, ENV = "VISUAL", "STATE", "ENV"
OBS_STATE = "observation.state"
OBS_ENV_STATE = "observation.environment_state"

WORDING = Wording(
    unknown_label="{where}: input feature {key!r} has type {label!r}; supported: {labels}",
    unexpected_name="input feature {key!r} ({label}): the {policy} model reads only {names}; rename it in "
                    "config.json or drop it",
    port_undeclared="{section}.features maps to port {port!r}, which is not in ports.names {ports}",
    port_unused="port {port!r} feeds no feature of the checkpoint: map it in {section}.features or remove it from "
                "ports.names",
    map_unknown="feature map entry {key!r} is not an input feature of {where}; its input features are {names}",
    no_port="input feature {key!r} of {where} has no port in the feature map: map it to the {port_noun} port that "
            "feeds it",
    port_mismatch="port {port!r} cannot feed {key!r}: it is {have_dtype} {have_shape}, the checkpoint needs {what} "
                  "{want_dtype} {want_shape}{hint}",
    port_twice="port {port!r} feeds both {other!r} and {key!r}; give each feature its own port",
    resize_hint=" (or set resize_cameras to resize another size on the device)",
)


def feature_rules(reserved: Collection[str] = ()) -> BindingRules:
    """ACT's and Diffusion's inputs in the binding vocabulary; ``reserved``: buffer names
    the policy uses itself, which no port may take."""
    return BindingRules(
        roles=(RoleRule(Role.CAMERA, labels=(VISUAL,), feed=RGB_IMAGE, messages=IMAGE_MESSAGES, noun="camera feature"),
               RoleRule(Role.ROBOT_STATE, labels=(STATE,), names=(OBS_STATE,), feed=VECTOR, messages=VECTOR_MESSAGES,
                        noun="feature"),
               RoleRule(Role.ENV_STATE, labels=(ENV,), names=(OBS_ENV_STATE,), feed=VECTOR, messages=VECTOR_MESSAGES,
                        noun="feature")),
        reserved_ports=tuple(reserved), wording=WORDING)


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


def feature_tensors(checkpoint: Checkpoint) -> List[Tensor]:
    """The checkpoint's input features as the binding checker sees them (labelled by type)."""
    return [Tensor(key, feature.shape, torch.float32, label=feature.type, source=feature)
            for key, feature in checkpoint.inputs.items()]


def port_shape_for(feature_type: str, shape: Tuple[int, ...]) -> Tuple[Tuple[int, ...], torch.dtype]:
    """The port shape and dtype that can feed a feature of this type and LeRobot shape."""
    feed = RGB_IMAGE if feature_type == VISUAL else VECTOR
    return feed.port_for(Tensor("", tuple(shape), torch.float32))


def bind_ports(checkpoint: Checkpoint, rules: BindingRules, feeds: Mapping[str, str], ports: Mapping[str, Port], *,
               section: str = "policy.lerobot", resize_cameras: bool = False) -> List[BoundInput]:
    """The bound inputs of ``feeds`` ({feature key: port name}) over ``ports``, checked by
    ``rules``, in the checkpoint's feature order (which is LeRobot's camera order)."""
    table = bind(rules, inputs=feature_tensors(checkpoint), ports=ports, feeds=feeds, resize=resize_cameras,
                 where=f"{checkpoint.directory}/config.json", section=section,
                 fields={"policy": checkpoint.policy_type})
    return [BoundInput(b.tensor.name, b.tensor.label, b.tensor.shape, b.port) for b in table.fed() if b.port]


def bind_features(checkpoint: Checkpoint, feature_map: Mapping[str, BufferSpec], reserved: Collection[str] = (),
                  resize_cameras: bool = False, rules: Optional[BindingRules] = None) -> List[BoundInput]:
    """``bind_ports`` for a map given as {feature key: port buffer} (no message types known)."""
    ports = {spec.name: Port(spec) for spec in feature_map.values()}
    return bind_ports(checkpoint, rules or feature_rules(reserved), {key: s.name for key, s in feature_map.items()},
                      ports, resize_cameras=resize_cameras)
