"""The Gemma stacks of π0 / π0.5: transformers' layers, LeRobot's hand-written glue.

LeRobot 0.6.1's ``lerobot/policies/pi_gemma.py`` builds each decoder layer from transformers'
``GemmaAttention`` and ``GemmaMLP`` and writes by hand only the adaptive RMSNorm
(``PiGemmaRMSNorm``: a plain Gemma RMSNorm, or π0.5's time-conditioned scale / shift /
gate), the gated residual and the stack's forward (``PiGemmaModel.forward``). This module
builds the same layers from the same transformers classes (so their kernels and their
numbers are transformers' own) and reimplements only those hand-written parts, operation
for operation. Parameter names are LeRobot's. ``GemmaAttention.forward`` and
``GemmaMLP.forward`` are written out too, with their modules and operations, so that their
independent projections (query, key and value; gate and up) run side by side on a GPU
(``SideBySide``).

Keys and values. At inference LeRobot runs the VLM once over the prefix with a
``DynamicCache`` and then, per denoising step, the expert over the suffix attending to a
clone of it (``DynamicLayer.update``: the prefix keys concatenated with the step's own).
``PrefixKV`` is that cache reduced to what inference uses, with fixed shapes: it records
each layer's prefix keys/values once and hands ``cat(prefix, step)`` to every expert
step. It is a plan's scratch, made and dropped inside one ``plan`` call (never capsule
state). The attention calls only its ``update``.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple, cast

import torch
from torch import nn

from capsule_ros.policies.vla.side_by_side import SideBySide, gated_mlp, heads


def _transformers_gemma():
    from transformers.models.gemma import modeling_gemma
    return modeling_gemma


class PiGemmaRMSNorm(nn.Module):
    """LeRobot's ``PiGemmaRMSNorm``: Gemma's RMSNorm (``weight``), or with ``cond_dim`` the
    adaptive form (``dense``: scale, shift and gate from the condition). ``forward``
    returns (normed, gate); gate is None for the plain form."""

    def __init__(self, dim: int, eps: float, cond_dim: Optional[int] = None):
        super().__init__()
        self.eps = eps
        self.cond_dim = cond_dim
        self.dense: Optional[nn.Linear] = None
        if cond_dim is not None:
            self.dense = nn.Linear(cond_dim, dim * 3, bias=True)
        else:
            self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor,
                cond: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        dtype = x.dtype
        var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        if cond is None or self.dense is None:
            normed = normed * (1.0 + self.weight.float())
            return normed.type_as(x), None
        modulation = self.dense(cond)
        if len(x.shape) == 3:
            modulation = modulation.unsqueeze(1)
        scale, shift, gate = modulation.chunk(3, dim=-1)
        normed = normed * (1 + scale.float()) + shift.float()
        return normed.to(dtype), gate.to(dtype)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """LeRobot's ``_gated_residual``: x + y, or x + y * gate."""
    return x + y if gate is None else x + y * gate


class PrefixKV:
    """The prefix keys/values of one plan (module docstring). ``recording`` while the VLM
    runs over the prefix; then every ``update`` returns the prefix joined with the step's."""

    def __init__(self, depth: int):
        self.keys: List[Optional[torch.Tensor]] = [None] * depth
        self.values: List[Optional[torch.Tensor]] = [None] * depth
        self.recording = True

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.recording:
            self.keys[layer_idx], self.values[layer_idx] = key, value
            return key, value
        prefix_key, prefix_value = self.keys[layer_idx], self.values[layer_idx]
        assert prefix_key is not None and prefix_value is not None, "no prefix recorded for this layer"
        return torch.cat([prefix_key, key], dim=-2), torch.cat([prefix_value, value], dim=-2)


