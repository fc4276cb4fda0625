"""SmolVLA as LeRobot 0.6.1 runs it at inference, as a StatefulPolicy (``VLAPolicy``).

Reused, not rewritten: the VLM is transformers' ``SmolVLMForConditionalGeneration`` built
from the VLM's own ``config.json`` exactly as LeRobot's ``SmolVLMWithExpertModel`` builds it
(``load_vlm_weights: false``), its text model cut to ``num_vlm_layers``; the action expert is
``AutoModel.from_config`` of LeRobot's copy of the text config (hidden size times
``expert_width_multiplier``, its intermediate size, its layer count), with LeRobot's
cross-attention key/value projections; the projections around them are ``nn.Linear``. So
the vision tower (``SmolVLMVisionTransformer``: patch embedding, SigLIP encoder layers with
transformers' attention, post layer norm), the connector (pixel shuffle + projection), the
text embedding and every decoder layer's norms, projections and MLP are transformers'
modules with transformers' kernels, in the dtypes LeRobot gets (a text config in bfloat16
makes the text model and the expert bfloat16, the rest float32), and the checkpoint's
weights load into them by LeRobot's parameter names.

Written by hand, as LeRobot writes them by hand (``modeling_smolvla.py``,
``smolvlm_with_expert.py``, ``common/vla_utils.py``): the image preparation
(``resize_with_pad``, [0, 1] -> [-1, 1]), the prefix embedding, the interleaved VLM / expert
forward (``forward_attn_layer``, ``forward_cross_attn_layer``, their eager attention and RoPE),
the suffix embedding and the denoising loop (``capsule_ros.policies.vla``), operation for
operation, including the layouts of the key/value cache (transformers' ``DynamicCache``
stores [B, heads, L, D]; the same concatenations are made here), so that the kernels see
the same operands. Three of transformers' forwards are written out here, with their
modules and operations, so that their independent projections can run side by side on a
GPU (``SideBySide``): the vision encoder layer's (query, key and value), the decoder
layers' attention (query, key and value) and ``LlamaMLP``'s (gate and up); other layer or
MLP types are refused at build. What LeRobot computes on the host for each chunk or step (attention
pattern lists, special-token ids, the image scale, the times, the vision tower's patch
position ids, its all-ones attention mask) is computed once at build, with the same
operations, and kept as constant buffers; the one remaining host read is the task's token
count with ``padding: longest`` on a CPU (``VLAPolicy.task_tokens``).

The prefix K/V (per layer [1, heads, P, D]) and the expert's cross-attention keys and values
(the same for every Euler step of a chunk, so computed once per chunk, as the same
operations on the same operands) are scratch of one plan. Skipped, as their results are
never read: the last VLM layer's attention output and MLP over the prefix, the final
norms of the VLM's prefix pass.
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import Checkpoint, Normalization
from capsule_ros.policies.lerobot.features import BoundInput
from capsule_ros.policies.vla.policy import VLAPolicy
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.policies.vla.side_by_side import check_encoder_layers, encoder_layer, gated_mlp
from capsule_ros.policies.vla.tokens import TaskTokenizer
from capsule_ros.runtime.arena import BufferSpec
from capsule_ros.runtime.policy import State

OBS_STATE = "observation.state"
LM_HEAD = "model.vlm_with_expert.vlm.lm_head."     # in every SmolVLA checkpoint, never read at inference
BUFFER_NAMES: tuple = ()


def check_config(checkpoint: Checkpoint) -> None:
    """Refuse SmolVLA options this implementation does not reproduce, naming the field."""
    c = checkpoint.field
    for name, bad in (("adapt_to_pi_aloha", True), ("use_delta_joint_actions_aloha", True)):
        if c(name, False) == bad:
            raise ConfigError(f"SmolVLA {name} = true is not supported")
    if int(c("empty_cameras", 0) or 0):
        raise ConfigError(f"SmolVLA empty_cameras = {c('empty_cameras')}: not supported (map a camera port to "
                          "every image feature)")
    if c("n_obs_steps", 1) != 1:
        raise ConfigError(f"SmolVLA n_obs_steps = {c('n_obs_steps')}: only 1 is supported")
    if c("attention_mode", "cross_attn") not in ("cross_attn", "self_attn"):
        raise ConfigError(f"SmolVLA attention_mode = {c('attention_mode')!r}: 'cross_attn' or 'self_attn'")
    if OBS_STATE not in checkpoint.inputs:
        raise ConfigError(f"SmolVLA needs an {OBS_STATE!r} input feature")
    if not any(f.type == "VISUAL" for f in checkpoint.inputs.values()):
        raise ConfigError("SmolVLA needs at least one camera (VISUAL) input feature")
    if c("use_cache", True) is not True:
        raise ConfigError("SmolVLA use_cache = false is not supported (LeRobot's inference uses the cache)")


# --- LeRobot's hand-written functions, operation for operation ------------------------------------

@dataclass(frozen=True)
class RopeAngles:
    """The sines and cosines ``smolvlm_with_expert.apply_rope`` makes for positions [B, L] and
    a head width: the same for every layer that rotates at those positions, so a chunk makes
    them once per position set instead of once per layer and denoising step (the same
    operations on the same inputs: the same bits). Kept as full-width rows for ``rotate``:
    ``cos`` is [cos, cos] and ``sin`` is [-sin, sin] along the head (float32 [B, L, 1, D])."""

    sin: torch.Tensor
    cos: torch.Tensor

    @classmethod
    def of(cls, positions: torch.Tensor, head_dim: int, max_wavelength: int = 10_000) -> RopeAngles:
        d_half = head_dim // 2
        freq_exponents = (2.0 / head_dim) * torch.arange(d_half, dtype=torch.float32, device=positions.device)
        timescale = max_wavelength ** freq_exponents
        radians = positions[..., None].to(torch.float32) / timescale[None, None, :].to(torch.float32)
        radians = radians[..., None, :]
        sin, cos = torch.sin(radians), torch.cos(radians)
        return cls(torch.cat([-sin, sin], dim=-1), torch.cat([cos, cos], dim=-1))


def rotate(x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
    """``apply_rope``'s rotation of x [B, L, H, D] (RoPE) by the angles of its positions.

    LeRobot writes each half: ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``. Here the
    same products and sums run over whole contiguous rows, ``x * [cos, cos] + [x2, x1] *
    [-sin, sin]``: each element is the same rounded product, and ``a - b`` is exactly ``a +
    (-b)`` in IEEE arithmetic (signed zeros included), so the bits are LeRobot's, in 4 kernels
    instead of 8 strided ones."""
    if angles.cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"RoPE angles for heads of {angles.cos.shape[-1]}, applied to heads of {x.shape[-1]}")
    dtype = x.dtype
    x = x.to(torch.float32)
    x1, x2 = x.split(x.shape[-1] // 2, dim=-1)
    swapped = torch.cat([x2, x1], dim=-1)
    return (x * angles.cos + swapped * angles.sin).to(dtype)


def _projected(proj: nn.Module, normed: torch.Tensor, shape: Tuple[int, ...],
               angles: Optional[RopeAngles]) -> torch.Tensor:
    """A query, key or value projection viewed as heads, rotated by ``angles`` where given."""
    state = proj(normed).view(shape)
    return rotate(state, angles) if angles is not None else state


def make_att_2d_masks(pad_masks: torch.Tensor, att_masks: torch.Tensor) -> torch.Tensor:
    """``vla_utils.make_att_2d_masks`` (big_vision's prefix-LM pattern)."""
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    return att_2d_masks & pad_2d_masks


def resize_with_pad(img: torch.Tensor, height: int, width: int, pad_value: float) -> torch.Tensor:
    """``vla_utils.resize_with_pad``: bilinear resize keeping the aspect ratio, padded on the
    left and top (SmolVLA's convention)."""
    current_height, current_width = img.shape[2:]
    if current_height == height and current_width == width:
        return img
    ratio = max(current_width / width, current_height / height)
    resized_height = int(current_height / ratio)
    resized_width = int(current_width / ratio)
    resized_img = F.interpolate(img, size=(resized_height, resized_width), mode="bilinear", align_corners=False)
    pad_height = max(0, height - resized_height)
    pad_width = max(0, width - resized_width)
    return F.pad(resized_img, (pad_width, 0, pad_height, 0), value=pad_value)


def sinusoidal_time_embedding(time: torch.Tensor, dimension: int, min_period: float, max_period: float) -> torch.Tensor:
    """``vla_utils.create_sinusoidal_pos_embedding`` for a time [B] (float64 on CPU and CUDA)."""
    dtype = torch.float32 if time.device.type == "mps" else torch.float64
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=dtype, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    scaling_factor = 1.0 / period * 2 * math.pi
    sin_input = scaling_factor[None, :] * time[:, None]
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)


