"""π0 / π0.5 checkpoints for benchmarks, written without LeRobot and without the hub.

A LeRobot 0.6.1 ``pretrained_model/`` directory as ``PI0Policy.save_pretrained`` and its
processors write it (config.json with ``PI0Config`` / ``PI05Config``'s fields, the processor
files with their statistics, ``model.safetensors`` with every tensor LeRobot's
``from_pretrained`` loads, its two unused language-model heads included, so that LeRobot
loads it strictly too), plus a tokenizer directory in PaliGemma's format
(``write_tokenizer``: a small byte-fallback vocabulary; PaliGemma's own cannot be
downloaded here, and a step's time does not depend on the vocabulary's size).

``PiSpec`` says what to build. ``PALIGEMMA_3B`` has the real architecture's dimensions
(LeRobot's variants ``gemma_2b`` + ``gemma_300m``, transformers' PaliGemma SigLIP tower, a
vocabulary of 257152) at LeRobot's bfloat16 precision; ``TINY`` the scaled-down dimensions
of the parity fixtures (``tools/lerobot_fixtures/pi_scaled.py`` makes LeRobot build those).
The weights are seeded: each tensor from its own generator (the seed and the tensor's
name), normal with a spread of 0.02 (layer-norm scales around 1), in the dtype LeRobot's
precision gives it; a step's time does not depend on their values. With ``device=cuda``
the draws run on the GPU (the 3B checkpoint is about 8 GB; it is written where it runs).
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from capsule_ros.policies.lerobot.pi.architecture import (
    EXPERT,
    LEROBOT_VARIANTS,
    PALIGEMMA,
    PALIGEMMA_VISION,
    PALIGEMMA_VOCAB,
    GemmaDims,
    PiArchitecture,
    VisionDims,
)

HUB_TOKENIZER = "google/paligemma-3b-pt-224"       # what a LeRobot π0 checkpoint's processor names
STATE, ACTION = "observation.state", "action"


@dataclass(frozen=True)
class PiSpec:
    """A benchmark checkpoint: the model's type, sizes and precision, and its inputs."""

    kind: str = "pi0"                                 # pi0 or pi05
    variants: Tuple[str, str] = ("gemma_2b", "gemma_300m")
    dims: Dict[str, GemmaDims] = field(default_factory=dict)   # scaled variants' dimensions (name -> dims)
    vision: VisionDims = PALIGEMMA_VISION
    vocab_size: int = PALIGEMMA_VOCAB
    dtype: str = "bfloat16"
    image_size: int = 224
    cameras: int = 1
    camera_shape: Tuple[int, int] = (224, 224)        # the ports' frames (resized with padding when not square)
    joints: int = 7
    actions: int = 7
    chunk_size: int = 50
    n_action_steps: int = 50

    def __post_init__(self) -> None:
        if self.kind not in ("pi0", "pi05"):
            raise ValueError(f"kind {self.kind!r}: pi0 or pi05")
        if not 1 <= self.cameras <= 3:
            raise ValueError(f"cameras = {self.cameras}: 1 to 3")

    def gemma(self, name: str) -> GemmaDims:
        return self.dims[name] if name in self.dims else LEROBOT_VARIANTS[name]

    @property
    def camera_keys(self) -> List[str]:
        return [f"observation.images.camera{i}" for i in range(self.cameras)]

    def architecture(self) -> PiArchitecture:
        return PiArchitecture(
            kind=self.kind, vlm=self.gemma(self.variants[0]), expert=self.gemma(self.variants[1]), vision=self.vision,
            vocab_size=self.vocab_size, dtype=self.dtype, image_size=(self.image_size, self.image_size),
            empty_cameras=0, chunk_size=self.chunk_size, n_action_steps=self.n_action_steps, max_state_dim=32,
            max_action_dim=32, num_inference_steps=10, min_period=4e-3, max_period=4.0,
            tokenizer_max_length=48 if self.kind == "pi0" else 200)


PALIGEMMA_3B = PiSpec()
TINY = PiSpec(variants=("scaled_vlm_64", "scaled_expert_32"),
              dims={"scaled_vlm_64": GemmaDims(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1,
                                               head_dim=16),
                    "scaled_expert_32": GemmaDims(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1,
                                                  head_dim=16)},
              vision=VisionDims(hidden=64, layers=2, mlp=128, heads=16, patch=8), vocab_size=512, dtype="float32",
              image_size=32, camera_shape=(48, 64), chunk_size=16, n_action_steps=8)


