"""The policy kinds ``lerobot_act`` and ``lerobot_diffusion``: a LeRobot ``pretrained_model/``
directory served by policy_node, configured by parameters (docs/lerobot.md is the guide)::

    policy:
      kind: lerobot_act
      weights: ''                  # the checkpoint holds the weights
      lerobot_act:
        pretrained_model: /robot/checkpoints/last/pretrained_model
        features: ["observation.state:joints", "observation.images.top:top_camera"]

ROS parameters cannot be maps, so the port-to-feature map is a string array of
``<feature key>:<port>`` entries, one per input feature of the checkpoint. ``build``
checks, in this order, each step raising ConfigError naming the key or port before the
next one starts: the entries themselves; config.json (nothing else is read yet): its
type, then the map against the ports by the binding checker (``features.feature_rules``:
every feature has a port and every port a feature, a camera feature is fed by a
``sensor_msgs/msg/Image`` port and a vector by any other type, then shapes and dtypes),
then the type's options; only then the processor statistics and the weights.

The capsule fingerprint covers the checkpoint without hashing its files: the policy's
architecture holds config.json, and its state dict (which the runtime digests) holds every
weight the step reads and the normalisation statistics. A checkpoint copied elsewhere
keeps its fingerprint; a changed weight, statistic or option does not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

from capsule_ros.config import NAME_PATTERN, ConfigSection, setting
from capsule_ros.errors import ConfigError
from capsule_ros.policies.binding import ports_of
from capsule_ros.policies.lerobot import build_from_ports
from capsule_ros.policies.lerobot.policy import LeRobotPolicy
from capsule_ros.policies.registry import BuildContext, PolicyKind


@dataclass(frozen=True)
class LeRobotSettings(ConfigSection):
    """A LeRobot checkpoint and the ports that feed its input features."""

    SECTION = "policy.lerobot"

    pretrained_model: str = setting("", "LeRobot pretrained_model/ directory (config.json, model.safetensors, "
                                    "the processor files); policy.weights must be ''", read_only=True)
    features: Tuple[str, ...] = setting((), "port-to-feature map: one '<feature key>:<port>' entry per input "
                                        "feature of the checkpoint, e.g. 'observation.state:joints'",
                                        read_only=True)
    resize_cameras: bool = setting(False, "resize camera ports of another size to the checkpoint's image size on "
                                   "the device (antialiased bilinear, before normalisation); false: a camera "
                                   "port must have exactly the checkpoint's size", read_only=True)

    def check(self) -> None:
        if not self.pretrained_model:
            raise ConfigError(f"{self.SECTION}.pretrained_model: must name a LeRobot pretrained_model/ directory")
        self.feature_ports()

    def feature_ports(self) -> Dict[str, str]:
        """features as {feature key: port name}, in the order given."""
        out: Dict[str, str] = {}
        for entry in self.features:
            key, _, port = entry.rpartition(":")
            if not key or re.fullmatch(r"\S+", key) is None or re.fullmatch(NAME_PATTERN, port) is None:
                raise ConfigError(f"{self.SECTION}.features entry {entry!r}: expected '<feature key>:<port>', "
                                  f"e.g. 'observation.state:joints' (port names match {NAME_PATTERN})")
            if key in out:
                raise ConfigError(f"{self.SECTION}.features: {key!r} is mapped twice ({out[key]!r} and {port!r})")
            out[key] = port
        return out


@dataclass(frozen=True)
class ACTSettings(LeRobotSettings):
    """ACT from a LeRobot checkpoint: its directory and the ports that feed its input features."""

    SECTION = "policy.lerobot_act"


@dataclass(frozen=True)
class DiffusionSettings(LeRobotSettings):
    """Diffusion Policy from a LeRobot checkpoint: its directory and the ports that feed its input features."""

    SECTION = "policy.lerobot_diffusion"


def _builder(policy_type: str):
    def build(context: BuildContext) -> LeRobotPolicy:
        """The checkpoint's policy for the configured ports (checks first, see the module docstring)."""
        settings = context.settings
        assert isinstance(settings, LeRobotSettings)
        if context.weights is not None:
            raise ConfigError(f"policy.weights = {str(context.weights)!r}: a LeRobot policy reads its weights from "
                              f"{settings.SECTION}.pretrained_model; set policy.weights to ''")
        return build_from_ports(Path(settings.pretrained_model).expanduser(), settings.feature_ports(),
                                ports_of(context.inputs, context.ports), expected_type=policy_type,
                                resize_cameras=settings.resize_cameras, section=settings.SECTION)
    return build


ACT_KIND = PolicyKind("lerobot_act", ACTSettings, _builder("act"),
                      "ACT from a LeRobot pretrained_model/ directory (action queue or temporal ensembling)")
DIFFUSION_KIND = PolicyKind("lerobot_diffusion", DiffusionSettings, _builder("diffusion"),
                            "Diffusion Policy from a LeRobot pretrained_model/ directory (DDPM or DDIM)")