def eager_attention(attention_mask: torch.Tensor, heads: int, kv_heads: int, query_states: torch.Tensor,
                    key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
    """``SmolVLMWithExpertModel.eager_attention_forward``: grouped-query attention upcast to float32."""
    keys, values = grouped_keys_values(key_states, value_states, heads, kv_heads)
    return attend(attention_mask, query_states, keys, values)


def grouped_keys_values(key_states: torch.Tensor, value_states: torch.Tensor, heads: int,
                        kv_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``eager_attention_forward``'s first half: keys and values [B, L, kv_heads, D] repeated
    to every query head (keys upcast to float32): [B, L, heads, D], contiguous. Exact copies,
    so a chunk groups a fixed prefix's once and concatenates each step's suffix to them."""
    batch_size, sequence_length, _, head_dim = key_states.shape
    groups = heads // kv_heads
    key_states = key_states[:, :, :, None, :].expand(batch_size, sequence_length, kv_heads, groups, head_dim)
    key_states = key_states.reshape(batch_size, sequence_length, kv_heads * groups, head_dim)
    value_states = value_states[:, :, :, None, :].expand(batch_size, sequence_length, kv_heads, groups, head_dim)
    value_states = value_states.reshape(batch_size, sequence_length, kv_heads * groups, head_dim)
    return key_states.to(dtype=torch.float32), value_states


def attend(attention_mask: torch.Tensor, query_states: torch.Tensor, key_states: torch.Tensor,
           value_states: torch.Tensor) -> torch.Tensor:
    """``eager_attention_forward``'s second half, over grouped keys and values."""
    batch_size, _, heads, head_dim = key_states.shape
    query_states = query_states.to(dtype=torch.float32)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    att_weights = torch.matmul(query_states, key_states.transpose(2, 3))
    att_weights *= head_dim ** -0.5
    att_weights = att_weights.to(dtype=torch.float32)
    big_neg = torch.finfo(att_weights.dtype).min
    masked_att_weights = torch.where(attention_mask[:, None, :, :], att_weights, big_neg)
    probs = nn.functional.softmax(masked_att_weights, dim=-1)
    probs = probs.to(dtype=value_states.dtype)
    att_output = torch.matmul(probs, value_states.permute(0, 2, 1, 3))
    att_output = att_output.permute(0, 2, 1, 3)
    return att_output.reshape(batch_size, -1, heads * head_dim)


def get_intermediate_size(hidden_dim: int, ffn_dim_multiplier: int = 4, multiple_of: int = 256) -> int:
    """``smolvlm_with_expert.get_intermediate_size``: the expert's MLP width."""
    hidden_dim = int(2 * hidden_dim / 3)
    hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


# --- the modules, as LeRobot builds them -------------------------------------------------------------

@dataclass(frozen=True)
class LayerPlan:
    """Which attention each VLM layer runs in the denoising steps, and its expert layer."""

    self_attention: Tuple[bool, ...]          # per VLM layer: self-attention over [prefix; suffix], else cross
    expert_of: Tuple[Optional[int], ...]      # per VLM layer: the expert layer index, or None


def layer_plan(num_vlm_layers: int, num_expert_layers: int, attention_mode: str, self_attn_every: int) -> LayerPlan:
    """``get_model_layers`` and the layer choice of ``SmolVLMWithExpertModel.forward``."""
    multiple_of = num_vlm_layers // num_expert_layers
    experts: List[Optional[int]] = []
    for i in range(num_vlm_layers):
        if multiple_of > 0 and i > 0 and i % multiple_of != 0:
            experts.append(None)
        else:
            experts.append(i // multiple_of if multiple_of > 0 else i)
    selfish = tuple("cross" not in attention_mode or (self_attn_every > 0 and i % self_attn_every == 0)
                    for i in range(num_vlm_layers))
    return LayerPlan(selfish, tuple(experts))


class SmolVLMWithExpert(nn.Module):
    """``SmolVLMWithExpertModel``'s modules (``vlm``, ``lm_expert``) under LeRobot's names."""

    vlm: Any                          # transformers modules: typed by their own package, read here by name
    lm_expert: Any

    def __init__(self, vlm_config, options: SmolVLAOptions):
        super().__init__()
        from transformers import AutoModel, SmolVLMForConditionalGeneration  # the VLA kinds only
        self.vlm = SmolVLMForConditionalGeneration(config=vlm_config)
        text_model = self.vlm.model.text_model
        available = len(text_model.layers)
        if options.num_vlm_layers > 0:
            if options.num_vlm_layers > available:
                raise ConfigError(f"SmolVLA num_vlm_layers = {options.num_vlm_layers}: the VLM config has only "
                                  f"{available} text layers")
            text_model.layers = text_model.layers[:options.num_vlm_layers]
        self.num_vlm_layers = len(text_model.layers)
        text_config = vlm_config.text_config
        expert_config = copy.deepcopy(text_config)
        hidden_size = expert_config.hidden_size
        expert_config.hidden_size = int(hidden_size * options.expert_width_multiplier)
        expert_config.intermediate_size = get_intermediate_size(int(hidden_size * options.expert_width_multiplier))
        expert_config.num_hidden_layers = self.num_vlm_layers
        if options.num_expert_layers > 0:
            if self.num_vlm_layers % options.num_expert_layers:
                raise ConfigError(f"SmolVLA num_expert_layers = {options.num_expert_layers} does not divide the "
                                  f"{self.num_vlm_layers} VLM layers (LeRobot refuses it too)")
            expert_config.num_hidden_layers = options.num_expert_layers
        self.lm_expert = AutoModel.from_config(expert_config)
        self.num_expert_layers = len(self.lm_expert.layers)
        self.plan = layer_plan(self.num_vlm_layers, self.num_expert_layers, options.attention_mode,
                               options.self_attn_every_n_layers)
        self.cross_projected: List[bool] = []
        for j, layer in enumerate(self.lm_expert.layers):
            projected = "cross" in options.attention_mode and not (
                options.self_attn_every_n_layers > 0 and j % options.self_attn_every_n_layers == 0)
            self.cross_projected.append(projected)
            if projected:
                width = text_config.num_key_value_heads * text_config.head_dim
                out = expert_config.num_key_value_heads * expert_config.head_dim
                layer.self_attn.k_proj = nn.Linear(width, out, bias=expert_config.attention_bias)
                layer.self_attn.v_proj = nn.Linear(width, out, bias=expert_config.attention_bias)
        self.lm_expert.embed_tokens = None
        from transformers.models.llama.modeling_llama import LlamaMLP
        for layer in (*text_model.layers, *self.lm_expert.layers):
            if type(layer.mlp).forward is not LlamaMLP.forward:          # the decoder layers' MLP is written out
                raise ConfigError(f"SmolVLA's VLM has MLPs of type {type(layer.mlp).__name__}: capsule_ros writes "
                                  "out LlamaMLP's forward (a text config of model_type llama, as SmolVLM2's)")
        from transformers.models.smolvlm.modeling_smolvlm import SmolVLMEncoderLayer
        check_encoder_layers(self.vlm.model.vision_model.encoder.layers, [SmolVLMEncoderLayer],
                             "SmolVLA's vision tower")
        for i, (selfish, expert) in enumerate(zip(self.plan.self_attention, self.plan.expert_of, strict=True)):
            if expert is not None and selfish == self.cross_projected[expert]:
                raise ConfigError(
                    f"SmolVLA layer {i} runs {'self' if selfish else 'cross'}-attention but its expert layer {expert} "
                    f"was built for {'cross' if selfish else 'self'}-attention (num_expert_layers "
                    f"{options.num_expert_layers}, self_attn_every_n_layers {options.self_attn_every_n_layers}): "
                    "LeRobot 0.6.1 fails on this configuration too")
            if selfish and expert is None:
                raise ConfigError(f"SmolVLA layer {i} runs self-attention without an expert layer (num_expert_layers "
                                  f"{options.num_expert_layers}): LeRobot 0.6.1 fails on this configuration too")
        # never read at inference: the VLM's language-model head (its weights are in the checkpoint and
        # are checked, not kept), the rotary tables (LeRobot applies its own RoPE)
        self.vlm.lm_head = None
        text_model.rotary_emb = None
        self.lm_expert.rotary_emb = None
        self.expert_hidden_size = expert_config.hidden_size
        self.heads, self.kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
        self.head_dim = text_config.head_dim


@dataclass(frozen=True)
class SmolVLAOptions:
    """The fields of a SmolVLA config.json the inference reads."""

    chunk_size: int = 50
    n_action_steps: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    resize_imgs_with_padding: Optional[Tuple[int, int]] = (512, 512)
    tokenizer_max_length: int = 48
    num_steps: int = 10
    add_image_special_tokens: bool = False
    attention_mode: str = "cross_attn"
    prefix_length: int = -1
    pad_language_to: str = "longest"
    num_expert_layers: int = -1
    num_vlm_layers: int = 16
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = 0.75
    min_period: float = 4e-3
    max_period: float = 4.0
    vlm_model_name: str = ""

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> SmolVLAOptions:
        values: Dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name not in checkpoint.config:
                continue
            value: Any = checkpoint.config[name]
            if name == "resize_imgs_with_padding" and value is not None:
                value = (int(value[0]), int(value[1]))
            values[name] = value
        return cls(**values)


class SmolVLAModel(nn.Module):
    """``VLAFlowMatching``'s modules (``model.*`` of the checkpoint)."""

    def __init__(self, vlm_config, options: SmolVLAOptions):
        super().__init__()
        self.vlm_with_expert = SmolVLMWithExpert(vlm_config, options)
        hidden = vlm_config.text_config.hidden_size
        expert = self.vlm_with_expert.expert_hidden_size
        self.state_proj = nn.Linear(options.max_state_dim, hidden)
        self.action_in_proj = nn.Linear(options.max_action_dim, expert)
        self.action_out_proj = nn.Linear(expert, options.max_action_dim)
        self.action_time_mlp_in = nn.Linear(expert * 2, expert)
        self.action_time_mlp_out = nn.Linear(expert, expert)


# --- the policy ------------------------------------------------------------------------------------

@dataclass
class Prefix:
    """One chunk's prefix, as the denoising steps read it (scratch of one plan)."""

    attention: torch.Tensor                  # bool [B, T, P + T]: the suffix's mask over [prefix; suffix]
    positions: RopeAngles                    # the suffix's positions (self-attention layers)
    expert_positions: RopeAngles             # the same from 0 (cross-attention layers)
    # VLM layer -> keys (float32) and values over the prefix, grouped to every query head
    # (``grouped_keys_values``): the expert's projections (cross-attention layers), the VLM's
    # own (self-attention layers, which append each step's suffix to them)
    grouped_kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]]


class SmolVLAPolicy(VLAPolicy):
    """LeRobot's SmolVLAPolicy.select_action / predict_action_chunk + processors (module docstring)."""

    patch_positions: torch.Tensor     # constant buffers (register_buffer), declared for the type checker
    image_scale: torch.Tensor
    image_start_tokens: torch.Tensor
    image_end_tokens: torch.Tensor
    suffix_att: torch.Tensor
    suffix_pad: torch.Tensor
    vision_mask: Optional[torch.Tensor]

    def __init__(self, checkpoint: Checkpoint, inputs: Sequence[BoundInput], input_norms: Dict[str, Normalization],
                 action_norm: Normalization, *, model: SmolVLAModel, vlm_config, vlm: Dict[str, object],
                 tokenizer: TaskTokenizer, task_port: Optional[BufferSpec], default_task: str, rtc: RTCSettings):
        """``model``: the modules, built (on the meta device, weights still to load) from the
        checkpoint's options and the VLM's ``vlm_config``; ``vlm``: the VLM's part of the architecture."""
        o = SmolVLAOptions.of(checkpoint)
        self.options = o
        super().__init__(checkpoint, inputs, input_norms, action_norm, tokenizer=tokenizer, task_port=task_port,
                         default_task=default_task, chunk_size=o.chunk_size, n_action_steps=o.n_action_steps,
                         max_action_dim=o.max_action_dim, num_steps=o.num_steps, rtc=rtc)
        if self.state_input.shape[0] > o.max_state_dim:
            raise ConfigError(f"observation.state has {self.state_input.shape[0]} values, more than max_state_dim = "
                              f"{o.max_state_dim}")
        self.model = model
        self.vlm_description = vlm
        vwe = self.model.vlm_with_expert
        self.vision_dtype = next(vwe.vlm.model.vision_model.parameters()).dtype
        self._constants(vlm_config, tokenizer)

    # -- constants LeRobot makes on the host --------------------------------------------------------
    def _constants(self, vlm_config, tokenizer: TaskTokenizer) -> None:
        o, vwe = self.options, self.model.vlm_with_expert
        vision = vwe.vlm.model.vision_model
        size = o.resize_imgs_with_padding
        height, width = (size[1], size[0]) if size is not None else self.cameras[0].image_size
        self.image_size = (height, width)
        for camera in self.cameras:
            if size is None and camera.image_size != self.image_size:
                raise ConfigError(f"SmolVLA resize_imgs_with_padding = null with cameras of different sizes "
                                  f"{[list(c.image_size) for c in self.cameras]}")
        patch = vision.patch_size
        if height % patch or width % patch or height != width:
            raise ConfigError(f"SmolVLA images of {height} x {width} do not fit the vision tower (square, in "
                              f"patches of {patch}); resize_imgs_with_padding must match the VLM's image size")
        self.register_buffer("patch_positions", patch_position_ids(vision, height, width, self.vision_dtype),
                             persistent=False)
        mask = vision_attention_mask(vision, height // patch * (width // patch), self.vision_dtype)
        if mask is None:                       # SDPA's: none (every patch is present)
            self.vision_mask = None
        else:
            self.register_buffer("vision_mask", mask, persistent=False)
        dim = vlm_config.text_config.hidden_size
        connector_dtype = vwe.vlm.model.connector.modality_projection.proj.weight.dtype      # img_emb's dtype
        self.register_buffer("image_scale", torch.tensor(dim ** 0.5, dtype=connector_dtype), persistent=False)
        special = tokenizer.tokenizer
        if o.add_image_special_tokens:
            start = [special.fake_image_token_id, special.global_image_token_id]
            self.register_buffer("image_start_tokens", torch.tensor(start, dtype=torch.long), persistent=False)
            self.register_buffer("image_end_tokens", torch.tensor([special.fake_image_token_id], dtype=torch.long),
                                 persistent=False)
        self.register_buffer("suffix_att", torch.ones(1, o.chunk_size, dtype=torch.float32), persistent=False)
        self.register_buffer("suffix_pad", torch.ones(1, o.chunk_size, dtype=torch.bool), persistent=False)

    def weight_modules(self) -> Dict[str, nn.Module]:
        return {"model": self.model}

    # -- the prefix --------------------------------------------------------------------------------
    def prepare_images(self, state: State) -> List[torch.Tensor]:
        """Each camera as SigLIP wants it: normalised (LeRobot's preprocessor), resized with
        padding, in [-1, 1] (``SmolVLAPolicy.prepare_images``)."""
        out = []
        for camera in self.cameras:
            img = self.normalized(camera, state[camera.port.name])[None]                      # [1, 3, H, W]
            if self.options.resize_imgs_with_padding is not None:
                img = resize_with_pad(img, self.image_size[0], self.image_size[1], pad_value=0)
            out.append(img * 2.0 - 1.0)
        return out

    def embed_image(self, image: torch.Tensor) -> torch.Tensor:
        """``embed_image``: the vision tower (its embeddings with constant patch positions) and
        the connector."""
        vision = self.model.vlm_with_expert.vlm.model.vision_model
        pixels = image.to(dtype=self.vision_dtype)
        patches = vision.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        hidden = patches + vision.embeddings.position_embedding(self.patch_positions)
        for layer in vision.encoder.layers:
            hidden = encoder_layer(layer, hidden, self.vision_mask, self.side_by_side)
        hidden = vision.post_layernorm(hidden)
        return self.model.vlm_with_expert.vlm.model.connector(hidden)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.vlm_with_expert.vlm.model.text_model.embed_tokens(tokens)

    def embed_prefix(self, state: State) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``VLAFlowMatching.embed_prefix``: (embeddings [1, P, hidden], pad masks bool [1, P],
        attention pattern bool [1, P])."""
        o = self.options
        embs: List[torch.Tensor] = []
        pad_masks: List[torch.Tensor] = []
        att: List[int] = []
        images = self.side_by_side.map(lambda image: self.embed_image(image) * self.image_scale,
                                       self.prepare_images(state))
        for img_emb in images:
            if o.add_image_special_tokens:
                start = self.embed_tokens(self.image_start_tokens).unsqueeze(0)
                embs.append(start)
                pad_masks.append(torch.ones_like(start[:, :, 0], dtype=torch.bool))
                att += [0] * start.shape[1]
            embs.append(img_emb)
            pad_masks.append(torch.ones(1, img_emb.shape[1], dtype=torch.bool, device=img_emb.device))
            att += [0] * img_emb.shape[1]
            if o.add_image_special_tokens:
                end = self.embed_tokens(self.image_end_tokens).unsqueeze(0)
                embs.append(end)
                pad_masks.append(torch.ones_like(end[:, :, 0], dtype=torch.bool))
                att += [0] * end.shape[1]
        tokens, lang_masks = self.task_tokens(state, exact_length=self.exact_token_length(state))
        lang_emb = self.embed_tokens(tokens)
        lang_emb = lang_emb * math.sqrt(lang_emb.shape[-1])
        embs.append(lang_emb)
        pad_masks.append(lang_masks)
        att += [0] * lang_emb.shape[1]
        state_vec = self.normalized(self.state_input, state[self.state_input.port.name])[None]
        state_vec = F.pad(state_vec, (0, o.max_state_dim - state_vec.shape[-1])) \
            if state_vec.shape[-1] < o.max_state_dim else state_vec
        state_emb = self.model.state_proj(state_vec)[:, None, :]
        embs.append(state_emb)
        pad_masks.append(torch.ones(1, 1, dtype=torch.bool, device=state_emb.device))
        att += [1]
        emb = torch.cat(embs, dim=1)
        pad = torch.cat(pad_masks, dim=1)
        pattern = self._pattern(att, emb.device)
        if pad.shape[1] < o.prefix_length:
            emb = pad_tensor(emb, o.prefix_length, 0)
            pad = pad_tensor(pad, o.prefix_length, 0)
            pattern = pad_tensor(pattern, o.prefix_length, 0)
        return emb, pad, pattern

    @staticmethod
    def _pattern(att: List[int], device: torch.device) -> torch.Tensor:
        """The prefix's attention pattern [1, P] bool, which LeRobot makes with ``torch.tensor``
        from its list: 0 for every image and language token, 1 for the state token (the last),
        made on the device instead (no host copy)."""
        assert att[-1] == 1 and not any(att[:-1])
        return (torch.arange(len(att), device=device) == len(att) - 1)[None, :]

    def exact_token_length(self, state: State) -> bool:
        return self.options.pad_language_to == "longest" and state[self.task_spec.name].device.type == "cpu"

    def encode_prefix(self, state: State) -> Prefix:
        """The prefix pass of ``sample_actions``: embeddings, then every VLM layer's K/V."""
        vwe = self.model.vlm_with_expert
        emb, pad_masks, pattern = self.embed_prefix(state)
        att_2d = make_att_2d_masks(pad_masks, pattern)
        positions = torch.cumsum(pad_masks, dim=1) - 1
        keys, values = self.prefix_pass(emb, att_2d, positions)
        chunk = self.options.chunk_size
        suffix_2d = make_att_2d_masks(self.suffix_pad, self.suffix_att)
        prefix_len = pad_masks.shape[1]
        prefix_2d = pad_masks[:, None, :].expand(1, chunk, prefix_len)
        attention = torch.cat([prefix_2d, suffix_2d], dim=2)
        offsets = torch.sum(pad_masks, dim=-1)[:, None]
        suffix_positions = offsets + torch.cumsum(self.suffix_pad, dim=1) - 1
        expert_positions = suffix_positions - torch.min(suffix_positions, dim=1, keepdim=True).values
        grouped_kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (selfish, expert) in enumerate(zip(vwe.plan.self_attention, vwe.plan.expert_of, strict=True)):
            if expert is None:
                continue
            prefix_kv = (keys[i].transpose(1, 2), values[i].transpose(1, 2)) if selfish else \
                self.cross_keys_values(vwe.lm_expert.layers[expert], keys[i], values[i])
            grouped_kv[i] = grouped_keys_values(*prefix_kv, vwe.heads, vwe.kv_heads)
        return Prefix(attention, RopeAngles.of(suffix_positions, vwe.head_dim),
                      RopeAngles.of(expert_positions, vwe.head_dim), grouped_kv)

    def prefix_pass(self, emb: torch.Tensor, att_2d: torch.Tensor,
                    positions: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """``SmolVLMWithExpertModel.forward`` over [prefix, None] with a fresh cache: every layer's
        (post-RoPE) keys and values, stored as ``DynamicCache.update`` stores them."""
        vwe = self.model.vlm_with_expert
        layers = vwe.vlm.model.text_model.layers
        keys: List[torch.Tensor] = []
        values: List[torch.Tensor] = []
        hidden = emb
        last = len(layers) - 1
        angles = RopeAngles.of(positions, vwe.head_dim)
        for i, layer in enumerate(layers):
            normed = layer.input_layernorm(hidden)
            shape = (*normed.shape[:-1], -1, layer.self_attn.head_dim)
            normed = normed.to(dtype=layer.self_attn.q_proj.weight.dtype)
            attn = layer.self_attn
            calls = [functools.partial(_projected, attn.k_proj, normed, shape, angles),
                     functools.partial(_projected, attn.v_proj, normed, shape, None)]
            if i != last:     # the last layer's output feeds only the discarded final norm: no query
                calls.append(functools.partial(_projected, attn.q_proj, normed, shape, angles))
            states = self.side_by_side.run(calls, normed.device)
            keys.append(torch.cat([states[0].transpose(1, 2)], dim=-2))        # DynamicCache: [B, H, P, D]
            values.append(torch.cat([states[1].transpose(1, 2)], dim=-2))
            if i == last:
                break
            att_output = eager_attention(att_2d, vwe.heads, vwe.kv_heads, states[2], keys[i].transpose(1, 2),
                                         values[i].transpose(1, 2))
            hidden = self._layer_output(layer, att_output, hidden)
        return keys, values

    def _layer_output(self, layer: Any, att_output: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer after attention, as LeRobot's forward writes it (the
        MLP's gate and up projections side by side on a GPU: ``LlamaMLP.forward``'s operations)."""
        o_proj = layer.self_attn.o_proj
        if att_output.dtype != o_proj.weight.dtype:
            att_output = att_output.to(o_proj.weight.dtype)
        out_emb = o_proj(att_output)
        out_emb += hidden
        after_first_residual = out_emb          # LeRobot clones it; nothing below writes to it
        out_emb = layer.post_attention_layernorm(out_emb)
        out_emb = gated_mlp(layer.mlp, out_emb, self.side_by_side)
        out_emb += after_first_residual
        return out_emb

    @staticmethod
    def cross_keys_values(expert_layer: Any, key_cache: torch.Tensor,
                          value_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The expert's keys and values over the prefix (``forward_cross_attn_layer``)."""
        key_states = key_cache.transpose(1, 2)
        value_states = value_cache.transpose(1, 2)
        head_dim = expert_layer.self_attn.head_dim
        k_proj, v_proj = expert_layer.self_attn.k_proj, expert_layer.self_attn.v_proj
        keys_in = key_states.to(dtype=k_proj.weight.dtype).reshape(*key_states.shape[:2], -1)
        expert_keys = k_proj(keys_in).view(*keys_in.shape[:-1], -1, head_dim)
        values_in = value_states.to(dtype=v_proj.weight.dtype).reshape(*value_states.shape[:2], -1)
        expert_values = v_proj(values_in).view(*values_in.shape[:-1], -1, head_dim)
        return expert_keys, expert_values

    # -- the denoising steps ---------------------------------------------------------------------
    def embed_suffix(self, x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """``VLAFlowMatching.embed_suffix``: noisy actions and time through the action-time MLP."""
        m = self.model
        action_emb = m.action_in_proj(x_t)
        time_emb = sinusoidal_time_embedding(time, self.model.vlm_with_expert.expert_hidden_size,
                                             self.options.min_period, self.options.max_period)
        time_emb = time_emb.type(dtype=action_emb.dtype)
        time_emb = time_emb[:, None, :].expand_as(action_emb)
        action_time_emb = torch.cat([action_emb, time_emb], dim=2)
        action_time_emb = m.action_time_mlp_in(action_time_emb)
        action_time_emb = F.silu(action_time_emb)
        return m.action_time_mlp_out(action_time_emb)

    def velocity(self, prefix: Prefix, x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """``VLAFlowMatching.denoise_step``: the expert over the suffix, attending to the prefix."""
        vwe = self.model.vlm_with_expert
        hidden = self.embed_suffix(x_t, time)
        for i, (selfish, expert) in enumerate(zip(vwe.plan.self_attention, vwe.plan.expert_of, strict=True)):
            if expert is None:
                continue                              # LeRobot passes the suffix through unchanged
            layer = vwe.lm_expert.layers[expert]
            normed = layer.input_layernorm(hidden)
            shape = (*normed.shape[:-1], -1, layer.self_attn.head_dim)
            normed = normed.to(dtype=layer.self_attn.q_proj.weight.dtype)
            attn = layer.self_attn
            keys, values = prefix.grouped_kv[i]
            if selfish:         # LeRobot: [prefix; suffix] keys and values, then grouped (exact copies either way)
                query_state, key_state, value_state = self.side_by_side.run(
                    [functools.partial(_projected, proj, normed, shape, rope) for proj, rope in
                     ((attn.q_proj, prefix.positions), (attn.k_proj, prefix.positions), (attn.v_proj, None))],
                    normed.device)
                suffix_keys, suffix_values = grouped_keys_values(key_state, value_state, vwe.heads, vwe.kv_heads)
                keys = torch.cat([keys, suffix_keys], dim=1)
                values = torch.cat([values, suffix_values], dim=1)
                mask = prefix.attention
            else:
                query_state = _projected(attn.q_proj, normed, shape, prefix.expert_positions)
                mask = prefix.attention[:, -hidden.shape[1]:, :keys.shape[1]]
            att_output = attend(mask, query_state, keys, values)
            hidden = self._layer_output(layer, att_output, hidden)
        out = vwe.lm_expert.norm(hidden)
        out = out[:, -self.options.chunk_size:]
        out = out.to(dtype=torch.float32)
        return self.model.action_out_proj(out)

    def architecture(self) -> dict:
        out = super().architecture()
        out["vlm"] = self.vlm_description
        return out


def pad_tensor(tensor: torch.Tensor, max_len: int, pad_value: float = 0) -> torch.Tensor:
    """``modeling_smolvla.pad_tensor``: pad dim 1 to ``max_len`` with ``pad_value``."""
    b, d = tensor.shape[:2]
    padded = torch.full((b, max_len, *tensor.shape[2:]), pad_value, dtype=tensor.dtype, device=tensor.device)
    padded[:, :d] = tensor
    return padded


def patch_position_ids(vision: Any, height: int, width: int, pixel_dtype: torch.dtype) -> torch.Tensor:
    """The position id of every patch of a [height, width] image with no patch masked, as
    ``SmolVLMVisionEmbeddings.forward`` computes them (its boolean-mask assignment is a
    host synchronisation; with every patch present it assigns them all): int64 [1, patches]."""
    embeddings = vision.embeddings
    per_side, patch = embeddings.num_patches_per_side, embeddings.patch_size
    rows, cols = height // patch, width // patch
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    step_h, step_w = 1.0 / torch.tensor([rows]), 1.0 / torch.tensor([cols])
    coords_h = torch.arange(rows, dtype=torch.float32)[None, :] * step_h[:, None]
    coords_w = torch.arange(cols, dtype=torch.float32)[None, :] * step_w[:, None]
    coords_h = torch.clamp(coords_h, max=(1.0 - 1e-6)).to(pixel_dtype)
    coords_w = torch.clamp(coords_w, max=(1.0 - 1e-6)).to(pixel_dtype)
    bucket_h = torch.bucketize(coords_h, boundaries, right=True)
    bucket_w = torch.bucketize(coords_w, boundaries, right=True)
    return (bucket_h[:, :, None] * per_side + bucket_w[:, None, :]).reshape(1, -1)


def vision_attention_mask(vision: Any, patches: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The encoder's attention mask for an image with every patch present, as the tower
    makes it (``create_bidirectional_mask``; None for SDPA, which then needs none)."""
    from transformers.masking_utils import create_bidirectional_mask
    embeds = torch.zeros(1, patches, vision.config.hidden_size, dtype=dtype)
    return create_bidirectional_mask(config=vision.config, inputs_embeds=embeds,
                                     attention_mask=torch.ones(1, patches, dtype=torch.bool))