def with_cameras(spec: PiSpec, cameras: int) -> PiSpec:
    return replace(spec, cameras=cameras)


# ``capsule-ros bench chunking``'s π0 cases: two cameras, six joints and actions, LeRobot's chunk of
# 50 all executed; ``tiny`` the fixtures' dimensions, ``mid`` a 384-wide VLM and a 192-wide expert
# (6 layers each), a 256-wide 4-layer SigLIP on 112 x 112 images (64 tokens per camera), about a
# fifth of PaliGemma-3B's VLM width
BENCH = {
    "tiny": replace(TINY, cameras=2, joints=6, actions=6, chunk_size=50, n_action_steps=50),
    "mid": replace(TINY, variants=("scaled_vlm_384", "scaled_expert_192"),
                   dims={"scaled_vlm_384": GemmaDims(width=384, depth=6, mlp_dim=1536, num_heads=8, num_kv_heads=1,
                                                     head_dim=64),
                         "scaled_expert_192": GemmaDims(width=192, depth=6, mlp_dim=768, num_heads=8, num_kv_heads=1,
                                                        head_dim=64)},
                   vision=VisionDims(hidden=256, layers=4, mlp=1024, heads=16, patch=14), vocab_size=512,
                   image_size=112, camera_shape=(240, 320), cameras=2, joints=6, actions=6, chunk_size=50,
                   n_action_steps=50),
}
BENCH_TASK = "pick up the red cube"


def bench_spec(kind: str, size: str) -> PiSpec:
    return replace(BENCH[size], kind=kind)


def serving_config(checkpoint: Path, tokenizer: Path, task: str = BENCH_TASK):
    """config/policy.yaml serving a π0 / π0.5 checkpoint as docs/vla.md configures one: joint
    positions, its rgb8 cameras, a task port and ``policy.task``."""
    from capsule_ros.benchmarks.common import config_path
    from capsule_ros.config import load_params_file
    from capsule_ros.serving.config import ServingConfig
    config = json.loads((checkpoint / "config.json").read_text())
    joints = int(config["input_features"][STATE]["shape"][0])
    cameras = [key for key, f in config["input_features"].items() if f["type"] == "VISUAL"]
    ports: Dict[str, Any] = {"names": ["joints", *(port_of(key) for key in cameras), "task"]}
    ports["joints"] = {"topic": "robot/joint_states", "type": "sensor_msgs/msg/JointState", "fields": ["position"],
                       "names": [f"joint_{i}" for i in range(joints)], "shape": [joints], "dtype": "float32"}
    for key in cameras:
        _, height, width = config["input_features"][key]["shape"]
        ports[port_of(key)] = {"topic": f"robot/{port_of(key)}/image_raw", "type": "sensor_msgs/msg/Image",
                               "fields": ["data"], "shape": [height, width, 3], "dtype": "uint8",
                               "encodings": ["rgb8"]}
    ports["task"] = {"topic": "robot/task", "type": "std_msgs/msg/String", "fields": ["data"],
                     "shape": [2, int(config["tokenizer_max_length"])], "dtype": "int64", "qos": "reliable"}
    kind = f"lerobot_{config['type']}"
    params = load_params_file(config_path("policy.yaml"))
    params["ports"] = ports
    params["policy"] = {"kind": kind, "weights": "", "task": task,
                        kind: {"pretrained_model": str(checkpoint), "vlm_files": str(tokenizer),
                               "features": [f"{STATE}:joints", *(f"{k}:{port_of(k)}" for k in cameras), "task:task"]}}
    params["control"].update(mode="timer", trigger_port="")
    params["capsules"]["directory"] = ""
    return ServingConfig.from_params(params)


def port_of(key: str) -> str:
    """observation.images.camera0 -> camera0."""
    return key.rsplit(".", 1)[-1]


# --- the files ----------------------------------------------------------------------------------

