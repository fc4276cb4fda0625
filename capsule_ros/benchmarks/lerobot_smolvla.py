"""The SmolVLA checkpoints ``capsule-ros bench chunking`` serves (its VLA cases), made by LeRobot itself.

A SmolVLA checkpoint depends on its VLM's files (config, tokenizer, processor), which only a
model hub or LeRobot's own code makes; so LeRobot 0.6.1 builds and saves it, in its own
environment (``tools/lerobot_bench/make_vla_checkpoint.py``, the parity fixtures' code path,
with LeRobot's random initialisation), into ``<dir>/pretrained_model`` and ``<dir>/vlm``. Both
sides of the benchmark then serve that one directory: LeRobot's ``predict_action`` loop and
capsule_ros through ``policy.kind: lerobot_smolvla`` (``vlm_files``), as a user would.

Three sizes (``SPECS``): ``tiny``, the parity fixtures' dimensions (a 64-wide, 4-layer text
model and a 32-wide vision tower on 48 x 48 images: 9 tokens per camera); ``mid``, a
384-wide, 8-layer text model with a 256-wide, 4-layer vision tower on 224 x 224 images (49
tokens per camera), about a tenth of SmolVLM2-500M's text width; ``real``, SmolVLM2-500M's
own dimensions (a 960-wide text model of which SmolVLA keeps 16 layers, 15 heads over 5
key/value heads; a 768-wide, 12-layer SigLIP tower on 512 x 512 images, pixel shuffle 4:
64 tokens per camera; bfloat16, as its config.json says) and SmolVLAConfig's defaults,
with a small trained vocabulary instead of its 49,280 tokens (the embedding is a lookup: a
chunk's time does not depend on its size). All: two cameras unless asked (1 to 3:
``camera_keys``), six joint positions, six actions, LeRobot's chunk of 50 actions all
executed (``n_action_steps`` 50), 10 denoising steps, ``longest`` token padding up to 48
tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Tuple

from capsule_ros.benchmarks.common import child_pythonpath, config_path
from capsule_ros.serving.config import ServingConfig

REPO = Path(__file__).resolve().parents[2]
MAKER = REPO / "tools" / "lerobot_bench" / "make_vla_checkpoint.py"
STATE, FRONT, WRIST = "observation.state", "observation.images.front", "observation.images.wrist"
CAMERAS = (FRONT, WRIST, "observation.images.side")
TASK = "pick up the cube and put it in the bowl"
JOINTS = 6
OPTIONS: Dict[str, Any] = {"chunk_size": 50, "n_action_steps": 50, "num_steps": 10, "tokenizer_max_length": 48,
                           "pad_language_to": "longest"}
SPECS: Dict[str, Dict[str, Any]] = {
    "tiny": {"vlm": {}, "camera": (96, 128), "options": {"num_vlm_layers": 4, "resize_imgs_with_padding": [48, 48]}},
    "mid": {"vlm": {"text_hidden": 384, "text_layers": 8, "heads": 6, "kv_heads": 2, "head_dim": 64,
                    "text_intermediate": 1024, "vision_hidden": 256, "vision_layers": 4, "vision_heads": 4,
                    "vision_intermediate": 1024, "image_size": 224, "patch_size": 16},
            "camera": (240, 320), "options": {"num_vlm_layers": 8, "resize_imgs_with_padding": [224, 224]}},
    "real": {"vlm": {"text_hidden": 960, "text_layers": 32, "heads": 15, "kv_heads": 5, "head_dim": 64,
                     "text_intermediate": 2560, "vision_hidden": 768, "vision_layers": 12, "vision_heads": 12,
                     "vision_intermediate": 3072, "image_size": 512, "patch_size": 16, "scale_factor": 4,
                     "dtype": "bfloat16"},
             "camera": (480, 640), "options": {"num_vlm_layers": 16, "resize_imgs_with_padding": [512, 512]}},
}


def camera_keys(cameras: int = 2) -> Tuple[str, ...]:
    """The first ``cameras`` (1 to 3) camera features: front, wrist, side."""
    if not 1 <= cameras <= len(CAMERAS):
        raise ValueError(f"cameras = {cameras}: 1 to {len(CAMERAS)}")
    return CAMERAS[:cameras]


def ports_of(cameras: int = 2) -> Dict[str, str]:
    """Feature key -> the port that feeds it: the joints and each camera (its last name)."""
    return {STATE: "joints", **{key: key.rsplit(".", 1)[-1] for key in camera_keys(cameras)}}


def camera_of(size: str) -> Tuple[int, int]:
    height, width = SPECS[size]["camera"]
    return int(height), int(width)


def write_smolvla_checkpoint(root: Path, size: str, python: Path, cameras: int = 2) -> Path:
    """LeRobot writes ``root/pretrained_model`` and ``root/vlm`` (module docstring); returns the
    checkpoint directory. RuntimeError with LeRobot's last words when it fails."""
    spec = SPECS[size]
    height, width = spec["camera"]
    payload = {"vlm": spec["vlm"], "action_dim": JOINTS, "options": {**OPTIONS, **spec["options"]},
               "inputs": {STATE: ["walk", JOINTS], **{key: ["camera", height, width] for key in camera_keys(cameras)}}}
    env = {**os.environ, "PYTHONPATH": child_pythonpath(python), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(python), str(MAKER), "--out", str(root), "--spec", json.dumps(payload)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"LeRobot could not write the SmolVLA checkpoint: {done.stderr.strip()[-600:]}")
    return root / "pretrained_model"


def serving_config(checkpoint: Path) -> ServingConfig:
    """config/policy.yaml serving the checkpoint as docs/vla.md configures one: joint positions,
    its rgb8 cameras, a task port, ``policy.task``; the VLM's files beside the checkpoint."""
    from capsule_ros.config import load_params_file
    config = json.loads((checkpoint / "config.json").read_text())
    params = load_params_file(config_path("policy.yaml"))
    feeds = ports_of(sum(1 for f in config["input_features"].values() if f["type"] == "VISUAL"))
    ports: Dict[str, Any] = {"names": [*feeds.values(), "task"]}
    ports["joints"] = {"topic": "robot/joint_states", "type": "sensor_msgs/msg/JointState", "fields": ["position"],
                       "names": [f"joint_{i}" for i in range(JOINTS)], "shape": [JOINTS], "dtype": "float32"}
    for key in list(feeds)[1:]:
        _, height, width = config["input_features"][key]["shape"]
        ports[feeds[key]] = {"topic": f"robot/{feeds[key]}/image_raw", "type": "sensor_msgs/msg/Image",
                             "fields": ["data"], "shape": [height, width, 3], "dtype": "uint8", "encodings": ["rgb8"]}
    ports["task"] = {"topic": "robot/task", "type": "std_msgs/msg/String", "fields": ["data"],
                     "shape": [2, int(config["tokenizer_max_length"])], "dtype": "int64", "qos": "reliable"}
    params["ports"] = ports
    params["policy"] = {"kind": "lerobot_smolvla", "weights": "", "task": TASK,
                        "lerobot_smolvla": {"pretrained_model": str(checkpoint),
                                            "vlm_files": str(checkpoint.parent / "vlm"),
                                            "features": [f"{k}:{p}" for k, p in feeds.items()] + ["task:task"]}}
    params["control"].update(mode="timer", trigger_port="")
    params["capsules"]["directory"] = ""
    return ServingConfig.from_params(params)
