"""LeRobot checkpoints (ACT, Diffusion Policy) served by capsule_ros's own implementations.

LeRobot is not imported: the networks, LeRobot's processors (normalisation, image
conversion) and its ``select_action`` bookkeeping (action queue, temporal ensembling,
observation history) are reimplemented as ``StatefulPolicy`` steps over arena buffers,
and matched against LeRobot's own outputs (``test/test_lerobot_parity.py``).

Entry points: ``build_act`` and ``build_diffusion`` (or ``build_policy``, which reads the
checkpoint's ``type``) take a LeRobot ``pretrained_model/`` directory and a feature map
(checkpoint input feature key -> the INPUT ``BufferSpec`` of the port feeding it, see
``features.py``); ``build_from_ports`` takes the map as port names over the node's ports
(the policy kinds, ``kinds.py``). Everything that can be checked from config.json is
checked before any statistics or weights are read (the feature map by the binding
checker, the options by each type's ``REQUIREMENTS``), and raises ``ConfigError``
naming the key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Tuple

from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.policies.binding import Port, Requirement, require
from capsule_ros.policies.lerobot import act, diffusion
from capsule_ros.policies.lerobot.checkpoint import Checkpoint, load_model_weights, read_checkpoint, read_normalization
from capsule_ros.policies.lerobot.features import bind_ports, feature_rules
from capsule_ros.policies.lerobot.policy import LeRobotPolicy
from capsule_ros.runtime.arena import BufferSpec
from capsule_ros.runtime.policy import STANDARD_NAMES


class _Kind:
    """How one LeRobot policy type is checked (its config's ``requirements``), built and loaded."""

    def __init__(self, requirements: Tuple[Requirement, ...], build: Callable[..., LeRobotPolicy],
                 buffers: Tuple[str, ...], training_only: Callable[[Checkpoint], Tuple[str, ...]]):
        self.requirements, self.build, self.buffers = requirements, build, buffers
        self.training_only = training_only


KINDS = {
    "act": _Kind(act.REQUIREMENTS, act.ACTPolicy, act.BUFFER_NAMES,
                 lambda ck: act.TRAINING_ONLY if ck.field("use_vae", True) else ()),
    "diffusion": _Kind(diffusion.REQUIREMENTS, diffusion.DiffusionPolicy, diffusion.BUFFER_NAMES, lambda ck: ()),
}


def build_policy(checkpoint_dir, feature_map: Mapping[str, BufferSpec], *, expected_type: str = "",
                 resize_cameras: bool = False) -> LeRobotPolicy:
    """A StatefulPolicy for the LeRobot checkpoint in ``checkpoint_dir`` (its ``type`` picks
    ACT or Diffusion), its inputs fed by the ports of ``feature_map``; ``resize_cameras``:
    camera ports of another size are resized to the checkpoint's (``features.py``).

    Order: config.json is parsed and the feature map and options validated (no other file
    is read), then the processor statistics, then the network is built and
    ``model.safetensors`` loaded strictly by LeRobot's parameter names.
    """
    ports = {spec.name: Port(spec) for spec in feature_map.values()}
    return build_from_ports(checkpoint_dir, {key: spec.name for key, spec in feature_map.items()}, ports,
                            expected_type=expected_type, resize_cameras=resize_cameras)


def build_from_ports(checkpoint_dir, feeds: Mapping[str, str], ports: Mapping[str, Port], *, expected_type: str = "",
                     resize_cameras: bool = False, section: str = "policy.lerobot") -> LeRobotPolicy:
    """``build_policy`` with the map as {feature key: port name} over the node's ports
    (``binding.ports_of``: their message types are checked too); ``section`` names the
    kind's settings in errors."""
    checkpoint = read_checkpoint(Path(checkpoint_dir))
    kind_name = checkpoint.policy_type
    if expected_type and kind_name != expected_type:
        raise ConfigError(f"{checkpoint.directory}/config.json: type is {kind_name!r}, expected {expected_type!r}")
    if kind_name not in KINDS:
        raise ConfigError(f"{checkpoint.directory}/config.json: policy type {kind_name!r} is not supported; "
                          f"supported: {sorted(KINDS)}")
    kind = KINDS[kind_name]
    inputs = bind_ports(checkpoint, feature_rules(STANDARD_NAMES + kind.buffers), feeds, ports, section=section,
                        resize_cameras=resize_cameras)
    require(kind.requirements, checkpoint)
    input_norms, action_norm = read_normalization(checkpoint)
    policy = kind.build(checkpoint, inputs, input_norms, action_norm)
    load_model_weights(checkpoint, nn.ModuleDict(policy.weight_modules()), training_only=kind.training_only(checkpoint))
    return policy.eval()


def build_act(checkpoint_dir, feature_map: Mapping[str, BufferSpec]) -> act.ACTPolicy:
    """ACT from a LeRobot checkpoint (see ``build_policy``)."""
    policy = build_policy(checkpoint_dir, feature_map, expected_type="act")
    assert isinstance(policy, act.ACTPolicy)
    return policy


def build_diffusion(checkpoint_dir, feature_map: Mapping[str, BufferSpec]) -> diffusion.DiffusionPolicy:
    """Diffusion Policy from a LeRobot checkpoint (see ``build_policy``)."""
    policy = build_policy(checkpoint_dir, feature_map, expected_type="diffusion")
    assert isinstance(policy, diffusion.DiffusionPolicy)
    return policy


__all__ = ["build_policy", "build_from_ports", "build_act", "build_diffusion", "read_checkpoint"]