def pi_config(spec: PiSpec) -> Dict[str, Any]:
    """config.json: ``PI0Config`` / ``PI05Config``'s fields as LeRobot 0.6.1 saves them."""
    arch = spec.architecture()
    height, width = spec.camera_shape
    inputs = {STATE: {"type": "STATE", "shape": [spec.joints]}}
    inputs.update({key: {"type": "VISUAL", "shape": [3, height, width]} for key in spec.camera_keys})
    norm = "MEAN_STD" if spec.kind == "pi0" else "QUANTILES"
    return {
        "type": spec.kind, "n_obs_steps": 1, "input_features": inputs,
        "output_features": {ACTION: {"type": "ACTION", "shape": [spec.actions]}}, "device": "cpu", "use_amp": False,
        "use_peft": False, "push_to_hub": False, "repo_id": None, "private": None, "tags": None, "license": None,
        "pretrained_path": None, "pretrained_revision": None, "paligemma_variant": spec.variants[0],
        "action_expert_variant": spec.variants[1], "dtype": spec.dtype, "chunk_size": spec.chunk_size,
        "n_action_steps": spec.n_action_steps, "max_state_dim": arch.max_state_dim,
        "max_action_dim": arch.max_action_dim, "num_inference_steps": arch.num_inference_steps,
        "time_sampling_beta_alpha": 1.5, "time_sampling_beta_beta": 1.0, "time_sampling_scale": 0.999,
        "time_sampling_offset": 0.001, "min_period": arch.min_period, "max_period": arch.max_period,
        "use_relative_actions": False, "relative_exclude_joints": ["gripper"], "action_feature_names": None,
        "rtc_config": None, "image_resolution": [spec.image_size, spec.image_size], "empty_cameras": 0,
        "tokenizer_max_length": arch.tokenizer_max_length,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": norm, "ACTION": norm},
        "gradient_checkpointing": False, "compile_model": False, "compile_mode": "max-autotune",
        "freeze_vision_encoder": False, "train_expert_only": False, "optimizer_lr": 2.5e-05,
        "optimizer_betas": [0.9, 0.95], "optimizer_eps": 1e-08, "optimizer_weight_decay": 0.01,
        "optimizer_grad_clip_norm": 1.0, "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30000,
        "scheduler_decay_lr": 2.5e-06,
    }


def _statistics(spec: PiSpec) -> Dict[str, torch.Tensor]:
    """Per vector feature mean / std and the quantiles (both modes' statistics)."""
    gen = torch.Generator().manual_seed(1)
    out: Dict[str, torch.Tensor] = {}
    for key, n in ((STATE, spec.joints), (ACTION, spec.actions)):
        mean, spread = torch.randn(n, generator=gen) * 0.3, torch.rand(n, generator=gen) + 0.5
        out.update({f"{key}.mean": mean, f"{key}.std": spread, f"{key}.min": mean - 3 * spread,
                    f"{key}.max": mean + 3 * spread, f"{key}.q01": mean - 2 * spread, f"{key}.q99": mean + 2 * spread,
                    f"{key}.q10": mean - spread, f"{key}.q90": mean + spread})
    return out