class PiGemmaDecoderLayer(nn.Module):
    """LeRobot's ``_PiGemmaDecoderLayerBase``: transformers' attention and MLP between
    two (adaptive) RMSNorms with gated residuals."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        gemma = _transformers_gemma()
        self.self_attn = gemma.GemmaAttention(config=config, layer_idx=layer_idx)
        self.mlp = gemma.GemmaMLP(config)
        cond_dim = getattr(config, "adarms_cond_dim", None) if getattr(config, "use_adarms", False) else None
        self.input_layernorm = PiGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)
        self.post_attention_layernorm = PiGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)

    @property
    def computes_in_bfloat16(self) -> bool:
        """Whether the layer computes in bfloat16 (LeRobot's test: its query projection's dtype)."""
        return self.self_attn.q_proj.weight.dtype == torch.bfloat16

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, position_embeddings, kv: PrefixKV,
                adarms_cond: Optional[torch.Tensor], side_by_side: SideBySide) -> torch.Tensor:
        residual = hidden
        hidden, gate = self.input_layernorm(hidden, cond=adarms_cond)
        hidden = self.attention(hidden, position_embeddings, mask, kv, side_by_side)
        hidden = gated_residual(residual, hidden, gate)
        residual = hidden
        hidden, gate = self.post_attention_layernorm(hidden, cond=adarms_cond)
        return gated_residual(residual, gated_mlp(self.mlp, hidden, side_by_side), gate)

    def attention(self, hidden: torch.Tensor, position_embeddings, mask: torch.Tensor, kv: PrefixKV,
                  side_by_side: SideBySide) -> torch.Tensor:
        """``GemmaAttention.forward`` written out, its query, key and value projections side by
        side on a GPU: the same operations on the same inputs, through the attention function
        the config names."""
        gemma = _transformers_gemma()
        attn = self.self_attn
        input_shape = hidden.shape[:-1]
        shape = (*input_shape, -1, attn.head_dim)
        queries, keys, values = side_by_side.run([functools.partial(heads, proj, hidden, shape)
                                                  for proj in (attn.q_proj, attn.k_proj, attn.v_proj)], hidden.device)
        cos, sin = position_embeddings
        queries, keys = gemma.apply_rotary_pos_emb(queries, keys, cos, sin)
        keys, values = kv.update(keys, values, attn.layer_idx)
        attend_with = gemma.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                                  gemma.eager_attention_forward)
        out, _ = attend_with(attn, queries, keys, values, mask, dropout=0.0, scaling=attn.scaling)
        return attn.o_proj(out.reshape(*input_shape, -1).contiguous())


class PiGemmaStack(nn.Module):
    """LeRobot's ``PiGemmaModel`` at inference: ``embed_tokens`` (the VLM only:
    transformers' ``GemmaTextScaledWordEmbedding``), the layers, the final ``norm`` and
    transformers' ``GemmaRotaryEmbedding``."""

    def __init__(self, config, with_embeddings: bool):
        super().__init__()
        gemma = _transformers_gemma()
        self.config = config
        self.embed_tokens: Optional[nn.Module] = None
        if with_embeddings:
            self.embed_tokens = gemma.GemmaTextScaledWordEmbedding(
                config.vocab_size, config.hidden_size, config.pad_token_id, embed_scale=config.hidden_size ** 0.5)
        self.layers = nn.ModuleList(PiGemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        cond_dim = getattr(config, "adarms_cond_dim", None)
        self.norm = PiGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)
        self.rotary_emb = gemma.GemmaRotaryEmbedding(config=config)

    def forward(self, inputs_embeds: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, kv: PrefixKV,
                side_by_side: SideBySide, adarms_cond: Optional[torch.Tensor] = None,
                final_norm: bool = True) -> torch.Tensor:
        """``PiGemmaModel.forward``: [B, S, width] -> [B, S, width]; ``mask`` the additive
        4D mask, used as given. ``final_norm``: False when only the keys/values matter
        (the prefix pass, whose hidden states inference never reads)."""
        hidden = inputs_embeds
        if len(self.layers) > 0 and cast(PiGemmaDecoderLayer, self.layers[0]).computes_in_bfloat16:
            hidden = hidden.to(torch.bfloat16)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, mask, position_embeddings, kv, adarms_cond, side_by_side)
        if not final_norm:
            return hidden
        hidden, _ = self.norm(hidden, adarms_cond)
        return hidden
