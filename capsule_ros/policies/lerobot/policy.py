"""What the LeRobot policies share as StatefulPolicies: inputs, normalisation, standard buffers.

``LeRobotPolicy`` owns the bound inputs (port -> feature), the input normalisers and the
action unnormaliser, and writes the standard buffers; ACT and Diffusion add their
network, their episode-state buffers and their step.
"""
from __future__ import annotations

import abc
from typing import Dict, List, Optional, Sequence, cast

import torch
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import Checkpoint, Normalization
from capsule_ros.policies.lerobot.common import FeatureNorm, camera_to_float
from capsule_ros.policies.lerobot.features import OBS_ENV_STATE, OBS_STATE, BoundInput
from capsule_ros.runtime.arena import BufferSpec
from capsule_ros.runtime.policy import EPISODE, POSITION, RNG, STEP, State, StatefulPolicy, standard_specs


class LeRobotPolicy(StatefulPolicy):
    """Base of the LeRobot policies (see module docstring)."""

    def __init__(self, checkpoint: Checkpoint, inputs: Sequence[BoundInput],
                 input_norms: Dict[str, Normalization], action_norm: Normalization, chunk_horizon: int):
        super().__init__()
        self.checkpoint_config = dict(checkpoint.config)
        self.inputs: List[BoundInput] = list(inputs)
        self.action_dim = checkpoint.action_dim
        self.chunk_horizon = chunk_horizon
        self.input_norms = nn.ModuleList(FeatureNorm(input_norms[b.key], b.shape) for b in self.inputs)
        self._norm_of = {b.key: i for i, b in enumerate(self.inputs)}
        self.action_norm = FeatureNorm(action_norm, (self.action_dim,))
        self.cameras = [b for b in self.inputs if b.is_camera]
        state_input = next((b for b in self.inputs if b.key == OBS_STATE), None)
        if state_input is None:                 # each type's REQUIREMENTS refuse such a checkpoint first
            raise ConfigError(f"the checkpoint has no {OBS_STATE!r} input feature, which ACT and Diffusion read")
        self.state_input: BoundInput = state_input
        self.env_input: Optional[BoundInput] = next((b for b in self.inputs if b.key == OBS_ENV_STATE), None)

    # -- inputs ---------------------------------------------------------------------------
    def normalized(self, bound: BoundInput, x: torch.Tensor) -> torch.Tensor:
        """Port values ``x`` [..., *port shape] of ``bound`` as LeRobot's preprocessor hands
        them to the model: cameras float32 [..., 3, H, W] (resized to the feature's size
        when the port has another), vectors float32 [..., n]."""
        if bound.is_camera:
            x = camera_to_float(x, bound.image_size)
        return cast(FeatureNorm, self.input_norms[self._norm_of[bound.key]]).normalize(x)

    # -- protocol pieces ------------------------------------------------------------------
    def architecture(self) -> dict:
        return {"policy": f"lerobot.{self.checkpoint_config.get('type')}", "config": self.checkpoint_config,
                "inputs": [{"feature": b.key, "port": b.port.name, "shape": list(b.port.shape),
                            "dtype": str(b.port.dtype)} for b in self.inputs]}

    @abc.abstractmethod
    def weight_modules(self) -> Dict[str, nn.Module]:
        """The modules whose weights the checkpoint's ``model.safetensors`` holds, by the
        prefix of their names there (``model`` for ACT, ``diffusion`` for Diffusion)."""

    def base_specs(self) -> List[BufferSpec]:
        """The input ports and the standard buffers."""
        return [b.port for b in self.inputs] + standard_specs(self.action_dim, self.chunk_horizon)

    def reset_base(self, state: State, *, episode: int, seed: int) -> None:
        """Zero everything but the inputs, then episode id and RNG (seed, counter 0)."""
        ports = {b.port.name for b in self.inputs}
        for name, view in state.items():
            if name not in ports:
                view.zero_()
        state[EPISODE].fill_(episode)
        state[RNG][0] = seed & 0xFFFFFFFF

    @staticmethod
    def advance(state: State) -> None:
        """End of a step: step, position and the RNG counter move on by one."""
        state[STEP].add_(1)
        state[POSITION].add_(1)
        state[RNG][1:].add_(1)
