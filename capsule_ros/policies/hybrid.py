"""The reference hybrid policy: attention with a KV ring, linear-recurrent layers with a
short causal convolution, and an action-chunk head with temporal ensembling.

Shapes (batch size 1 at serving time, state buffers carry no batch dimension):

- observation encoder: every vector input flattened and concatenated -> [obs_dim],
  normalised with fixed statistics, projected to one token [d_model]; an optional image
  input [H, W, C] uint8 adds a small conv encoder's feature.
- ``A`` layers: RMSNorm -> q/k/v with rotary position -> write k, v at ring slot
  ``position % max_context`` of ``L{i}.k`` / ``L{i}.v`` [kv_heads, max_context, head_dim]
  -> attend over the valid slots -> SwiGLU MLP. At the limit the ring overwrites the
  oldest entry: attention is then a sliding window over the last ``max_context`` tokens
  (rotary phases were applied at absolute positions, so relative positions stay exact).
- ``R`` layers (a Mamba-2 style selective linear recurrence): in_proj -> depthwise causal
  conv over (x, B, C) with state ``L{i}.conv`` [conv_dim, conv_width-1] -> per-head
  scalar decay ``a = exp(-softplus(dt) * exp(A_log))`` and state
  ``L{i}.ssm`` [rec_heads, rec_head_dim, d_state] (float32): S <- a*S + (dt*x) B^T,
  y = S C + D x, gated by silu(z) -> out_proj -> SwiGLU MLP.
- head: RMSNorm -> linear -> ``action_scale * tanh`` -> a chunk of ``chunk_horizon``
  future actions. Temporal ensembling keeps ``chunk.acc`` [H, A] and ``chunk.weight`` [H]:
  each step shifts them by one, decays them by ``chunk_decay`` and adds the new chunk; the
  action is ``acc[0] / weight[0]`` (plus optional counter-based Gaussian noise).

The same layers have a parallel sequence path (causal flash attention, chunked SSD scan,
conv1d) used by ``prefill`` (token prefixes) and by training (observation sequences).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from capsule_ros.config import ConfigSection, dims, setting
from capsule_ros.errors import ConfigError
from capsule_ros.policies.registry import BuildContext, PolicyKind
from capsule_ros.runtime.arena import BufferKind, BufferSpec, dtype_from_name
from capsule_ros.runtime.policy import (
    ACTION,
    CHUNK,
    EPISODE,
    POSITION,
    RNG,
    STEP,
    State,
    StatefulPolicy,
    standard_specs,
)
from capsule_ros.runtime.rng import counter_normal
from capsule_ros.runtime.weights import load_weights

CHUNK_ACC = "chunk.acc"
CHUNK_WEIGHT = "chunk.weight"


@dataclass(frozen=True)
class HybridConfig(ConfigSection):
    """Architecture of the reference hybrid policy (every field shapes the graph: read-only)."""

    SECTION = "policy.hybrid"

    d_model: int = setting(64, "token width", low=8, high=16384, read_only=True)
    layers: str = setting("RRA", "layer pattern, one letter per layer: R recurrent, A attention",
                          pattern=r"[RA]{1,128}", read_only=True)
    n_heads: int = setting(4, "attention query heads", low=1, high=256, read_only=True)
    n_kv_heads: int = setting(4, "attention key/value heads (divides n_heads)", low=1, high=256, read_only=True)
    head_dim: int = setting(16, "attention head width", low=4, high=512, read_only=True)
    max_context: int = setting(256, "KV ring length in tokens; beyond it attention is a sliding window",
                               low=1, high=1 << 20, read_only=True)
    rec_heads: int = setting(4, "recurrent heads", low=1, high=1024, read_only=True)
    rec_head_dim: int = setting(16, "recurrent head width", low=1, high=1024, read_only=True)
    d_state: int = setting(16, "recurrent state size per head channel", low=1, high=1024, read_only=True)
    conv_width: int = setting(4, "causal convolution width", low=2, high=64, read_only=True)
    mlp_ratio: float = setting(2.0, "SwiGLU hidden width / d_model (0 = no MLP)", low=0.0, high=16.0, read_only=True)
    action_dim: int = setting(2, "action values per step", low=1, high=1024, read_only=True)
    chunk_horizon: int = setting(8, "future actions predicted per step", low=1, high=1024, read_only=True)
    chunk_decay: float = setting(0.5, "temporal-ensembling decay of older chunk predictions", low=0.0, high=1.0,
                                 read_only=True)
    action_scale: float = setting(1.0, "actions are action_scale * tanh(head)", low=1e-6, high=1e6, read_only=True)
    action_noise_std: float = setting(0.0, "std of Gaussian exploration noise (counter-based RNG in the state)",
                                      low=0.0, high=1e6, read_only=True)
    vocab_size: int = setting(0, "prefix token vocabulary (0 = no prefix input)", low=0, high=1 << 22,
                              read_only=True)
    scan_chunk: int = setting(64, "block length of the chunked scan in the sequence path", low=1, high=4096,
                              read_only=True)
    dtype: str = setting("float32", "weights, activations, KV and conv state dtype",
                         choices=("float32", "bfloat16", "float16"), read_only=True)

    def check(self) -> None:
        from capsule_ros.errors import ConfigError
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{self.SECTION}.n_kv_heads = {self.n_kv_heads}: must divide n_heads = {self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{self.SECTION}.head_dim = {self.head_dim}: must be even (rotary)")


# --- kernels: pure functions of tensors ------------------------------------------------------
#
# Every layer's math is a pure function (tensors in, tensors out; state is written by the
# caller). Pure functions compile cleanly with torch.compile, which fuses the many small
# element-wise operations of a batch-size-1 step into a few kernels; one compiled function
# serves every layer of its kind because the weights are arguments.

def swiglu(x, norm_w, gate_up_w, down_w, eps: float):
    """x + down(silu(gate) * up) of RMSNorm(x); down's GEMM adds the residual (addmm) for 2-D x."""
    gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), norm_w, eps), gate_up_w).chunk(2, dim=-1)
    return residual_linear(x, F.silu(gate) * up, down_w)


