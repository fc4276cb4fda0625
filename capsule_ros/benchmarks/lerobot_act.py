"""The ACT checkpoint ``capsule-ros bench step --policy act`` serves, written without LeRobot.

A LeRobot ``pretrained_model/`` directory in the files and layout LeRobot 0.4's
``save_pretrained`` writes (``capsule_ros.policies.lerobot.checkpoint``): config.json with
``ACTConfig``'s defaults (resnet18, dim_model 512, 8 heads, feed-forward 3200, 4 encoder
layers, 1 decoder layer, chunk_size = n_action_steps = 100, no temporal ensembling) and
the shapes of LeRobot's ALOHA simulation checkpoints (one 480 x 640 RGB camera
``observation.images.top``, 14 joint positions, 14 actions); the processor files with
mean/std statistics; ``model.safetensors`` from capsule_ros's own ACT network, randomly
initialised with a fixed seed (a step's time does not depend on the weight values; the
trunk is not ImageNet's, which cannot be downloaded here). ``--quick`` shrinks it
(dim_model 128, one encoder layer, a 96 x 128 camera) to run in seconds on a CPU.

The bench serves the directory through ``policy.kind: lerobot_act`` and the factory, as
policy_node does, so the load path (config checks, statistics, strict weight loading by
LeRobot's names) is the one a user's checkpoint takes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from capsule_ros.benchmarks.common import config_path
from capsule_ros.serving.config import ServingConfig

STATE, CAMERA, ACTION = "observation.state", "observation.images.top", "action"
PORTS = {STATE: "joints", CAMERA: "top_camera"}
ALOHA: Dict[str, Any] = {"joints": 14, "actions": 14, "camera": (480, 640)}
QUICK: Dict[str, Any] = {"joints": 14, "actions": 14, "camera": (96, 128)}
# ACTConfig's defaults (LeRobot 0.4.4) for every field the inference reads
ACT_DEFAULTS: Dict[str, Any] = {
    "type": "act", "n_obs_steps": 1, "chunk_size": 100, "n_action_steps": 100, "vision_backbone": "resnet18",
    "pretrained_backbone_weights": None, "replace_final_stride_with_dilation": False, "pre_norm": False,
    "dim_model": 512, "n_heads": 8, "dim_feedforward": 3200, "feedforward_activation": "relu",
    "n_encoder_layers": 4, "n_decoder_layers": 1, "use_vae": True, "latent_dim": 32, "n_vae_encoder_layers": 4,
    "temporal_ensemble_coeff": None, "dropout": 0.1,
    "normalization_mapping": {"VISUAL": "MEAN_STD", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
}
ACT_QUICK = {"dim_model": 128, "n_heads": 4, "dim_feedforward": 512, "n_encoder_layers": 1}
IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def act_config(quick: bool, features: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """config.json of the benchmark checkpoint; ``features``: other ``input_features`` and
    ``output_features`` (as config.json writes them) instead of ALOHA's."""
    shapes = QUICK if quick else ALOHA
    height, width = shapes["camera"]
    config = dict(ACT_DEFAULTS, **(ACT_QUICK if quick else {}))
    config["input_features"] = {STATE: {"type": "STATE", "shape": [shapes["joints"]]},
                                CAMERA: {"type": "VISUAL", "shape": [3, height, width]}}
    config["output_features"] = {ACTION: {"type": "ACTION", "shape": [shapes["actions"]]}}
    config.update(features or {})
    return config


def _statistics(config: Dict[str, Any], keys) -> Dict[str, torch.Tensor]:
    """The statistics each feature's normalisation mode reads: mean/std (ImageNet's for a
    camera, spread-out values for vectors) or min/max (a camera's [0, 1], [-2, 2]-ish ranges
    for vectors)."""
    gen = torch.Generator().manual_seed(1)
    features = {**config["input_features"], **config["output_features"]}
    out = {}
    for key in keys:
        shape, kind = features[key]["shape"], features[key]["type"]
        mode = config["normalization_mapping"][kind]
        if mode == "MIN_MAX":
            low = torch.zeros(3, 1, 1) if kind == "VISUAL" else -1.5 - torch.rand(shape, generator=gen)
            out[f"{key}.min"], out[f"{key}.max"] = low, (torch.ones(3, 1, 1) if kind == "VISUAL" else -low)
        elif kind == "VISUAL":
            out[f"{key}.mean"] = torch.tensor(IMAGENET[0]).reshape(3, 1, 1)
            out[f"{key}.std"] = torch.tensor(IMAGENET[1]).reshape(3, 1, 1)
        else:
            out[f"{key}.mean"] = torch.randn(shape, generator=gen)
            out[f"{key}.std"] = torch.rand(shape, generator=gen) + 0.5
    return out


