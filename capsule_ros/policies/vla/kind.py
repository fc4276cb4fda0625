"""What the VLA policy kinds share in their configuration: the task port in the feature map,
the local directory that stands in for the model hub, and the checks before anything loads.

A VLA kind's section extends the LeRobot one (``pretrained_model``, ``features``,
``resize_cameras``) with ``vlm_files``, the local directory holding the files a LeRobot
checkpoint names by a hub id (the VLM's ``config.json``, its tokenizer and processor files),
and accepts one more feature map entry, ``task:<port>``: a ``std_msgs/msg/String`` port whose
messages are the task instruction (LeRobot's ``task``). Without it the task is
``policy.task``, for the whole session.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from capsule_ros.config import setting
from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.kinds import LeRobotSettings, feature_map
from capsule_ros.policies.registry import BuildContext
from capsule_ros.runtime.arena import BufferSpec

TASK_KEY = "task"                       # LeRobot's complementary-data key of the instruction
TEXT_TYPE = "std_msgs/msg/String"


@dataclass(frozen=True)
class VLASettings(LeRobotSettings):
    """A LeRobot VLA checkpoint, the ports that feed it, and where its hub files are."""

    SECTION = "policy.lerobot_vla"

    vlm_files: str = setting("", "local directory with the files the checkpoint names by a hub id (config.json's "
                             "vlm_model_name): the VLM's config.json, tokenizer and processor files, staged by hand "
                             "on a machine without the hub (docs/vla.md); '' = vlm_model_name itself when it is a "
                             "local directory", read_only=True)


def task_and_features(settings: LeRobotSettings, context: BuildContext) -> Tuple[Optional[BufferSpec],
                                                                                 Dict[str, BufferSpec]]:
    """(the task port's INPUT buffer or None, {feature key: port buffer} of the checkpoint's
    input features), checked as ``kinds.feature_map`` checks the rest; the task port must be
    a ``std_msgs/msg/String`` port and no other port may be one."""
    mapping = feature_map(settings, context)
    task = mapping.pop(TASK_KEY, None)
    for key, spec in mapping.items():
        port_type = str(getattr(context.ports.get(spec.name), "type", ""))
        if port_type == TEXT_TYPE:
            raise ConfigError(f"port {spec.name!r} ({TEXT_TYPE}) cannot feed {key!r}: a text port can only feed "
                              f"'{TASK_KEY}' (map it as '{TASK_KEY}:{spec.name}')")
    if task is not None:
        port_type = str(getattr(context.ports.get(task.name), "type", ""))
        if port_type != TEXT_TYPE:
            raise ConfigError(f"port {task.name!r} ({port_type}) cannot feed '{TASK_KEY}': the task instruction "
                              f"needs a {TEXT_TYPE} port")
    return task, mapping


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
