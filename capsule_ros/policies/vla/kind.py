"""What the VLA policy kinds share in their configuration: their binding rules (the task port in
the feature map), the local directory that stands in for the model hub, and the checks before
anything loads.

A VLA kind's section extends the LeRobot one (``pretrained_model``, ``features``,
``resize_cameras``) with ``vlm_files``, the local directory holding the files a LeRobot
checkpoint names by a hub id (the VLM's ``config.json``, its tokenizer and processor files),
and accepts one more feature map entry, ``task:<port>``: a ``std_msgs/msg/String`` port whose
messages are the task instruction (LeRobot's ``task``). Without it the task is
``policy.task``, for the whole session.

The map is checked by the binding vocabulary (``capsule_ros.policies.binding``) with the rules
``vla_rules``: cameras (``VISUAL``) fed by image ports, the robot state (``observation.state``,
the only vector a VLA reads) by a vector port, and, when the map names it, the task: a tensor
``task`` int64 [2, L] (token ids and their mask, L the checkpoint's token length) fed by a
``std_msgs/msg/String`` port of that shape, with the wording of the LeRobot kinds.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Dict, List, Optional, Tuple

import torch

from capsule_ros.config import setting
from capsule_ros.errors import ConfigError
from capsule_ros.policies.binding import (
    IMAGE_MESSAGES,
    RGB_IMAGE,
    TEXT_MESSAGES,
    VECTOR,
    VECTOR_MESSAGES,
    BindingRules,
    Count,
    Feed,
    Role,
    RoleRule,
    Tensor,
    bind,
    ports_of,
)
from capsule_ros.policies.lerobot.checkpoint import Checkpoint
from capsule_ros.policies.lerobot.features import OBS_STATE, STATE, VISUAL, WORDING, BoundInput, feature_tensors
from capsule_ros.policies.lerobot.kinds import LeRobotSettings
from capsule_ros.policies.registry import BuildContext
from capsule_ros.runtime.arena import BufferSpec

TASK_KEY = "task"                       # LeRobot's complementary-data key of the instruction
TASK_LABEL = "TASK"
TEXT_TYPE = "std_msgs/msg/String"
# the task's buffer: token ids (row 0) and their mask (row 1), int64 [2, L] (vla/tokens.py)
TASK_TOKENS = Feed("token ids and their mask [2, L]", rank=2, channels=2, dtype=torch.int64,
                   expected="expected token ids and their mask [2, L]", port_noun="text")


@dataclass(frozen=True)
class VLASettings(LeRobotSettings):
    """A LeRobot VLA checkpoint, the ports that feed it, and where its hub files are."""

    SECTION = "policy.lerobot_vla"

    vlm_files: str = setting("", "local directory with the files the checkpoint names by a hub id (config.json's "
                             "vlm_model_name): the VLM's config.json, tokenizer and processor files, staged by hand "
                             "on a machine without the hub (docs/vla.md); '' = vlm_model_name itself when it is a "
                             "local directory", read_only=True)


def vla_rules(reserved: Collection[str] = ()) -> BindingRules:
    """A VLA's inputs in the binding vocabulary (module docstring); ``reserved``: buffer names
    the policy keeps for itself, which no port may take."""
    return BindingRules(
        roles=(RoleRule(Role.CAMERA, labels=(VISUAL,), feed=RGB_IMAGE, messages=IMAGE_MESSAGES, noun="camera feature"),
               RoleRule(Role.ROBOT_STATE, labels=(STATE,), names=(OBS_STATE,), feed=VECTOR, messages=VECTOR_MESSAGES,
                        noun="feature"),
               RoleRule(Role.TASK, labels=(TASK_LABEL,), count=Count.OPTIONAL, feed=TASK_TOKENS,
                        messages=TEXT_MESSAGES, dtypes=(torch.int64,), allowed="int64 token ids and their mask",
                        noun="task")),
        reserved_ports=tuple(reserved), wording=WORDING)


def bind_inputs(checkpoint: Checkpoint, settings: LeRobotSettings, context: BuildContext, reserved: Collection[str],
                token_length: int) -> Tuple[List[BoundInput], Optional[BufferSpec]]:
    """(the checkpoint's input features with their ports, in its feature order; the task port's
    INPUT buffer or None) from the kind's feature map over the node's ports, checked by
    ``vla_rules``; ``token_length``: the checkpoint's L."""
    feeds = settings.feature_ports()
    tensors = feature_tensors(checkpoint)
    if TASK_KEY in feeds:
        tensors.append(Tensor(TASK_KEY, (2, token_length), torch.int64, label=TASK_LABEL))
    table = bind(vla_rules(reserved), inputs=tensors, ports=ports_of(context.inputs, context.ports), feeds=feeds,
                 resize=settings.resize_cameras, where=f"{checkpoint.directory}/config.json",
                 section=settings.SECTION, fields={"policy": checkpoint.policy_type})
    inputs = [BoundInput(b.tensor.name, b.tensor.label, b.tensor.shape, b.port) for b in table.fed()
              if b.port is not None and b.role is not Role.TASK]
    task = table.one(Role.TASK)
    return inputs, task.port if task is not None else None


def local_files(setting_value: str, hub_id: str, where: str) -> Path:
    """The local directory of a checkpoint's hub files: ``setting_value`` when set, else the
    checkpoint's own name for them if that is a local directory. Never downloads."""
    if setting_value:
        path = Path(setting_value).expanduser()
        if not path.is_dir():
            raise ConfigError(f"{where} = {setting_value!r}: not a directory")
        return path
    path = Path(hub_id).expanduser()
    if hub_id and path.is_dir():
        return path
    raise ConfigError(f"{where} is empty and the checkpoint names its VLM {hub_id!r}, which is not a local "
                      "directory: capsule_ros downloads nothing; stage its config.json and tokenizer files in a "
                      f"directory and name it in {where} (docs/vla.md)")


def files_digest(directory: Path, names: Tuple[str, ...]) -> Dict[str, str]:
    """SHA-256 of each of ``names`` present in ``directory`` (what changes the tokens)."""
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
            for name in names if (directory / name).is_file()}
