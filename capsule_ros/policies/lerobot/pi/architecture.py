"""The dimensions and options of a LeRobot π0 / π0.5 checkpoint, before anything is built.

LeRobot 0.6.1 (``lerobot/policies/pi0/modeling_pi0.py``, ``pi05/modeling_pi05.py``) sizes the model
from two names in config.json, ``paligemma_variant`` and ``action_expert_variant``, through
openpi's variant table (``get_gemma_config``: ``gemma_2b``, ``gemma_300m``), and fixes the
rest in ``PaliGemmaWithExpertModel.__init__``: transformers' default PaliGemma SigLIP tower
(1152 wide, 27 layers, 16 heads, patch 14) with its MLP set to 4304, a projection to the
VLM's width, a vocabulary of 257152. A checkpoint whose variants are LeRobot's gets
exactly those numbers here (``LEROBOT_VARIANTS``, ``PALIGEMMA_VISION``); one that names
other variants was made by a scaled-down LeRobot (tools/lerobot_fixtures/pi_scaled.py) and
gets its dimensions from its weights' shapes (``from_shapes``), with LeRobot's fixed
choices for what a shape cannot tell (8 query heads, the 16 SigLIP heads). Either way the
strict load that follows checks every tensor against the model these numbers build.

Everything is read from config.json and the safetensors header (names, shapes, dtypes;
no tensor data), and every refusal is one ConfigError naming the field or tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Tuple

import torch
from safetensors import SafetensorError, safe_open

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import MODEL_FILE, Checkpoint

# Parameter name prefixes in model.safetensors (LeRobot's PI0Policy / PI05Policy state dict)
PALIGEMMA = "model.paligemma_with_expert.paligemma."
VLM = PALIGEMMA + "model.language_model."
VISION = PALIGEMMA + "model.vision_tower.vision_model."
EXPERT = "model.paligemma_with_expert.gemma_expert."
# Saved by LeRobot, read by no inference path: PaliGemma's and the expert's language-model heads
UNUSED_AT_INFERENCE = (PALIGEMMA + "lm_head.", EXPERT + "lm_head.")

QUERY_HEADS = 8               # LeRobot's interleaved forward reshapes to 1 * 8 * head_dim
PALIGEMMA_VOCAB = 257152
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class GemmaDims:
    """One Gemma stack (openpi's ``gemma.Config``)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class VisionDims:
    """The SigLIP tower."""

    hidden: int
    layers: int
    mlp: int
    heads: int
    patch: int


LEROBOT_VARIANTS: Mapping[str, GemmaDims] = {
    "gemma_300m": GemmaDims(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
    "gemma_2b": GemmaDims(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256),
}
PALIGEMMA_VISION = VisionDims(hidden=1152, layers=27, mlp=4304, heads=16, patch=14)


@dataclass(frozen=True)
class PiArchitecture:
    """What builds a π0 / π0.5 model: its dimensions and the config fields that change numbers."""

    kind: str                         # "pi0" or "pi05"
    vlm: GemmaDims
    expert: GemmaDims
    vision: VisionDims
    vocab_size: int
    dtype: str                        # LeRobot's precision: float32, or bfloat16 with its float32 exceptions
    image_size: Tuple[int, int]       # image_resolution (square)
    empty_cameras: int
    chunk_size: int
    n_action_steps: int
    max_state_dim: int
    max_action_dim: int
    num_inference_steps: int
    min_period: float
    max_period: float
    tokenizer_max_length: int

    @property
    def adarms(self) -> bool:
        """π0.5's expert normalises with adaptive RMSNorm conditioned on the time."""
        return self.kind == "pi05"

    @property
    def image_tokens(self) -> int:
        return (self.image_size[0] // self.vision.patch) * (self.image_size[1] // self.vision.patch)


def header(path: Path) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor of a safetensors file, from its header."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such weights file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 - not a dict
                part = f.get_slice(name)
                out[name] = (tuple(int(d) for d in part.get_shape()), _DTYPE_OF[part.get_dtype()])
            return out
    except (SafetensorError, OSError, KeyError) as exc:
        raise ConfigError(f"{path}: not a valid safetensors file ({exc})") from None


_DTYPE_OF = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
             "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def _shape(shapes: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]], path: Path, name: str) -> Tuple[int, ...]:
    if name not in shapes:
        raise ConfigError(f"{path}: missing tensor {name!r}")
    return shapes[name][0]


def _layers(shapes: Mapping[str, object], prefix: str) -> int:
    indices = {int(name[len(prefix):].split(".")[0]) for name in shapes
               if name.startswith(prefix) and name[len(prefix):].split(".")[0].isdigit()}
    return max(indices) + 1 if indices else 0


def _gemma_from_shapes(shapes, path: Path, prefix: str) -> GemmaDims:
    q = _shape(shapes, path, prefix + "layers.0.self_attn.q_proj.weight")
    k = _shape(shapes, path, prefix + "layers.0.self_attn.k_proj.weight")
    gate = _shape(shapes, path, prefix + "layers.0.mlp.gate_proj.weight")
    head_dim = q[0] // QUERY_HEADS
    if q[0] % QUERY_HEADS or head_dim == 0 or k[0] % head_dim:
        raise ConfigError(f"{path}: {prefix}layers.0.self_attn q_proj {list(q)} / k_proj {list(k)} do not split into "
                          f"{QUERY_HEADS} query heads and whole key/value heads (LeRobot's π0 uses {QUERY_HEADS})")
    return GemmaDims(width=q[1], depth=_layers(shapes, prefix + "layers."), mlp_dim=gate[0], num_heads=QUERY_HEADS,
                     num_kv_heads=k[0] // head_dim, head_dim=head_dim)


def _variant(checkpoint: Checkpoint, field: str, shapes, path: Path, prefix: str) -> GemmaDims:
    name = checkpoint.field(field)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{checkpoint.directory}/config.json: {field} must name a Gemma variant "
                          f"({', '.join(LEROBOT_VARIANTS)})")
    return LEROBOT_VARIANTS[name] if name in LEROBOT_VARIANTS else _gemma_from_shapes(shapes, path, prefix)


def _int(checkpoint: Checkpoint, field: str, default: int, low: int = 1) -> int:
    value = checkpoint.field(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{checkpoint.directory}/config.json: {field} = {value!r}: must be an integer >= {low}")
    return value


def _float(checkpoint: Checkpoint, field: str, default: float) -> float:
    value = checkpoint.field(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{checkpoint.directory}/config.json: {field} = {value!r}: must be a positive number")
    return float(value)


def read_architecture(checkpoint: Checkpoint) -> PiArchitecture:
    """The architecture of a π0 / π0.5 checkpoint from config.json and the weights' header
    (module docstring). ConfigError names the field or tensor that does not fit."""
    where = f"{checkpoint.directory}/config.json"
    kind = checkpoint.policy_type
    if kind not in ("pi0", "pi05"):
        raise ConfigError(f"{where}: type {kind!r} is not a π0 / π0.5 checkpoint")
    dtype = checkpoint.field("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"{where}: dtype = {dtype!r}: LeRobot's π0 runs in {' or '.join(DTYPES)}")
    resolution = checkpoint.field("image_resolution", [224, 224])
    if (not isinstance(resolution, (list, tuple)) or len(resolution) != 2 or resolution[0] != resolution[1]
            or not all(isinstance(d, int) and d > 0 for d in resolution)):
        raise ConfigError(f"{where}: image_resolution = {resolution!r}: PaliGemma needs a square [n, n]")
    path = checkpoint.directory / MODEL_FILE
    shapes = header(path)
    vlm = _variant(checkpoint, "paligemma_variant", shapes, path, VLM)
    expert = _variant(checkpoint, "action_expert_variant", shapes, path, EXPERT + "model.")
    lerobot_sized = all(checkpoint.field(f) in LEROBOT_VARIANTS
                        for f in ("paligemma_variant", "action_expert_variant"))
    if lerobot_sized:
        vision, vocab = PALIGEMMA_VISION, PALIGEMMA_VOCAB
    else:
        patch = _shape(shapes, path, VISION + "embeddings.patch_embedding.weight")
        vision = VisionDims(hidden=patch[0], layers=_layers(shapes, VISION + "encoder.layers."),
                            mlp=_shape(shapes, path, VISION + "encoder.layers.0.mlp.fc1.weight")[0],
                            heads=PALIGEMMA_VISION.heads, patch=patch[2])
        vocab = _shape(shapes, path, VLM + "embed_tokens.weight")[0]
    if (vlm.head_dim, vlm.num_kv_heads) != (expert.head_dim, expert.num_kv_heads) or expert.depth > vlm.depth:
        raise ConfigError(f"{where}: the action expert ({expert}) cannot attend to the VLM's keys and values "
                          f"({vlm}): head_dim and num_kv_heads must agree and the expert cannot be deeper")
    if resolution[0] % vision.patch:
        raise ConfigError(f"{where}: image_resolution {resolution} is not a multiple of the SigLIP patch "
                          f"{vision.patch}")
    if checkpoint.field("use_relative_actions", False):
        raise ConfigError(f"{where}: use_relative_actions = true is not supported: LeRobot's relative actions keep "
                          "the processor's last state outside the policy (set it false, or serve absolute actions)")
    arch = PiArchitecture(
        kind=kind, vlm=vlm, expert=expert, vision=vision, vocab_size=vocab, dtype=dtype,
        image_size=(int(resolution[0]), int(resolution[1])), empty_cameras=_int(checkpoint, "empty_cameras", 0, 0),
        chunk_size=_int(checkpoint, "chunk_size", 50), n_action_steps=_int(checkpoint, "n_action_steps", 50),
        max_state_dim=_int(checkpoint, "max_state_dim", 32), max_action_dim=_int(checkpoint, "max_action_dim", 32),
        num_inference_steps=_int(checkpoint, "num_inference_steps", 10),
        min_period=_float(checkpoint, "min_period", 4e-3), max_period=_float(checkpoint, "max_period", 4.0),
        tokenizer_max_length=_int(checkpoint, "tokenizer_max_length", 48 if kind == "pi0" else 200))
    if arch.n_action_steps > arch.chunk_size:
        raise ConfigError(f"{where}: n_action_steps = {arch.n_action_steps} > chunk_size = {arch.chunk_size}")
    if checkpoint.action_dim > arch.max_action_dim:
        raise ConfigError(f"{where}: the action has {checkpoint.action_dim} values, more than max_action_dim = "
                          f"{arch.max_action_dim}")
    state = checkpoint.inputs.get("observation.state")
    if state is None:
        raise ConfigError(f"{where}: {kind} needs an 'observation.state' input feature")
    if kind == "pi0" and state.shape[0] > arch.max_state_dim:       # π0.5 has no state projection
        raise ConfigError(f"{where}: observation.state has {state.shape[0]} values, more than max_state_dim = "
                          f"{arch.max_state_dim}")
    return arch