def _pipeline(name: str, registry_name: str, config: Dict[str, Any], keys) -> Dict[str, Any]:
    """A processor pipeline as LeRobot's ACT writes it, the (un)normaliser's statistics in
    ``<name>_step_<index>_<registry name>.safetensors``."""
    features = {**config["input_features"], **config["output_features"]}
    device = {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}
    before = ([{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
               {"registry_name": "to_batch_processor", "config": {}}, device]
              if registry_name == "normalizer_processor" else [])
    after = [] if before else [device]
    step = {"registry_name": registry_name,
            "config": {"eps": 1e-8, "features": {k: features[k] for k in keys},
                       "norm_map": config["normalization_mapping"]},
            "state_file": f"{name}_step_{len(before)}_{registry_name}.safetensors"}
    return {"name": name, "steps": [*before, step, *after]}


def write_config_and_processors(directory: Path, config: Dict[str, Any]):
    """config.json and the processor files of a checkpoint (``_pipeline``, ``_statistics``);
    returns it read back (``policies.lerobot.checkpoint.read_checkpoint``)."""
    from capsule_ros.policies.lerobot.checkpoint import read_checkpoint
    from capsule_ros.runtime.weights import save_weights
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    inputs = list(config["input_features"])
    for name, registry_name, keys in (("policy_preprocessor", "normalizer_processor", inputs + [ACTION]),
                                      ("policy_postprocessor", "unnormalizer_processor", [ACTION])):
        pipeline = _pipeline(name, registry_name, config, keys)
        (directory / f"{name}.json").write_text(json.dumps(pipeline, indent=2))
        state_file = next(step["state_file"] for step in pipeline["steps"] if "state_file" in step)
        save_weights(directory / state_file, _statistics(config, keys))
    return read_checkpoint(directory)


def port_specs(checkpoint) -> Dict[str, Any]:
    """{feature key: the INPUT buffer of the port that feeds it} (``PORTS`` names)."""
    from capsule_ros.policies.lerobot.features import port_shape_for
    from capsule_ros.runtime.arena import BufferKind, BufferSpec
    specs = {}
    for key, feature in checkpoint.inputs.items():
        shape, dtype = port_shape_for(feature.type, feature.shape)
        specs[key] = BufferSpec(PORTS.get(key, key.replace(".", "_")), shape, dtype, BufferKind.INPUT)
    return specs


def write_act_checkpoint(directory: Path, quick: bool = False, seed: int = 0,
                         features: Optional[Dict[str, Any]] = None) -> Path:
    """Write the benchmark's ``pretrained_model/`` into ``directory`` (``features``: see
    ``act_config``); returns it."""
    from capsule_ros.policies.lerobot.act import ACTPolicy
    from capsule_ros.policies.lerobot.checkpoint import read_normalization
    from capsule_ros.policies.lerobot.features import bind_features
    from capsule_ros.runtime.weights import save_weights
    config = act_config(quick, features)
    checkpoint = write_config_and_processors(directory, config)
    specs = port_specs(checkpoint)
    input_norms, action_norm = read_normalization(checkpoint)
    torch.manual_seed(seed)
    policy = ACTPolicy(checkpoint, bind_features(checkpoint, specs), input_norms, action_norm)
    with torch.no_grad():          # the attention projections are allocated empty (a checkpoint fills them):
        for name, param in policy.model.named_parameters():         # nn.MultiheadAttention's initialisation
            if name.endswith("in_proj_weight"):
                nn.init.xavier_uniform_(param)
            elif name.endswith("in_proj_bias"):
                param.zero_()
    save_weights(directory / "model.safetensors", {f"model.{k}": v for k, v in policy.model.state_dict().items()})
    return directory


def serving_params(checkpoint: Path) -> Dict[str, Any]:
    """config/policy.yaml's parameters serving the checkpoint (ACT or Diffusion): joint
    positions and an rgb8 camera, as the guide (docs/lerobot.md) configures them."""
    from capsule_ros.config import load_params_file
    config = json.loads((checkpoint / "config.json").read_text())
    joints = config["input_features"][STATE]["shape"][0]
    _, height, width = config["input_features"][CAMERA]["shape"]
    params = load_params_file(config_path("policy.yaml"))
    params["ports"] = {
        "names": list(PORTS.values()),
        "joints": {"topic": "robot/joint_states", "type": "sensor_msgs/msg/JointState", "fields": ["position"],
                   "names": [f"joint_{i}" for i in range(joints)], "shape": [joints], "dtype": "float32"},
        "top_camera": {"topic": "robot/top/image_raw", "type": "sensor_msgs/msg/Image", "fields": ["data"],
                       "shape": [height, width, 3], "dtype": "uint8", "encodings": ["rgb8"]},
    }
    kind = {"act": "lerobot_act", "diffusion": "lerobot_diffusion"}[config["type"]]
    params["policy"] = {"kind": kind, "weights": "",
                        kind: {"pretrained_model": str(checkpoint),
                               "features": [f"{key}:{port}" for key, port in PORTS.items()]}}
    params["capsules"]["directory"] = ""
    return params


def serving_config(checkpoint: Path) -> ServingConfig:
    """``serving_params`` as a configuration."""
    return ServingConfig.from_params(serving_params(checkpoint))


def checkpoint_summary(checkpoint: Path) -> Dict[str, Any]:
    """The architecture fields and shapes a reader of the figures needs."""
    config = json.loads((checkpoint / "config.json").read_text())
    keys = ("vision_backbone", "dim_model", "n_heads", "dim_feedforward", "n_encoder_layers", "n_decoder_layers",
            "chunk_size", "n_action_steps")
    return {**{k: config[k] for k in keys}, "inputs": {k: v["shape"] for k, v in config["input_features"].items()},
            "action": config["output_features"][ACTION]["shape"]}