def with_mlp(x, mlp, eps: float):
    """``swiglu`` of a layer's MLP weights ``mlp`` (norm, gate_up, down), or ``x`` for a layer without one."""
    if not mlp:
        return x
    norm_w, gate_up_w, down_w = mlp
    return swiglu(x, norm_w, gate_up_w, down_w, eps)


def residual_linear(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x + h @ weight.T, as one GEMM (addmm) for 2-D inputs."""
    if x.dim() == 2:
        return torch.addmm(x, h, weight.t())
    return x + F.linear(h, weight)


def rotary_phases(positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Unit complex phases [T, head_dim/2] for absolute positions[T] (float32 math)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=positions.device,
                                               dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def rotary(x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [..., T, head_dim] by phases [T, head_dim/2]."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * phases).flatten(-2).to(x.dtype)


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """x [..., T] -> [..., T, T] with out[i, j] = sum(x[j+1..i]) for j <= i, -inf above."""
    t = x.size(-1)
    csum = torch.cumsum(x, dim=-1)
    out = csum[..., :, None] - csum[..., None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    return out.masked_fill(~causal, float("-inf"))


def chunked_scan(x: torch.Tensor, log_a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 state0: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Parallel form of S_t = a_t S_{t-1} + x_t b_t^T, y_t = S_t c_t (the SSD algorithm).

    x [B, T, H, P], log_a [B, T, H], b and c [B, T, N], state0 [B, H, P, N]; float32.
    Returns y [B, T, H, P] and the final state [B, H, P, N]. Work is O(T * block) in
    parallel blocks plus one small matrix over blocks, never a loop over time steps.
    """
    bsz, t, h, p = x.shape
    pad = (-t) % block
    if pad:  # pad the end with "no input, no decay": the final state is unchanged
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        log_a = F.pad(log_a, (0, 0, 0, pad))
        b = F.pad(b, (0, 0, 0, pad))
        c = F.pad(c, (0, 0, 0, pad))
    nc = x.shape[1] // block
    x = x.reshape(bsz, nc, block, h, p)
    b = b.reshape(bsz, nc, block, -1)
    c = c.reshape(bsz, nc, block, -1)
    log_a = log_a.reshape(bsz, nc, block, h).permute(0, 3, 1, 2)  # [B, H, nc, L]
    a_cum = torch.cumsum(log_a, dim=-1)
    # 1. within each block (the diagonal blocks)
    decay = torch.exp(segment_sum(log_a))                        # [B, H, nc, L, L]
    cb = torch.einsum("bcln,bcsn->bcls", c, b)                   # [B, nc, L, L]
    y = torch.einsum("bhcls,bcshp->bclhp", decay * cb[:, None], x)
    # 2. each block's own end state, from zero
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)            # [B, H, nc, L]
    block_states = torch.einsum("bcln,bclhp->bchpn", b, x * decay_to_end.permute(0, 2, 3, 1)[..., None])
    # 3. pass states across blocks (a [nc+1, nc+1] decay matrix, not a loop)
    states = torch.cat([state0[:, None], block_states], dim=1)   # [B, nc+1, H, P, N]
    block_decay = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # [B, H, nc+1, nc+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", block_decay, states)
    entering, final = states[:, :-1], states[:, -1]
    # 4. contribution of the state entering each block
    y = y + torch.einsum("bcln,bchpn->bclhp", c, entering) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = y.reshape(bsz, nc * block, h, p)[:, :t]
    return y, final


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution: x [B, T + width - 1, C] (history first) -> [B, T, C].

    A sum of ``width`` shifted products: memory-bound, no convolution library, and the
    same arithmetic order in the step and sequence paths.
    """
    width = weight.shape[1]
    t = x.shape[1] - width + 1
    out = bias
    for k in range(width):
        out = out + x[:, k:k + t] * weight[:, k]
    return out


@dataclass(frozen=True)
class AttentionShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float = 1e-6


def _attention_qkv(x, phases, norm_w, qkv_w, shape: AttentionShape):
    """x [..., T, d] -> q [..., H, T, hd], kv [..., 2, Hkv, T, hd], rotated."""
    heads = shape.n_heads + 2 * shape.n_kv_heads
    qkv = F.linear(F.rms_norm(x, (x.shape[-1],), norm_w, shape.eps), qkv_w)
    qkv = qkv.unflatten(-1, (heads, shape.head_dim)).transpose(-2, -3)           # [..., heads, T, hd]
    qk = rotary(qkv[..., :shape.n_heads + shape.n_kv_heads, :, :], phases)
    q = qk[..., :shape.n_heads, :, :]
    kv = torch.stack([qk[..., shape.n_heads:, :, :], qkv[..., shape.n_heads + shape.n_kv_heads:, :, :]], dim=-4)
    return q, kv


def attention_decode(x, ring, old_bias, phases, norm_w, qkv_w, out_w, mlp, shape: AttentionShape):
    """One token x [1, d] against the ring [2, Hkv, W, hd] (read-only) plus itself.

    ``old_bias`` [W] is 0 for ring slots inside the window and -inf elsewhere (including
    the slot this token will overwrite). Returns the new x and the token's kv
    [2, Hkv, 1, hd] for the caller to write into the ring.
    """
    q, kv = _attention_qkv(x, phases, norm_w, qkv_w, shape)                     # [H,1,hd], [2,Hkv,1,hd]
    rep = shape.n_heads // shape.n_kv_heads
    q = q.reshape(shape.n_kv_heads, rep, shape.head_dim)
    scale = 1.0 / math.sqrt(shape.head_dim)
    old = torch.baddbmm(old_bias.to(q.dtype).view(1, 1, -1), q, ring[0].transpose(1, 2), alpha=scale)
    own = (q.float() * kv[0].float()).sum(-1, keepdim=True) * scale             # [Hkv, rep, 1]
    probs = torch.softmax(torch.cat([old.float(), own], dim=-1), dim=-1)
    attn = torch.bmm(probs[..., :-1].to(q.dtype), ring[1]) + (probs[..., -1:] * kv[1].float()).to(q.dtype)
    x = residual_linear(x, attn.reshape(1, -1), out_w)
    return with_mlp(x, mlp, shape.eps), kv


def attention_prefill(x, norm_w, qkv_w, out_w, mlp, shape: AttentionShape, max_context: int):
    """x [B, T, d] from position 0 -> (new x, kv [B, 2, Hkv, T, hd]); causal flash attention,
    a sliding window of max_context when T exceeds it."""
    t = x.shape[1]
    positions = torch.arange(t, device=x.device)
    q, kv = _attention_qkv(x, rotary_phases(positions, shape.head_dim), norm_w, qkv_w, shape)
    rep = shape.n_heads // shape.n_kv_heads
    keys, values = kv[:, 0], kv[:, 1]
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    if t <= max_context:
        attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    else:
        i, j = positions[:, None], positions[None, :]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=(j <= i) & (i - j < max_context))
    x = residual_linear(x, attn.transpose(1, 2).flatten(-2), out_w)
    return with_mlp(x, mlp, shape.eps), kv


@dataclass(frozen=True)
class RecurrentShape:
    heads: int
    head_dim: int
    d_state: int
    conv_width: int
    scan_chunk: int
    eps: float = 1e-6

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.d_state


def _recurrent_gates(dt, dt_bias, a_log):
    """dt [..., H] -> (dt, log decay), float32."""
    dt = F.softplus(dt.float() + dt_bias.float())
    return dt, dt * -torch.exp(a_log.float())


def _recurrent_out(x, y, z, out_norm_w, out_w, mlp, eps):
    y = F.rms_norm(y.to(x.dtype) * F.silu(z), (y.shape[-1],), out_norm_w, eps)
    x = residual_linear(x, y, out_w)
    return with_mlp(x, mlp, eps)


def recurrent_decode(x, history, ssm, norm_w, in_w, conv_w, conv_b, dt_bias, a_log, skip, out_norm_w, out_w,
                     mlp, shape: RecurrentShape):
    """One token x [1, d] with conv history [width-1, conv_dim] and ssm [H, P, N] (read-only).

    Returns (new x, new history, new ssm) for the caller to write back.
    """
    xbc, z, dt = F.linear(F.rms_norm(x, (x.shape[-1],), norm_w, shape.eps), in_w).split(
        [shape.conv_dim, shape.inner, shape.heads], dim=-1)
    window = torch.cat([history, xbc], dim=0)                                   # [width, conv_dim]
    xbc = F.silu(causal_conv(window[None], conv_w, conv_b))[0, 0]
    xs, b, c = xbc.float().split([shape.inner, shape.d_state, shape.d_state])
    xs = xs.view(shape.heads, shape.head_dim, 1)
    dt, log_a = _recurrent_gates(dt[0], dt_bias, a_log)
    new_ssm = ssm * torch.exp(log_a).view(-1, 1, 1) + (xs * dt.view(-1, 1, 1)) * b.view(1, 1, -1)
    y = (new_ssm * c.view(1, 1, -1)).sum(-1) + skip.float().view(-1, 1) * xs[..., 0]   # [H, P]
    return _recurrent_out(x, y.view(1, -1), z, out_norm_w, out_w, mlp, shape.eps), window[1:], new_ssm


def recurrent_prefill(x, norm_w, in_w, conv_w, conv_b, dt_bias, a_log, skip, out_norm_w, out_w, mlp,
                      shape: RecurrentShape):
    """x [B, T, d] from the zero state -> (new x, final history [B, width-1, conv_dim],
    final ssm [B, H, P, N]) through the chunked scan."""
    bsz, t, _ = x.shape
    xbc, z, dt = F.linear(F.rms_norm(x, (x.shape[-1],), norm_w, shape.eps), in_w).split(
        [shape.conv_dim, shape.inner, shape.heads], dim=-1)
    padded = F.pad(xbc, (0, 0, shape.conv_width - 1, 0))                        # zero initial history
    xbc_c = F.silu(causal_conv(padded, conv_w, conv_b))                          # [B, T, conv_dim]
    xs, b, c = xbc_c.float().split([shape.inner, shape.d_state, shape.d_state], dim=-1)
    xs = xs.reshape(bsz, t, shape.heads, shape.head_dim)
    dt, log_a = _recurrent_gates(dt, dt_bias, a_log)
    state0 = torch.zeros(bsz, shape.heads, shape.head_dim, shape.d_state, device=x.device)
    y, final = chunked_scan(xs * dt[..., None], log_a, b, c, state0, shape.scan_chunk)
    y = y + skip.float()[:, None] * xs
    x = _recurrent_out(x, y.reshape(bsz, t, -1), z, out_norm_w, out_w, mlp, shape.eps)
    return x, padded[:, -(shape.conv_width - 1):], final


class LayerKernels:
    """The layer functions a policy calls: plain, or compiled with torch.compile.

    Compiling is an accelerator for CUDA: a batch-size-1 step is hundreds of tiny
    element-wise kernels, launch-bound even inside a CUDA graph, and fusion cuts them
    several-fold. Prefill kernels compile with dynamic shapes (one compile for every
    prefix length). Owned per policy instance (no global state).
    """

    def __init__(self, compiled: bool = False):
        self.compiled = compiled
        wrap = (lambda fn, dynamic: torch.compile(fn, dynamic=dynamic, fullgraph=True)) if compiled \
            else (lambda fn, dynamic: fn)
        self.attention_decode = wrap(attention_decode, False)
        self.recurrent_decode = wrap(recurrent_decode, False)
        self.attention_prefill = wrap(attention_prefill, True)
        self.recurrent_prefill = wrap(recurrent_prefill, True)


# --- layers ------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def weights(self) -> Tuple[torch.Tensor, ...]:
        return (self.norm.weight, self.gate_up.weight, self.down.weight)


@dataclass
class StepContext:
    """Per-step values shared by every layer (computed once per step, in-graph)."""

    slot: torch.Tensor       # int64[1]: ring slot of this token
    phases: torch.Tensor     # complex64[1, head_dim/2]
    old_bias: torch.Tensor   # [max_context]: 0 for ring slots in the window, -inf otherwise


class AttentionLayer(nn.Module):
    """Attention over a KV ring of max_context tokens (sliding window at the limit).

    The ring is one buffer ``L{i}.kv`` [2, kv_heads, max_context, head_dim] (keys, values)
    so that one indexed write stores both. Decoding groups the query heads of each KV
    head (GQA) and attends with batched matmuls over the ring as it lies in memory (no
    copy of the cache per step), plus the token itself.
    """

    def __init__(self, cfg: HybridConfig, index: int):
        super().__init__()
        self.cfg = cfg
        self.kv_name = f"L{index}.kv"
        self.shape = AttentionShape(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        d, hd = cfg.d_model, cfg.head_dim
        self.norm = RMSNorm(d)
        self.qkv = nn.Linear(d, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, bias=False)
        self.out = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.mlp = SwiGLU(d, int(cfg.mlp_ratio * d)) if cfg.mlp_ratio > 0 else None

    def _weights(self):
        return (self.norm.weight, self.qkv.weight, self.out.weight, self.mlp.weights() if self.mlp else ())

    def step(self, x: torch.Tensor, state: State, ctx: StepContext, kernels: LayerKernels) -> torch.Tensor:
        ring = state[self.kv_name]
        x, kv = kernels.attention_decode(x, ring, ctx.old_bias, ctx.phases, *self._weights(), self.shape)
        # in-place ring write (one index_put over the ring's slot axis, first in a transposed
        # view): the same bytes as ring[:, :, slot] = kv, and a form torch.func.vmap batches
        # (a fleet's batched step, capsule_ros.runtime.batching)
        ring.transpose(0, 2).index_put_((ctx.slot,), kv.transpose(0, 2))
        return x

    def sequence(self, x: torch.Tensor, state: Optional[State], kernels: LayerKernels) -> torch.Tensor:
        x, kv = kernels.attention_prefill(x, *self._weights(), self.shape, self.cfg.max_context)
        if state is not None:                                  # prefill (B == 1): keep the last W tokens
            t = x.shape[1]
            keep = min(t, self.cfg.max_context)
            slots = torch.remainder(torch.arange(t - keep, t, device=x.device), self.cfg.max_context)
            state[self.kv_name][:, :, slots] = kv[0, :, :, t - keep:]
        return x


class RecurrentLayer(nn.Module):
    """Selective linear recurrence with a short causal convolution (Mamba-2 style)."""

    def __init__(self, cfg: HybridConfig, index: int):
        super().__init__()
        self.cfg = cfg
        self.conv_name, self.ssm_name = f"L{index}.conv", f"L{index}.ssm"
        self.shape = RecurrentShape(cfg.rec_heads, cfg.rec_head_dim, cfg.d_state, cfg.conv_width, cfg.scan_chunk)
        d, sh = cfg.d_model, self.shape
        self.norm = RMSNorm(d)
        self.in_proj = nn.Linear(d, sh.conv_dim + sh.inner + sh.heads, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(sh.conv_dim, sh.conv_width) / math.sqrt(sh.conv_width))
        self.conv_bias = nn.Parameter(torch.zeros(sh.conv_dim))
        self.a_log = nn.Parameter(torch.log(torch.linspace(1.0, 8.0, sh.heads)))
        self.dt_bias = nn.Parameter(torch.log(torch.expm1(torch.linspace(0.01, 0.1, sh.heads))))
        self.skip = nn.Parameter(torch.ones(sh.heads))
        self.out_norm = RMSNorm(sh.inner)
        self.out_proj = nn.Linear(sh.inner, d, bias=False)
        self.mlp = SwiGLU(d, int(cfg.mlp_ratio * d)) if cfg.mlp_ratio > 0 else None

    def _weights(self):
        return (self.norm.weight, self.in_proj.weight, self.conv_weight, self.conv_bias, self.dt_bias, self.a_log,
                self.skip, self.out_norm.weight, self.out_proj.weight, self.mlp.weights() if self.mlp else ())

    def step(self, x: torch.Tensor, state: State, ctx: StepContext, kernels: LayerKernels) -> torch.Tensor:
        history, ssm = state[self.conv_name], state[self.ssm_name]
        x, new_history, new_ssm = kernels.recurrent_decode(x, history, ssm, *self._weights(), self.shape)
        history.copy_(new_history)
        ssm.copy_(new_ssm)
        return x

    def sequence(self, x: torch.Tensor, state: Optional[State], kernels: LayerKernels) -> torch.Tensor:
        x, history, ssm = kernels.recurrent_prefill(x, *self._weights(), self.shape)
        if state is not None:
            state[self.conv_name].copy_(history[0])
            state[self.ssm_name].copy_(ssm[0])
        return x


# --- encoder and policy ----------------------------------------------------------------------

def hybrid_state_spec(cfg: HybridConfig, inputs: Sequence[BufferSpec]) -> List[BufferSpec]:
    """Every buffer of a hybrid policy of this config, without building its weights
    (benchmarks size arenas from it)."""
    dtype = dtype_from_name(cfg.dtype)
    specs = [BufferSpec(s.name, s.shape, s.dtype, BufferKind.INPUT) for s in inputs]
    rec = RecurrentShape(cfg.rec_heads, cfg.rec_head_dim, cfg.d_state, cfg.conv_width, cfg.scan_chunk)
    for i, kind in enumerate(cfg.layers):
        if kind == "A":
            specs.append(BufferSpec(f"L{i}.kv", (2, cfg.n_kv_heads, cfg.max_context, cfg.head_dim), dtype,
                                    BufferKind.KV))
        else:
            # conv history is time-major [width-1, conv_dim]: the shift is one contiguous copy
            specs += [BufferSpec(f"L{i}.conv", (rec.conv_width - 1, rec.conv_dim), dtype, BufferKind.CONV),
                      BufferSpec(f"L{i}.ssm", (rec.heads, rec.head_dim, rec.d_state), torch.float32,
                                 BufferKind.RECURRENT)]
    specs += [BufferSpec(CHUNK_ACC, (cfg.chunk_horizon, cfg.action_dim), torch.float32, BufferKind.CHUNK),
              BufferSpec(CHUNK_WEIGHT, (cfg.chunk_horizon,), torch.float32, BufferKind.CHUNK)]
    return specs + standard_specs(cfg.action_dim, cfg.chunk_horizon)


MIN_IMAGE_SIDE = 10   # two 4x4 convolutions of stride 2: (10 - 4) // 2 + 1 = 4 >= 4


Layer = Union[AttentionLayer, RecurrentLayer]


class ObservationEncoder(nn.Module):
    """Vector inputs (flattened, normalised) and an optional image -> one token."""

    obs_mean: torch.Tensor           # buffers (register_buffer), declared for the type checker
    obs_std: torch.Tensor

    def __init__(self, d_model: int, inputs: Sequence[BufferSpec]):
        super().__init__()
        self.vector_names = [s.name for s in inputs if not self._is_image(s)]
        images = [s for s in inputs if self._is_image(s)]
        if len(images) > 1:
            raise ValueError("the hybrid policy takes at most one image input")
        self.image_name = images[0].name if images else ""
        obs_dim = sum(dims(s.shape) for s in inputs if not self._is_image(s))
        self.register_buffer("obs_mean", torch.zeros(obs_dim))
        self.register_buffer("obs_std", torch.ones(obs_dim))
        self.proj = nn.Linear(obs_dim, d_model) if obs_dim else None
        if images:
            height, width, channels = images[0].shape
            if min(height, width) < MIN_IMAGE_SIDE:
                raise ConfigError(f"input {images[0].name!r} is {height}x{width} pixels: the hybrid policy's image "
                                  f"encoder needs at least {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE} (two 4x4 stride-2 "
                                  "convolutions); change the port's shape")
            self.image: Optional[nn.Sequential] = nn.Sequential(
                nn.Conv2d(channels, 16, 4, stride=2), nn.ReLU(),
                nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, d_model))
        else:
            self.image = None

    @staticmethod
    def _is_image(spec: BufferSpec) -> bool:
        return len(spec.shape) == 3 and spec.dtype == torch.uint8

    def forward(self, inputs: Dict[str, torch.Tensor], batch_shape: Tuple[int, ...], dtype: torch.dtype):
        token = None
        if self.proj is not None:
            obs = torch.cat([inputs[n].reshape(*batch_shape, -1).float() for n in self.vector_names], dim=-1)
            obs = (obs - self.obs_mean) / self.obs_std
            token = self.proj(obs.to(dtype))
        if self.image is not None:
            img = inputs[self.image_name].reshape(-1, *inputs[self.image_name].shape[-3:])
            feat = self.image(img.permute(0, 3, 1, 2).to(dtype) / 255.0).reshape(*batch_shape, -1)
            token = feat if token is None else token + feat
        return token


class HybridPolicy(StatefulPolicy):
    """The reference policy (see the module docstring)."""

    ring_slots: torch.Tensor         # a buffer (register_buffer), declared for the type checker

    def __init__(self, cfg: HybridConfig, inputs: Sequence[BufferSpec]):
        super().__init__()
        if not inputs:
            raise ValueError("the hybrid policy needs at least one input buffer")
        self.cfg = cfg
        self.dtype = dtype_from_name(cfg.dtype)
        self.inputs = [BufferSpec(s.name, s.shape, s.dtype, BufferKind.INPUT) for s in inputs]
        self.action_dim, self.chunk_horizon = cfg.action_dim, cfg.chunk_horizon
        self.encoder = ObservationEncoder(cfg.d_model, self.inputs)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if cfg.vocab_size else None
        self.layers = nn.ModuleList(
            AttentionLayer(cfg, i) if kind == "A" else RecurrentLayer(cfg, i) for i, kind in enumerate(cfg.layers))
        self.final_norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.chunk_horizon * cfg.action_dim)
        self.register_buffer("ring_slots", torch.arange(cfg.max_context), persistent=False)
        self.kernels = LayerKernels(compiled=False)
        self.to(self.dtype)
        self.encoder.obs_mean.data = self.encoder.obs_mean.float()
        self.encoder.obs_std.data = self.encoder.obs_std.float()

    # -- protocol ------------------------------------------------------------------------
    def architecture(self) -> dict:
        return {"policy": "hybrid", **self.cfg.to_mapping(),
                "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype)} for s in self.inputs]}

    def state_spec(self) -> List[BufferSpec]:
        return hybrid_state_spec(self.cfg, self.inputs)

    @property
    def supports_prefill(self) -> bool:
        return self.embed is not None

    def check_prefix(self, tokens: Sequence[int]) -> None:
        super().check_prefix(tokens)
        beyond = sorted({t for t in tokens if t >= self.cfg.vocab_size})
        if beyond:
            raise ConfigError(f"policy.prefix = {list(tokens)}: token ids {beyond} are not below "
                              f"policy.hybrid.vocab_size = {self.cfg.vocab_size}")

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        input_names = {s.name for s in self.inputs}
        for name, view in state.items():
            if name not in input_names:
                view.zero_()
        state[EPISODE].fill_(episode)
        state[RNG][0] = seed & 0xFFFFFFFF

    def compile_kernels(self, enabled: bool = True) -> None:
        """Use torch.compile'd layer kernels (CUDA accelerator; see LayerKernels)."""
        self.kernels = LayerKernels(compiled=enabled)

    def step(self, state: State) -> None:
        cfg = self.cfg
        position = state[POSITION]
        slot = torch.remainder(position, cfg.max_context)
        # ring slots holding tokens of the window before this one: written, and not the slot
        # this token overwrites (which holds position - max_context once the ring is full)
        in_window = (self.ring_slots < position) & (self.ring_slots != slot)
        ctx = StepContext(slot=slot, phases=rotary_phases(position, cfg.head_dim),
                          old_bias=torch.where(in_window, 0.0, float("-inf")))
        x = self.encoder({s.name: state[s.name] for s in self.inputs}, (1,), self.dtype)   # [1, d]
        for layer in cast(Sequence[Layer], self.layers):
            x = layer.step(x, state, ctx, self.kernels)
        chunk = self._chunk(x)[0]                                                       # [H, A] float32
        acc, weight = state[CHUNK_ACC], state[CHUNK_WEIGHT]
        decay = self.cfg.chunk_decay
        acc.copy_(torch.cat([acc[1:], torch.zeros_like(acc[:1])]) * decay + chunk)
        weight.copy_(torch.cat([weight[1:], torch.zeros_like(weight[:1])]) * decay + 1.0)
        ensembled = acc / weight[:, None]
        action = ensembled[0]
        if self.cfg.action_noise_std > 0:
            action = action + self.cfg.action_noise_std * counter_normal(state[RNG], (self.action_dim,))
        state[ACTION].copy_(action)
        state[CHUNK].copy_(ensembled)
        state[RNG][1:].add_(1)
        position.add_(1)
        state[STEP].add_(1)

    def prefill(self, state: State, tokens: torch.Tensor) -> None:
        """Consume ``tokens`` int64[P] (P <= max_context) from the initial state in parallel."""
        if self.embed is None:
            raise NotImplementedError("this policy has vocab_size = 0: no prefix input")
        x = self.embed(tokens)[None]                                      # [1, P, d]
        for layer in cast(Sequence[Layer], self.layers):
            x = layer.sequence(x, state, self.kernels)
        state[POSITION].add_(tokens.shape[0])

    # -- training path ---------------------------------------------------------------------
    def forward_sequence(self, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Chunks predicted at every step of whole episodes from the initial state.

        inputs: name -> [B, T, *shape]. Returns [B, T, chunk_horizon, action_dim] (before
        temporal ensembling), through the same parallel path as ``prefill``.
        """
        any_input = next(iter(inputs.values()))
        batch_shape = tuple(any_input.shape[:2])
        x = self.encoder(inputs, batch_shape, self.dtype)
        for layer in cast(Sequence[Layer], self.layers):
            x = layer.sequence(x, None, self.kernels)
        return self._chunk(x)

    def _chunk(self, x: torch.Tensor) -> torch.Tensor:
        raw = self.head(self.final_norm(x)).float()
        return (self.cfg.action_scale * torch.tanh(raw)).reshape(*x.shape[:-1], self.chunk_horizon, self.action_dim)



def _build(context: BuildContext) -> HybridPolicy:
    """The hybrid for the configured ports, seeded (random weights are deterministic per
    device kind) and built on the target device directly, then its weights file if any."""
    device = torch.device(context.device)
    assert isinstance(context.settings, HybridConfig)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(context.seed)
        policy = HybridPolicy(context.settings, context.inputs)
    if context.weights is not None:
        load_weights(policy, context.weights)
    return policy


POLICY_KIND = PolicyKind("hybrid", HybridConfig, _build,
                         "the reference hybrid: attention with a KV ring, linear-recurrent layers with a short "
                         "causal convolution, an action-chunk head with temporal ensembling")