def _pipelines(spec: PiSpec, config: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The pre- and post-processor files as LeRobot's ``make_pi0_pre_post_processors`` /
    ``make_pi05_pre_post_processors`` save them."""
    features = {**config["input_features"], **config["output_features"]}
    norm = {"eps": 1e-08, "features": features, "norm_map": config["normalization_mapping"]}
    device = {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}
    relative = {"registry_name": "relative_actions_processor",
                "config": {"enabled": False, "exclude_joints": ["gripper"], "action_names": None}}
    tokenizer = {"registry_name": "tokenizer_processor",
                 "config": {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right",
                            "padding": "max_length", "truncation": True, "tokenizer_name": HUB_TOKENIZER}}
    head = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}}]
    if spec.kind == "pi0":
        steps = [*head, {"registry_name": "pi0_new_line_processor", "config": {}}, tokenizer, device, relative,
                 {"registry_name": "normalizer_processor", "config": norm}]
    else:
        steps = [*head, relative, {"registry_name": "normalizer_processor", "config": norm},
                 {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}}, tokenizer, device]
    index = next(i for i, step in enumerate(steps) if step["registry_name"] == "normalizer_processor")
    steps[index]["state_file"] = f"policy_preprocessor_step_{index}_normalizer_processor.safetensors"
    post = [{"registry_name": "unnormalizer_processor",
             "config": dict(norm, features={ACTION: config["output_features"][ACTION]}),
             "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"},
            {"registry_name": "absolute_actions_processor", "config": {"enabled": False}}, device]
    return {"policy_preprocessor": {"name": "policy_preprocessor", "steps": steps},
            "policy_postprocessor": {"name": "policy_postprocessor", "steps": post}}


def tensor_specs(spec: PiSpec) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor LeRobot's π0 / π0.5 saves for ``spec``: the
    model capsule_ros builds (on the meta device: nothing allocated) and the two LM heads."""
    from capsule_ros.policies.lerobot.pi.model import PiModel
    arch = spec.architecture()
    with torch.device("meta"):
        model = PiModel(arch)
    shapes = {f"model.{name}": (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    head_dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    shapes[PALIGEMMA + "lm_head.weight"] = ((arch.vocab_size, arch.vlm.width), head_dtype)
    shapes[EXPERT + "lm_head.weight"] = ((arch.vocab_size, arch.expert.width), head_dtype)
    return shapes


def seeded_weights(spec: PiSpec, seed: int, device: str = "cpu") -> Dict[str, torch.Tensor]:
    """Every tensor LeRobot's π0 / π0.5 saves, by its name, seeded (module docstring)."""
    out = {}
    for name, (shape, dtype) in sorted(tensor_specs(spec).items()):
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        values = torch.randn(shape, generator=gen, device=device) * 0.02
        if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
            values += 1.0                               # SigLIP's LayerNorm scales (Gemma's RMSNorm uses 1 + w)
        out[name] = values.to(dtype).cpu()
    return out


def write_tokenizer(directory: Path) -> int:
    """A tokenizer in the format LeRobot's processor loads for PaliGemma (transformers'
    ``GemmaTokenizer``: byte-fallback BPE, ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2 added in
    front, ``<unk>`` 3): the byte tokens, letters, digits (never merged, as Gemma splits
    digits), punctuation, the newline and merges for a few words. Returns its size."""
    from transformers import GemmaTokenizer

    vocab, merges = tokenizer_vocab()
    pairs: Any = merges                     # tokenizers' BPE takes (left, right) pairs
    tokenizer = GemmaTokenizer(vocab=vocab, merges=pairs, add_bos_token=True, add_eos_token=False)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return len(tokenizer)


SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
PUNCTUATION = ",.:;!?'-()_"
WORDS = ("Task", "State", "Action", "▁pick", "▁up", "▁the", "▁cube", "▁place", "▁red", "▁blue", "▁on", "▁put",
         "▁block", "▁green", "▁stack", "▁it", "▁and", "▁then", "▁open", "▁drawer", "▁close", "▁gripper")


def tokenizer_vocab() -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """(vocab, merges) of ``write_tokenizer``."""
    vocab: Dict[str, int] = {token: i for i, token in enumerate(SPECIAL)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    for token in ["▁", "\n", *letters, *"0123456789", *PUNCTUATION]:
        vocab.setdefault(token, len(vocab))
    merges: List[Tuple[str, str]] = []
    for word in WORDS:
        current = word[0]
        for char in word[1:]:
            joined = current + char
            if joined not in vocab:
                vocab[joined] = len(vocab)
                merges.append((current, char))
            current = joined
    return vocab, merges


def write_pi_checkpoint(root: Path, spec: PiSpec = PALIGEMMA_3B, seed: int = 0, device: str = "cpu",
                        weights_from: Optional[Path] = None) -> Tuple[Path, Path]:
    """Write ``root/pretrained_model`` (the checkpoint) and ``root/paligemma_tokenizer`` (its
    tokenizer files, what ``vlm_files`` names); returns both directories. ``weights_from``:
    another checkpoint directory of the same model whose ``model.safetensors`` is linked
    instead of drawn again (the weights do not depend on the number of cameras; the 3B file
    is about 8 GB)."""
    from capsule_ros.runtime.weights import save_weights
    directory = root / "pretrained_model"
    directory.mkdir(parents=True, exist_ok=True)
    config = pi_config(spec)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    statistics = _statistics(spec)
    for name, pipeline in _pipelines(spec, config).items():
        (directory / f"{name}.json").write_text(json.dumps(pipeline, indent=2))
        for step in pipeline["steps"]:
            if "state_file" in step:
                keys = step["config"]["features"]
                save_weights(directory / step["state_file"],
                             {k: v for k, v in statistics.items() if k.rsplit(".", 1)[0] in keys})
    if weights_from is not None:
        os.link(weights_from / "model.safetensors", directory / "model.safetensors")
    else:
        save_weights(directory / "model.safetensors", seeded_weights(spec, seed, device))
    write_tokenizer(root / "paligemma_tokenizer")
    return directory, root / "paligemma_tokenizer"
