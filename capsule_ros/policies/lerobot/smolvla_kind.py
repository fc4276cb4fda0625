"""The policy kind ``lerobot_smolvla``: a LeRobot SmolVLA ``pretrained_model/`` directory served by
policy_node, fully offline (docs/vla.md is the guide)::

    policy:
      kind: lerobot_smolvla
      weights: ''
      task: pick up the cube            # until the task port says another (or for good, without one)
      lerobot_smolvla:
        pretrained_model: /robot/smolvla/pretrained_model
        vlm_files: /robot/hub/SmolVLM2-500M-Video-Instruct   # config.json + tokenizer files
        features: ["observation.state:joints", "observation.images.top:top", "task:task"]

``build`` checks, in this order, each step raising ConfigError in one line naming the key,
file or port: the feature map against config.json and the ports (``vla.kind``), SmolVLA's
options (``smolvla.check_config``), the processor files (every preprocessor step is one
capsule_ros reproduces: the tokenizer step's options are read from there), the VLM's
config.json (a SmolVLM config), the tokenizer (present, loadable offline, fitting the text
embedding), the normalisation statistics; then the model is built on the meta device
(no memory, no random initialisation) and ``model.safetensors`` loaded into it strictly:
every name, shape and dtype as LeRobot 0.6.1 builds the policy from that config.

The fingerprint covers: config.json and the VLM's config.json, the tokenizer's options,
vocabulary size and file digests, the number of denoising steps, the RTC settings, the
versions of transformers and tokenizers (whose code computes the vision tower, the layers
and the tokens), and, through the weights digest, every weight with its dtype.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import torch
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import (
    load_model_weights,
    read_checkpoint,
    read_normalization,
)
from capsule_ros.policies.registry import BuildContext, PolicyKind
from capsule_ros.policies.vla.kind import VLASettings, bind_inputs, files_digest, local_files
from capsule_ros.policies.vla.policy import TASK_BUFFER
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.policies.vla.tokens import (
    NEWLINE_STEP,
    TOKENIZER_STEP,
    TaskTokenizer,
    load_tokenizer,
    tokenizer_options,
)
from capsule_ros.runtime.policy import STANDARD_NAMES

LOG = logging.getLogger(__name__)
RESERVED = (*STANDARD_NAMES, TASK_BUFFER)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class SmolVLASettings(VLASettings):
    """SmolVLA from a LeRobot checkpoint: its directory, its VLM's files and the ports that feed it."""

    SECTION = "policy.lerobot_smolvla"


def read_vlm_config(directory: Path, where: str):
    """The VLM's config.json through transformers' ``AutoConfig``, offline; a SmolVLM config."""
    from transformers import AutoConfig
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{where}: {directory} has no config.json (the VLM's configuration): stage it there "
                          "(docs/vla.md)")
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad config: name it, one line
        raise ConfigError(f"{where}: {path} does not load as a transformers config ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from None
    if getattr(config, "model_type", "") != "smolvlm":
        raise ConfigError(f"{where}: {path} is a {getattr(config, 'model_type', '?')!r} config; SmolVLA needs a "
                          "SmolVLM ('smolvlm') one")
    return config


def build(context: BuildContext):
    """The checkpoint's SmolVLA for the configured ports (checks first: module docstring)."""
    from capsule_ros.policies.lerobot import smolvla
    settings = context.settings
    assert isinstance(settings, SmolVLASettings)
    where = settings.SECTION
    if context.weights is not None:
        raise ConfigError(f"policy.weights = {str(context.weights)!r}: a LeRobot policy reads its weights from "
                          f"{where}.pretrained_model; set policy.weights to ''")
    checkpoint = read_checkpoint(Path(settings.pretrained_model).expanduser())
    if checkpoint.policy_type != "smolvla":
        raise ConfigError(f"{checkpoint.directory}/config.json: type is {checkpoint.policy_type!r}, expected 'smolvla'")
    options = tokenizer_options(checkpoint, NEWLINE_STEP)
    inputs, task_port = bind_inputs(checkpoint, settings, context, RESERVED, options.max_length)
    smolvla.check_config(checkpoint)
    vlm_dir = local_files(settings.vlm_files, str(checkpoint.field("vlm_model_name", "")), f"{where}.vlm_files")
    vlm_config = read_vlm_config(vlm_dir, f"{where}.vlm_files")
    tokenizer = TaskTokenizer(load_tokenizer(vlm_dir, f"{where}.vlm_files"), options,
                              int(vlm_config.text_config.vocab_size), f"{where}.vlm_files ({vlm_dir})")
    input_norms, action_norm = read_normalization(checkpoint, handled=(NEWLINE_STEP, TOKENIZER_STEP))
    with torch.device("meta"):
        model = smolvla.SmolVLAModel(vlm_config, smolvla.SmolVLAOptions.of(checkpoint))
    policy = smolvla.SmolVLAPolicy(checkpoint, inputs, input_norms, action_norm, model=model, vlm_config=vlm_config,
                                   vlm=vlm_description(vlm_dir, vlm_config), tokenizer=tokenizer, task_port=task_port,
                                   default_task=context.task, rtc=context.rtc or RTCSettings())
    load_model_weights(checkpoint, nn.ModuleDict(policy.weight_modules()), training_only=(smolvla.LM_HEAD,),
                       assign=True)
    left = [name for name, t in list(policy.named_parameters()) + list(policy.named_buffers()) if t.is_meta]
    if left:                      # every tensor of the model comes from the checkpoint or the constants
        raise ConfigError(f"SmolVLA: {len(left)} tensors were not loaded ({', '.join(left[:3])})")
    return policy.eval()


def vlm_description(directory: Path, vlm_config) -> Dict[str, object]:
    """The VLM's part of the architecture (module docstring; the library versions are the
    VLA base's)."""
    return {"config": json.loads(vlm_config.to_json_string(use_diff=False)),
            "tokenizer_files": files_digest(directory, TOKENIZER_FILES)}


SMOLVLA_KIND = PolicyKind("lerobot_smolvla", SmolVLASettings, build,
                          "SmolVLA from a LeRobot pretrained_model/ directory and its VLM's files (offline)")
