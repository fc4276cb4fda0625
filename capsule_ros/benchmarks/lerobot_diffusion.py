"""The Diffusion Policy checkpoint ``capsule-ros bench chunking`` serves, written without LeRobot.

A LeRobot ``pretrained_model/`` directory as LeRobot's ``save_pretrained`` writes it
(``benchmarks/lerobot_act.py`` writes the processor files the same way): config.json with
``DiffusionConfig``'s defaults (resnet18 with group norm, 32 keypoints, a U-Net of
(512, 1024, 2048) channels, horizon 16, 2 observation steps, 8 action steps, DDPM) but 10
inference steps, one RGB camera ``observation.images.top`` and 14 joint positions;
min/max statistics for state and action as DiffusionConfig's normalisation mapping wants;
``model.safetensors`` from capsule_ros's own Diffusion network, randomly initialised with
a fixed seed (a step's time does not depend on the weight values). ``quick`` shrinks the
U-Net and the camera to run in seconds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from capsule_ros.benchmarks.lerobot_act import ACTION, CAMERA, STATE, port_specs, write_config_and_processors

DIFFUSION_DEFAULTS: Dict[str, Any] = {
    "type": "diffusion", "n_obs_steps": 2, "horizon": 16, "n_action_steps": 8, "vision_backbone": "resnet18",
    "resize_shape": None, "crop_ratio": 1.0, "crop_shape": None, "crop_is_random": True,
    "pretrained_backbone_weights": None, "use_group_norm": True, "spatial_softmax_num_keypoints": 32,
    "use_separate_rgb_encoder_per_camera": False, "down_dims": [512, 1024, 2048], "kernel_size": 5, "n_groups": 8,
    "diffusion_step_embed_dim": 128, "use_film_scale_modulation": True, "noise_scheduler_type": "DDPM",
    "num_train_timesteps": 100, "beta_schedule": "squaredcos_cap_v2", "beta_start": 0.0001, "beta_end": 0.02,
    "prediction_type": "epsilon", "clip_sample": True, "clip_sample_range": 1.0, "num_inference_steps": 10,
    "compile_model": False, "drop_n_last_frames": 7,
    "normalization_mapping": {"VISUAL": "MEAN_STD", "STATE": "MIN_MAX", "ACTION": "MIN_MAX"},
}
DIFFUSION_QUICK = {"down_dims": [32, 64, 128], "diffusion_step_embed_dim": 32, "spatial_softmax_num_keypoints": 16}


def diffusion_config(camera: Tuple[int, int], joints: int = 14, actions: int = 14, quick: bool = False,
                     **overrides: Any) -> Dict[str, Any]:
    config = dict(DIFFUSION_DEFAULTS, **(DIFFUSION_QUICK if quick else {}), **overrides)
    config["input_features"] = {STATE: {"type": "STATE", "shape": [joints]},
                                CAMERA: {"type": "VISUAL", "shape": [3, *camera]}}
    config["output_features"] = {ACTION: {"type": "ACTION", "shape": [actions]}}
    return config


def write_diffusion_checkpoint(directory: Path, camera: Tuple[int, int], quick: bool = False, seed: int = 0,
                               **overrides: Any) -> Path:
    """Write the checkpoint into ``directory``; returns it."""
    from capsule_ros.policies.lerobot.checkpoint import read_normalization
    from capsule_ros.policies.lerobot.diffusion import DiffusionPolicy
    from capsule_ros.policies.lerobot.features import bind_features
    from capsule_ros.runtime.weights import save_weights
    checkpoint = write_config_and_processors(directory, diffusion_config(camera, quick=quick, **overrides))
    input_norms, action_norm = read_normalization(checkpoint)
    torch.manual_seed(seed)
    policy = DiffusionPolicy(checkpoint, bind_features(checkpoint, port_specs(checkpoint)), input_norms, action_norm)
    save_weights(directory / "model.safetensors",
                 {f"diffusion.{k}": v for k, v in policy.diffusion.state_dict().items()})
    return directory
