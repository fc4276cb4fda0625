"""π0 / π0.5's network as LeRobot 0.6.1 runs it at inference (``PI0Pytorch`` / ``PI05Pytorch``).

Built, like LeRobot's ``PaliGemmaWithExpertModel``, from transformers' classes: the SigLIP
tower (``AutoModel.from_config`` of PaliGemma's vision config, SDPA attention as LeRobot's
build resolves it; its forward written out, each layer's projections side by side on a
GPU), ``PaliGemmaMultiModalProjector``, and Gemma attention / MLP / rotary /
scaled embedding inside ``gemma.PiGemmaStack``; the configs are made exactly as LeRobot
makes them (``CONFIG_MAPPING["paligemma"]()`` and its overrides). Written by hand, because
LeRobot writes them by hand: the prefix and suffix embeddings, the masks, the
image preprocessing (openpi's ``resize_with_pad_torch``) and the sinusoidal time embedding.
The denoising loop and RTC guidance around ``encode_prefix`` and ``velocity`` are the VLA
policies' shared ones (``capsule_ros.policies.vla``).

What LeRobot makes on the host inside a chunk is a constant buffer here (the suffix's block
pattern; the step times and RTC's weights are the shared loop's), so that a whole chunk
can be one captured program.

Parameter names are LeRobot's without the leading ``model.`` (the policy loads this module
under ``model``). Tensors: B = 1; P prefix tokens (image tokens per camera, then the
task tokens); S suffix tokens (π0: state + chunk, π0.5: chunk); A = max_action_dim.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.pi.architecture import PiArchitecture
from capsule_ros.policies.lerobot.pi.gemma import PiGemmaStack, PrefixKV
from capsule_ros.policies.vla.side_by_side import SideBySide, check_encoder_layers, encoder_layer

# LeRobot's lerobot.utils.constants.OPENPI_ATTENTION_MASK_VALUE
ATTENTION_MASK_VALUE = -2.3819763e38
# LeRobot's bfloat16 precision keeps the parameters whose names contain one of these in float32
FLOAT32_PARAMS = ("vision_tower", "multi_modal_projector", "input_layernorm", "post_attention_layernorm",
                  "model.norm")


def hf_configs(arch: PiArchitecture):
    """(PaliGemma config, expert Gemma config) as ``PaliGemmaWithExpertModel.__init__``
    makes them (a scaled checkpoint's vision tower and vocabulary as its weights say)."""
    from transformers.models.auto import CONFIG_MAPPING

    vlm, expert, vision = arch.vlm, arch.expert, arch.vision
    paligemma_config: Any = CONFIG_MAPPING["paligemma"]
    gemma_config: Any = CONFIG_MAPPING["gemma"]
    paligemma = paligemma_config()
    paligemma._vocab_size = arch.vocab_size
    paligemma.image_token_index = arch.vocab_size
    text = paligemma.text_config
    text.hidden_size, text.intermediate_size = vlm.width, vlm.mlp_dim
    text.num_attention_heads, text.head_dim = vlm.num_heads, vlm.head_dim
    text.num_hidden_layers, text.num_key_value_heads = vlm.depth, vlm.num_kv_heads
    text.hidden_activation, text.dtype, text.vocab_size = "gelu_pytorch_tanh", "float32", arch.vocab_size
    text.use_adarms, text.adarms_cond_dim = False, None
    tower = paligemma.vision_config
    tower.hidden_size, tower.num_hidden_layers = vision.hidden, vision.layers
    tower.num_attention_heads, tower.patch_size = vision.heads, vision.patch
    tower.image_size, tower.intermediate_size = arch.image_size[0], vision.mlp
    tower.projection_dim, tower.projector_hidden_act, tower.dtype = vlm.width, "gelu_fast", "float32"
    expert_config = gemma_config(
        head_dim=expert.head_dim, hidden_size=expert.width, intermediate_size=expert.mlp_dim,
        num_attention_heads=expert.num_heads, num_hidden_layers=expert.depth, num_key_value_heads=expert.num_kv_heads,
        vocab_size=arch.vocab_size, hidden_activation="gelu_pytorch_tanh", dtype="float32", use_adarms=arch.adarms,
        adarms_cond_dim=expert.width if arch.adarms else None)
    for config in (text, expert_config):
        config._attn_implementation = "eager"        # LeRobot's sample_actions / denoise_step set it
    return paligemma, expert_config


class _PaliGemmaModel(nn.Module):
    """``paligemma.model``: the SigLIP tower, the projector and the VLM (LeRobot's names)."""

    def __init__(self, vision_tower: nn.Module, multi_modal_projector: nn.Module, language_model: PiGemmaStack):
        super().__init__()
        self.vision_tower, self.multi_modal_projector = vision_tower, multi_modal_projector
        self.language_model = language_model


class _PaliGemma(nn.Module):
    """``paligemma``: a level of LeRobot's names (its LM head is not built: unused)."""

    def __init__(self, model: _PaliGemmaModel):
        super().__init__()
        self.model = model


class _Expert(nn.Module):
    """``gemma_expert``: a level of LeRobot's names (its LM head is not built: unused)."""

    def __init__(self, model: PiGemmaStack):
        super().__init__()
        self.model = model


class PaliGemmaWithExpert(nn.Module):
    """``paligemma.model.{vision_tower, multi_modal_projector, language_model}`` and
    ``gemma_expert.model``, LeRobot's names."""

    def __init__(self, arch: PiArchitecture):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.paligemma.modeling_paligemma import PaliGemmaMultiModalProjector

        paligemma_config, expert_config = hf_configs(arch)
        self.paligemma = _PaliGemma(_PaliGemmaModel(
            AutoModel.from_config(paligemma_config.vision_config, attn_implementation="sdpa"),
            PaliGemmaMultiModalProjector(paligemma_config),
            PiGemmaStack(paligemma_config.text_config, with_embeddings=True)))
        self.gemma_expert = _Expert(PiGemmaStack(expert_config, with_embeddings=False))
        from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer
        tower: Any = self.paligemma.model.vision_tower
        if tower.vision_model.use_head:
            raise ConfigError("π's vision config asks for SigLIP's pooling head: PaliGemma's tower has none "
                              "(vision_use_head false)")
        check_encoder_layers(tower.vision_model.encoder.layers, [SiglipEncoderLayer], "π's vision tower")
        self.dtype_name = arch.dtype
        self._cast(arch.dtype)

    @property
    def precision(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype_name == "bfloat16" else torch.float32

    def materialize_constants(self) -> None:
        """The buffers no checkpoint holds (rotary frequencies, the embedding scale, SigLIP's
        position ids), made again as LeRobot's model holds them, cast included: for a
        model built on the meta device, after its weights are loaded."""
        from transformers.models.gemma.modeling_gemma import GemmaRotaryEmbedding

        for stack in (self.language_model, self.expert):
            stack.rotary_emb = GemmaRotaryEmbedding(config=stack.config, device="cpu").to(dtype=self.precision)
            if stack.embed_tokens is not None:
                scale = torch.tensor(stack.embed_tokens.scalar_embed_scale, device="cpu").to(dtype=self.precision)
                stack.embed_tokens.register_buffer("embed_scale", scale, persistent=False)
        tower: Any = self.paligemma.model.vision_tower             # transformers' SiglipVisionModel
        embeddings = tower.vision_model.embeddings
        embeddings.register_buffer("position_ids", torch.arange(embeddings.num_positions, device="cpu").expand((1, -1)),
                                   persistent=False)

    def _cast(self, precision: str) -> None:
        """LeRobot's ``to_bfloat16_for_selected_params``: everything (buffers included) to
        the precision, then the FLOAT32_PARAMS parameters back to float32."""
        if precision == "float32":
            self.to(dtype=torch.float32)
            return
        self.to(dtype=torch.bfloat16)
        for name, param in self.named_parameters():
            if any(selector in name for selector in FLOAT32_PARAMS):
                param.data = param.data.to(dtype=torch.float32)

    @property
    def language_model(self) -> PiGemmaStack:
        return self.paligemma.model.language_model

    @property
    def expert(self) -> PiGemmaStack:
        return self.gemma_expert.model

    def embed_image(self, image: torch.Tensor, side_by_side: SideBySide) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> [B, image tokens, width] (the tower stays float32): the
        tower's ``SiglipVisionTransformer.forward`` written out, each layer's projections
        ``side_by_side`` (``encoder_layer``)."""
        out_dtype = image.dtype
        if image.dtype != torch.float32:
            image = image.to(torch.float32)
        inner = self.paligemma.model
        tower: Any = inner.vision_tower.vision_model            # transformers' SiglipVisionTransformer
        hidden = tower.embeddings(image, interpolate_pos_encoding=False)
        for layer in tower.encoder.layers:
            hidden = encoder_layer(layer, hidden, None, side_by_side)
        features = inner.multi_modal_projector(tower.post_layernorm(hidden))
        return features.to(out_dtype) if features.dtype != out_dtype else features


# --- LeRobot's hand-written helpers (common/vla_utils.py) ------------------------------------------


def sinusoidal_embedding(time: torch.Tensor, dimension: int, min_period: float, max_period: float) -> torch.Tensor:
    """openpi's ``create_sinusoidal_pos_embedding``: [B] -> [B, dimension], in float64
    (float32 on MPS, as LeRobot's ``get_safe_dtype``)."""
    dtype = torch.float32 if time.device.type == "mps" else torch.float64
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=dtype, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    scaling_factor = 1.0 / period * 2 * math.pi
    sin_input = scaling_factor[None, :] * time[:, None]
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)


def att_2d_masks(pad_masks: torch.Tensor, att_masks: torch.Tensor) -> torch.Tensor:
    """big_vision's ``make_att_2d_masks``: bool [B, N, N]."""
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d = pad_masks[:, None, :] * pad_masks[:, :, None]
    return att_2d & pad_2d


def additive_4d(mask_2d: torch.Tensor) -> torch.Tensor:
    """``prepare_attention_masks_4d``: bool [B, Q, K] -> float32 [B, 1, Q, K], 0 or openpi's -2.38e38."""
    return torch.where(mask_2d[:, None, :, :], 0.0, ATTENTION_MASK_VALUE)


def resize_with_pad(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """openpi's ``resize_with_pad_torch`` for float32 channels-last images [B, h, w, C] in
    [0, 1]: bilinear resize keeping the aspect ratio, clamp, centred zero padding."""
    images = images.permute(0, 3, 1, 2)
    _, _, cur_height, cur_width = images.shape
    ratio = max(cur_width / width, cur_height / height)
    resized_height, resized_width = int(cur_height / ratio), int(cur_width / ratio)
    resized = F.interpolate(images, size=(resized_height, resized_width), mode="bilinear", align_corners=False)
    resized = resized.clamp(0.0, 1.0)
    pad_h0, remainder_h = divmod(height - resized_height, 2)
    pad_w0, remainder_w = divmod(width - resized_width, 2)
    padded = F.pad(resized, (pad_w0, pad_w0 + remainder_w, pad_h0, pad_h0 + remainder_h), mode="constant", value=0.0)
    return padded.permute(0, 2, 3, 1)


def siglip_input(image: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """``_preprocess_images`` for one camera: float32 [B, 3, H, W] in [0, 1] -> [B, 3, n, n]
    in [-1, 1], resized with padding when its size is not the model's."""
    image = image.permute(0, 2, 3, 1)
    if tuple(image.shape[1:3]) != tuple(size):
        image = resize_with_pad(image, *size)
    image = image * 2.0 - 1.0
    return image.permute(0, 3, 1, 2)


# --- the model --------------------------------------------------------------------------------------


@dataclass
class Prefix:
    """A chunk's prefix, scratch of one plan: the VLM's keys and values, the suffix's 4D mask
    and position ids, and π0's padded state (None for π0.5)."""

    kv: PrefixKV
    mask: torch.Tensor
    position_ids: torch.Tensor
    state: Optional[torch.Tensor]


class PiModel(nn.Module):
    """``PI0Pytorch`` / ``PI05Pytorch`` at inference (module docstring)."""

    suffix_att: torch.Tensor         # float32 [1, S]: the suffix's block pattern (a buffer)

    def __init__(self, arch: PiArchitecture):
        super().__init__()
        self.arch = arch
        width = arch.expert.width
        self.paligemma_with_expert = PaliGemmaWithExpert(arch)
        self.action_in_proj = nn.Linear(arch.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, arch.max_action_dim)
        if arch.adarms:
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
        else:
            self.state_proj = nn.Linear(arch.max_state_dim, width)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)
        self.register_buffer("suffix_att", self._suffix_att(), persistent=False)

    def materialize_constants(self) -> None:
        """The buffers no checkpoint holds, for a model built on the meta device (after its
        weights are loaded)."""
        self.paligemma_with_expert.materialize_constants()
        self.register_buffer("suffix_att", self._suffix_att(), persistent=False)

    # -- prefix ------------------------------------------------------------------------------------
    def embed_prefix(self, images: Sequence[torch.Tensor], image_masks: Sequence[torch.Tensor],
                     tokens: torch.Tensor, token_masks: torch.Tensor,
                     side_by_side: SideBySide) -> Tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [B, P, width], pad masks bool [B, P]): the image tokens of each camera
        (the towers ``side_by_side``), then the task tokens (their attention pattern is
        all-to-all: att_masks all 0)."""
        embs, pad_masks = [], []
        embedded = side_by_side.map(functools.partial(self.paligemma_with_expert.embed_image,
                                                      side_by_side=side_by_side), images)
        for emb, mask in zip(embedded, image_masks, strict=True):
            bsize, num = emb.shape[:2]
            embs.append(emb)
            pad_masks.append(mask[:, None].expand(bsize, num))
        embed_tokens = self.paligemma_with_expert.language_model.embed_tokens
        assert embed_tokens is not None
        embs.append(embed_tokens(tokens))
        pad_masks.append(token_masks)
        return torch.cat(embs, dim=1), torch.cat(pad_masks, dim=1)

    def encode_prefix(self, images: Sequence[torch.Tensor], image_masks: Sequence[torch.Tensor],
                      tokens: torch.Tensor, token_masks: torch.Tensor, state: Optional[torch.Tensor],
                      side_by_side: SideBySide) -> Prefix:
        """The VLM over the prefix (its keys and values kept) and what every denoising step
        of the chunk reads besides: the suffix masks and π0's padded state."""
        embs, pad_masks = self.embed_prefix(images, image_masks, tokens, token_masks, side_by_side)
        position_ids = torch.cumsum(pad_masks, dim=1) - 1
        kv = PrefixKV(self.arch.vlm.depth)
        mask = additive_4d(att_2d_masks(pad_masks, torch.zeros_like(pad_masks)))   # all-to-all, padding masked
        self.paligemma_with_expert.language_model(embs, mask, position_ids, kv, side_by_side, final_norm=False)
        kv.recording = False
        suffix_mask, suffix_positions = self.suffix_masks(pad_masks)
        return Prefix(kv, suffix_mask, suffix_positions, state)

    # -- suffix ------------------------------------------------------------------------------------
    def _suffix_att(self) -> torch.Tensor:
        """The suffix's block pattern [1, S] (float32, the suffix embeddings' dtype): π0's state
        token, then its action tokens (``[1, 1, 0, ...]``); π0.5's action tokens (``[1, 0, ...]``).
        A constant buffer: LeRobot makes it from a Python list at every step."""
        chunk = self.arch.chunk_size
        pattern = [1] + [0] * (chunk - 1) if self.arch.adarms else [1, 1] + [0] * (chunk - 1)
        return torch.tensor(pattern, dtype=torch.float32, device="cpu")[None, :]

    def embed_suffix(self, state: Optional[torch.Tensor], x_t: torch.Tensor,
                     timestep: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(embeddings [B, S, width], adaRMS condition or None): π0's state token and
        action-time tokens, or π0.5's action tokens with the time as the expert's norm condition."""
        time_emb = sinusoidal_embedding(timestep, self.action_in_proj.out_features, self.arch.min_period,
                                        self.arch.max_period).type(dtype=timestep.dtype)
        action_emb = self.action_in_proj(x_t)
        if self.arch.adarms:
            x = F.silu(self.time_mlp_in(time_emb))
            return action_emb, F.silu(self.time_mlp_out(x))
        assert state is not None
        if self.state_proj.weight.dtype == torch.float32:
            state = state.to(torch.float32)
        state_emb = self.state_proj(state)
        time_emb = time_emb[:, None, :].expand_as(action_emb)
        x = F.silu(self.action_time_mlp_in(torch.cat([action_emb, time_emb], dim=2)))
        return torch.cat([state_emb[:, None, :], self.action_time_mlp_out(x)], dim=1), None

    def suffix_masks(self, prefix_pad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(4D mask [B, 1, S, P + S], position ids [B, S]) of the suffix, as ``denoise_step``
        builds them at every step (they are the same at every step of a chunk)."""
        bsize, prefix_len = prefix_pad.shape
        suffix_att = self.suffix_att.expand(bsize, -1)
        suffix_len = suffix_att.shape[1]
        suffix_pad = torch.ones(bsize, suffix_len, dtype=torch.bool, device=prefix_pad.device)
        prefix_2d = prefix_pad[:, None, :].expand(bsize, suffix_len, prefix_len)
        full = torch.cat([prefix_2d, att_2d_masks(suffix_pad, suffix_att)], dim=2)
        position_ids = torch.sum(prefix_pad, dim=-1)[:, None] + torch.cumsum(suffix_pad, dim=1) - 1
        return additive_4d(full), position_ids

    def velocity(self, prefix: Prefix, x_t: torch.Tensor, timestep: torch.Tensor,
                 side_by_side: SideBySide) -> torch.Tensor:
        """``denoise_step``: the expert over the suffix, attending to the prefix: v_t [B, chunk, A]
        at ``x_t`` [B, chunk, A] and ``timestep`` float32 [B] (its projections ``side_by_side``)."""
        embs, cond = self.embed_suffix(prefix.state, x_t, timestep)
        out = self.paligemma_with_expert.expert(embs, prefix.mask, prefix.position_ids, prefix.kv, side_by_side,
                                                adarms_cond=cond)
        out = out[:, -self.arch.chunk_size:].to(dtype=torch.float32)
        return self.action_out_proj(out)
