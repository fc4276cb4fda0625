"""π0 / π0.5 as LeRobot 0.6.1 runs them at inference, as a StatefulPolicy (``VLAPolicy``).

The flow-matching loop, RTC guidance, the task buffer and the chunk cadence are the VLA
policies' shared machinery (``capsule_ros.policies.vla``); this module adds what π0 and
π0.5 do (``model.PiModel``): the cameras through LeRobot's ``_preprocess_images``
(normalised, resized with padding to ``image_resolution``, [-1, 1]; ``empty_cameras``
padded with -1 and masked out), the PaliGemma prefix, and the state:

- π0: the normalised state, zero-padded to ``max_state_dim``, is the expert's first suffix
  token; the prompt is the task with a newline, tokenised when a task is staged
  (``text_inputs``), as SmolVLA's;
- π0.5: the state enters the prompt as 256-bin tokens (``prompt.state_prompt``), so the
  prompt depends on the state of the step that plans: the host builds and tokenises it
  right before that step's inputs go up (``prepare_inputs``, from the staged state and the
  last staged task) into ``pi05.prompt``, an input buffer, which the plan reads. A capsule,
  an asynchronous request and the input log hold it, so a replay or the recompute
  fallback needs no tokenizer. The task buffer holds the cleaned task's own tokens: what
  the instruction was.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import Checkpoint, Normalization
from capsule_ros.policies.lerobot.common import FeatureNorm
from capsule_ros.policies.lerobot.features import BoundInput
from capsule_ros.policies.lerobot.pi.model import PiModel, Prefix, siglip_input
from capsule_ros.policies.lerobot.pi.prompt import state_prompt
from capsule_ros.policies.vla.policy import VLAPolicy
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.policies.vla.tokens import MASK, TOKENS, TaskTokenizer
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.policy import State

PROMPT_BUFFER = "pi05.prompt"        # π0.5: the prompt of the step that plans, int64 [2, max_length]
BUFFER_NAMES = (PROMPT_BUFFER,)


class HostNormalizer:
    """A feature's normaliser kept on the host: not a submodule, so moving the policy to a
    device leaves it where the staged inputs are."""

    def __init__(self, norm: FeatureNorm):
        self.norm = norm

    def __call__(self, values: np.ndarray) -> np.ndarray:
        """float32 [n] -> the normalised float32 [n] (LeRobot's operations on a [1, n] batch)."""
        with torch.no_grad():
            return self.norm.normalize(torch.from_numpy(np.array(values, dtype=np.float32))[None])[0].numpy()


class PiPolicy(VLAPolicy):
    """LeRobot's PI0Policy / PI05Policy ``select_action`` / ``predict_action_chunk`` with
    their processors (module docstring)."""

    def __init__(self, checkpoint: Checkpoint, inputs: Sequence[BoundInput], input_norms: Dict[str, Normalization],
                 action_norm: Normalization, *, model: PiModel, tokenizer: TaskTokenizer,
                 prompt_tokenizer: Optional[TaskTokenizer], task_port: Optional[BufferSpec], default_task: str,
                 rtc: RTCSettings, description: Mapping[str, object]):
        """``model``: built from the checkpoint's architecture (weights still to load);
        ``tokenizer``: the task's; ``prompt_tokenizer``: π0.5's whole-prompt tokenizer (None
        for π0); ``description``: what else changes the numbers (library versions,
        tokenizer files, the dtype map), for the architecture."""
        arch = model.arch
        super().__init__(checkpoint, inputs, input_norms, action_norm, tokenizer=tokenizer, task_port=task_port,
                         default_task=default_task, chunk_size=arch.chunk_size, n_action_steps=arch.n_action_steps,
                         max_action_dim=arch.max_action_dim, num_steps=arch.num_inference_steps, rtc=rtc)
        if not self.cameras:
            raise ConfigError(f"{checkpoint.policy_type} needs at least one camera input feature (LeRobot refuses "
                              "a batch without images)")
        self.model = model
        self.arch = arch
        self.description = dict(description)
        self.prompt_tokenizer = prompt_tokenizer
        self.prompt_spec = (BufferSpec(PROMPT_BUFFER, (2, prompt_tokenizer.max_length), torch.int64, BufferKind.INPUT)
                            if prompt_tokenizer is not None else None)
        # π0.5 normalises the state on the host too, for its prompt (LeRobot's CPU preprocessor)
        self.host_state_norm = (HostNormalizer(FeatureNorm(input_norms[self.state_input.key], self.state_input.shape))
                                if prompt_tokenizer is not None else None)

    def weight_modules(self) -> Dict[str, nn.Module]:
        return {"model": self.model}

    # -- buffers -----------------------------------------------------------------------------------
    def _reads(self) -> List[str]:
        reads = super()._reads()
        return reads if self.prompt_spec is None else [*reads, self.prompt_spec.name]

    def base_specs(self) -> List[BufferSpec]:
        specs = super().base_specs()
        return specs if self.prompt_spec is None else [self.prompt_spec, *specs]

    # -- the host side (π0.5) ----------------------------------------------------------------------
    def prepare_inputs(self, staging: Mapping[str, np.ndarray], texts: Mapping[str, str]) -> None:
        """π0.5: the prompt from the staged state and the last staged task (``policy.task``
        without a task port), normalised and tokenised on the host as LeRobot's CPU
        preprocessor does, into the staged ``pi05.prompt``. Nothing for π0."""
        if self.prompt_tokenizer is None or self.prompt_spec is None or self.host_state_norm is None:
            return
        task = texts.get(self.task_spec.name, self.default_task)
        normalized = self.host_state_norm(np.asarray(staging[self.state_input.port.name]))
        staging[self.prompt_spec.name][...] = self.prompt_tokenizer.encode(state_prompt(task, normalized))

    # -- the prefix --------------------------------------------------------------------------------
    def task_tokens(self, state: State, exact_length: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """π0: the task buffer's tokens; π0.5: the prompt's (both padded to their fixed length)."""
        if self.prompt_spec is None:
            return super().task_tokens(state, exact_length)
        buffer = state[self.prompt_spec.name]
        return buffer[TOKENS][None], buffer[MASK][None].bool()

    def images(self, state: State) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """``_preprocess_images``: each camera normalised, resized with padding to the
        model's size, in [-1, 1]; then the empty cameras, -1 everywhere and masked out."""
        images, masks = [], []
        for camera in self.cameras:
            image = self.normalized(camera, state[camera.port.name][None])                  # [1, 3, H, W]
            images.append(siglip_input(image, self.arch.image_size))
            masks.append(torch.ones(1, dtype=torch.bool, device=image.device))
        for _ in range(self.arch.empty_cameras):
            images.append(torch.ones_like(images[-1]) * -1)
            masks.append(torch.zeros_like(masks[-1]))
        return images, masks

    def encode_prefix(self, state: State) -> Prefix:
        images, masks = self.images(state)
        ids, token_masks = self.task_tokens(state, exact_length=False)
        robot_state = None
        if not self.arch.adarms:                       # π0: the state token (LeRobot's pad_vector)
            normalized = self.normalized(self.state_input, state[self.state_input.port.name][None])
            robot_state = F.pad(normalized, (0, self.arch.max_state_dim - normalized.shape[-1]))
        return self.model.encode_prefix(images, masks, ids, token_masks, robot_state, self.side_by_side)

    def velocity(self, prefix: Prefix, x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        return self.model.velocity(prefix, x_t, time, self.side_by_side)

    def architecture(self) -> dict:
        out = super().architecture()
        out.update(pi=self.description)
        return out
