"""Loading a π0 / π0.5 ``model.safetensors`` strictly, by LeRobot 0.6.1's naming rules.

LeRobot's ``PI0Policy.from_pretrained`` / ``PI05Policy.from_pretrained`` read the file
(``safetensors.torch.load_file``, in the file's key order), rename legacy keys
(``_fix_pytorch_state_dict_keys``), add the ``model.`` prefix where it is missing, and call
``load_state_dict(strict=True)``, but inside a ``try`` that, on any error, prints a
warning and returns the model with its RANDOM initial weights. capsule_ros applies the
same renaming (``lerobot_state_dict``, operation for operation, so an older checkpoint
that LeRobot accepts is accepted too) and then refuses, in one line naming the tensors,
everything LeRobot would have swallowed: a missing, unexpected or wrongly shaped tensor,
and a dtype other than the one LeRobot's precision gives that parameter (LeRobot would
cast it silently; a file of other precision is not the checkpoint config.json describes).

The two language-model heads (PaliGemma's and the expert's) are saved by LeRobot and read
by no inference path: they are dropped (``UNUSED_AT_INFERENCE``), never allocated.
"""
from __future__ import annotations

import logging
import re
from typing import Dict, Mapping

import torch
from torch import nn

from capsule_ros.policies.lerobot.checkpoint import MODEL_FILE, Checkpoint
from capsule_ros.policies.lerobot.pi.architecture import UNUSED_AT_INFERENCE, VLM, PiArchitecture
from capsule_ros.policies.lerobot.pi.model import PiModel
from capsule_ros.runtime.weights import load_strict, read_weights

LOG = logging.getLogger(__name__)

PREFIX = "model."
_EXPERT_NORM = re.compile(r"paligemma_with_expert\.gemma_expert\.model\.layers\.\d+\."
                          r"(input_layernorm|post_attention_layernorm)\.weight")
_EXPERT_FINAL_NORM = re.compile(r"paligemma_with_expert\.gemma_expert\.model\.norm\.weight")
_LM_HEADS = ("model.paligemma_with_expert.paligemma.lm_head.weight", "paligemma_with_expert.paligemma.lm_head.weight")


def lerobot_state_dict(tensors: Mapping[str, torch.Tensor], arch: PiArchitecture) -> Dict[str, torch.Tensor]:
    """The state dict LeRobot's ``from_pretrained`` hands to ``load_state_dict`` for the
    file's ``tensors`` (in the file's order): ``_fix_pytorch_state_dict_keys`` then the
    ``model.`` prefix, later keys overwriting earlier ones as in LeRobot's dicts."""
    fixed: Dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        new_key = key
        if arch.adarms and (_EXPERT_NORM.match(key) or _EXPERT_FINAL_NORM.match(key)):
            LOG.warning("%s: skipping %s (a plain norm weight; this expert normalises adaptively)", MODEL_FILE, key)
            continue
        if arch.adarms:
            if key.startswith("action_time_mlp_in."):
                new_key = key.replace("action_time_mlp_in.", "time_mlp_in.")
            elif key.startswith("action_time_mlp_out."):
                new_key = key.replace("action_time_mlp_out.", "time_mlp_out.")
            if key.startswith("state_proj."):
                LOG.warning("%s: skipping %s (π0.5 has no state projection)", MODEL_FILE, key)
                continue
        elif key.startswith("time_mlp_in."):
            new_key = key.replace("time_mlp_in.", "action_time_mlp_in.")
        elif key.startswith("time_mlp_out."):
            new_key = key.replace("time_mlp_out.", "action_time_mlp_out.")
        if key in _LM_HEADS:
            fixed[VLM + "embed_tokens.weight"] = value
        fixed[new_key] = value
    return {(key if key.startswith(PREFIX) else PREFIX + key): value for key, value in fixed.items()}


def load_weights(checkpoint: Checkpoint, model: PiModel) -> None:
    """Load the checkpoint's weights into ``model`` (module docstring): ConfigError in one
    line naming the missing, unexpected and mismatched (shape or dtype) tensors. The
    file's tensors become the parameters (a model built on the meta device has none yet;
    ``PiModel.materialize_constants`` then makes the buffers no checkpoint holds)."""
    path = checkpoint.directory / MODEL_FILE
    state = lerobot_state_dict(read_weights(path)[0], model.arch)
    used = {key: value for key, value in state.items() if not key.startswith(UNUSED_AT_INFERENCE)}
    load_strict(nn.ModuleDict({PREFIX[:-1]: model}), used,
                f"{path} does not fit the {checkpoint.policy_type} policy its config.json describes", assign=True)
