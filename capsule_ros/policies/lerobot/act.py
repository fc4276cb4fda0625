"""ACT (Action Chunking Transformer) as LeRobot 0.4 runs it at inference, as a StatefulPolicy.

The network (parameter names are LeRobot's, under ``model.``): a ResNet trunk with
frozen batch norm applied to each camera, a 1x1 projection to ``dim_model`` with a 2-D sinusoidal
position embedding; a transformer encoder over [latent, state, env, camera pixels]
tokens (the latent is the VAE prior mean, zeros, at inference: the VAE encoder's weights
are training-only and skipped); a DETR-style decoder over ``chunk_size`` learned queries;
a linear action head. Output: ``chunk_size`` normalised actions.

Episode state in the arena (LeRobot's ``select_action`` bookkeeping):

- action queue (no ensembling): a chunk cadence (``capsule_ros.chunking``). The
  chunk the model predicted, all ``chunk_size`` rows normalised, is ``chunk.actions``,
  and ``chunk.cursor`` the row to execute next. ``plan`` is the network (it reads the
  input ports only), ``emit`` unnormalises the selected row; nothing runs every step. In
  sync mode ``n_action_steps`` rows are executed per chunk, as LeRobot's deque of
  ``n_action_steps`` does; the network runs once per chunk. ``chunk`` (output) is the
  unnormalised rest of the executed rows, current action first, padded with the last one.
- temporal ensembling (``temporal_ensemble_coeff``): ``act.ensemble`` float32
  [chunk_size - 1, A] (the online weighted average of every prediction for each future
  step, normalised) and ``act.ensemble_count`` int64 [chunk_size - 1] (how many
  predictions each average holds; all 0 = LeRobot's ``None`` after reset), both CHUNK.
  ``chunk`` is the unnormalised ensemble after this step's update, current action first.

Temporal ensembling runs the model at every step, in LeRobot too: no cadence. The
empty-ensemble case needs no branch: with counts 0 the update
``(0 * cumsum[0] + a * w[0]) / cumsum[0]`` is ``a`` exactly (w[0] = 1).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from capsule_ros.chunking.reference import chunked_step
from capsule_ros.policies.binding import Requirement
from capsule_ros.policies.lerobot.checkpoint import Checkpoint, Normalization
from capsule_ros.policies.lerobot.common import RESNET_CHANNELS, FrozenBatchNorm2d, resnet_feature_size, resnet_trunk
from capsule_ros.policies.lerobot.features import OBS_STATE, BoundInput
from capsule_ros.policies.lerobot.policy import LeRobotPolicy
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.policy import ACTION, CHUNK, ChunkCadence, State, chunk_specs

ENSEMBLE, ENSEMBLE_COUNT = "act.ensemble", "act.ensemble_count"
BUFFER_NAMES = (ENSEMBLE, ENSEMBLE_COUNT)
TRAINING_ONLY = ("model.vae_encoder",)   # the VAE encoder (and its cls/proj/pos tensors): training only
ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu}


# The ACT options this implementation reproduces (in order: a row may assume those before hold).
REQUIREMENTS = (
    Requirement(lambda ck: ck.field("n_obs_steps", 1) == 1,
                lambda ck: f"ACT n_obs_steps = {ck.field('n_obs_steps')}: only 1 is supported (as in LeRobot)"),
    Requirement(lambda ck: not ck.field("replace_final_stride_with_dilation", False),
                lambda ck: "ACT replace_final_stride_with_dilation = true is not supported"),
    Requirement(lambda ck: ck.field("feedforward_activation", "relu") in ACTIVATIONS,
                lambda ck: f"ACT feedforward_activation = {ck.field('feedforward_activation')!r}: supported "
                           f"{sorted(ACTIVATIONS)}"),
    Requirement(lambda ck: ck.field("dim_model") % ck.field("n_heads") == 0,
                lambda ck: f"ACT dim_model = {ck.field('dim_model')} is not divisible by n_heads = "
                           f"{ck.field('n_heads')}"),
    Requirement(lambda ck: ck.field("temporal_ensemble_coeff") is None or ck.field("n_action_steps") == 1,
                lambda ck: "ACT temporal_ensemble_coeff needs n_action_steps = 1"),
    Requirement(lambda ck: 1 <= ck.field("n_action_steps") <= ck.field("chunk_size"),
                lambda ck: f"ACT n_action_steps = {ck.field('n_action_steps')} must be in [1, chunk_size = "
                           f"{ck.field('chunk_size')}]"),
    Requirement(lambda ck: OBS_STATE in ck.inputs,
                lambda ck: f"ACT needs an {OBS_STATE!r} input feature (LeRobot reads it at inference)"),
)


# --- transformer -------------------------------------------------------------------------------


class MultiheadAttention(nn.Module):
    """Attention with nn.MultiheadAttention's parameters, computed as its weights-returning
    path (which is what ACT's calls take): separate q/k/v projections, q scaled by
    sqrt(1/head_dim), bmm, softmax, bmm, output projection. Tokens are [L, E] (batch 1)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        length, dim = query.shape
        head_dim = dim // self.heads
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = F.linear(query, w_q, b_q).view(length, self.heads, head_dim).transpose(0, 1)     # [H, L, hd]
        k = F.linear(key, w_k, b_k).view(key.shape[0], self.heads, head_dim).transpose(0, 1)  # [H, S, hd]
        v = F.linear(value, w_v, b_v).view(value.shape[0], self.heads, head_dim).transpose(0, 1)
        weights = torch.softmax(torch.bmm(q * math.sqrt(1.0 / float(head_dim)), k.transpose(-2, -1)), dim=-1)
        out = torch.bmm(weights, v).transpose(0, 1).contiguous().view(length, dim)             # [L, E]
        return self.out_proj(out)


class FeedForward(nn.Module):
    """The linear1 / activation / linear2 pair of a transformer layer (names as LeRobot's)."""

    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        self.linear1 = nn.Linear(dim, hidden)
        self.linear2 = nn.Linear(hidden, dim)
        self.activation = ACTIVATIONS[activation]


class EncoderLayer(FeedForward):
    def __init__(self, dim: int, heads: int, hidden: int, activation: str, pre_norm: bool):
        super().__init__(dim, hidden, activation)
        self.self_attn = MultiheadAttention(dim, heads)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        skip = x
        if self.pre_norm:
            x = self.norm1(x)
        q = x + pos
        x = skip + self.self_attn(q, q, x)
        if self.pre_norm:
            skip, x = x, self.norm2(x)
        else:
            x = self.norm1(x)
            skip = x
        x = skip + self.linear2(self.activation(self.linear1(x)))
        return x if self.pre_norm else self.norm2(x)


class DecoderLayer(FeedForward):
    def __init__(self, dim: int, heads: int, hidden: int, activation: str, pre_norm: bool):
        super().__init__(dim, hidden, activation)
        self.self_attn = MultiheadAttention(dim, heads)
        self.multihead_attn = MultiheadAttention(dim, heads)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, memory: torch.Tensor, query_pos: torch.Tensor,
                memory_pos: torch.Tensor) -> torch.Tensor:
        skip = x
        if self.pre_norm:
            x = self.norm1(x)
        q = x + query_pos
        x = skip + self.self_attn(q, q, x)
        if self.pre_norm:
            skip, x = x, self.norm2(x)
        else:
            x = self.norm1(x)
            skip = x
        x = skip + self.multihead_attn(x + query_pos, memory + memory_pos, memory)
        if self.pre_norm:
            skip, x = x, self.norm3(x)
        else:
            x = self.norm2(x)
            skip = x
        x = skip + self.linear2(self.activation(self.linear1(x)))
        return x if self.pre_norm else self.norm3(x)


class Stack(nn.Module):
    """``layers`` then ``norm`` (LeRobot's ACTEncoder / ACTDecoder containers)."""

    def __init__(self, layers: List[nn.Module], norm: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm


def sinusoid_2d(dim: int, height: int, width: int) -> torch.Tensor:
    """ACT's 2-D sinusoidal embedding of a [height, width] feature map -> [(h w), 2 * dim]
    (``ACTSinusoidalPositionEmbedding2d(dim)``: y then x, interleaved sin/cos, positions
    1..n normalised to (0, 2 pi])."""
    not_mask = torch.ones(1, height, width)
    y_range = not_mask.cumsum(1, dtype=torch.float32)
    x_range = not_mask.cumsum(2, dtype=torch.float32)
    y_range = y_range / (y_range[:, -1:, :] + 1e-6) * (2 * math.pi)
    x_range = x_range / (x_range[:, :, -1:] + 1e-6) * (2 * math.pi)
    inverse_frequency = 10000 ** (2 * (torch.arange(dim, dtype=torch.float32) // 2) / dim)
    x_range = x_range.unsqueeze(-1) / inverse_frequency
    y_range = y_range.unsqueeze(-1) / inverse_frequency
    pos_x = torch.stack((x_range[..., 0::2].sin(), x_range[..., 1::2].cos()), dim=-1).flatten(3)
    pos_y = torch.stack((y_range[..., 0::2].sin(), y_range[..., 1::2].cos()), dim=-1).flatten(3)
    return torch.cat((pos_y, pos_x), dim=3)[0].reshape(height * width, 2 * dim)


class ACTModel(nn.Module):
    """The inference part of LeRobot's ``ACT`` module, by its parameter names."""

    camera_pos: torch.Tensor         # buffers (register_buffer), declared for the type checker
    latent: torch.Tensor
    decoder_in: torch.Tensor

    def __init__(self, checkpoint: Checkpoint, cameras: Sequence[BoundInput], has_env: bool):
        super().__init__()
        c = checkpoint.field
        dim, heads, hidden = c("dim_model"), c("n_heads"), c("dim_feedforward")
        act, pre_norm = c("feedforward_activation", "relu"), bool(c("pre_norm", False))
        self.chunk_size = c("chunk_size")
        if cameras:
            self.backbone = nn.Sequential(resnet_trunk(c("vision_backbone", "resnet18"), FrozenBatchNorm2d))
            self.encoder_img_feat_input_proj = nn.Conv2d(RESNET_CHANNELS, dim, kernel_size=1)
            pos = [sinusoid_2d(dim // 2, *resnet_feature_size(*cam.image_size)) for cam in cameras]
            self.register_buffer("camera_pos", torch.cat(pos), persistent=False)          # [sum(h w), dim]
        self.encoder = Stack([EncoderLayer(dim, heads, hidden, act, pre_norm) for _ in range(c("n_encoder_layers"))],
                             nn.LayerNorm(dim) if pre_norm else nn.Identity())
        self.decoder = Stack([DecoderLayer(dim, heads, hidden, act, pre_norm) for _ in range(c("n_decoder_layers"))],
                             nn.LayerNorm(dim))
        self.encoder_robot_state_input_proj = nn.Linear(checkpoint.inputs["observation.state"].shape[0], dim)
        if has_env:
            self.encoder_env_state_input_proj = nn.Linear(
                checkpoint.inputs["observation.environment_state"].shape[0], dim)
        self.encoder_latent_input_proj = nn.Linear(c("latent_dim"), dim)
        self.encoder_1d_feature_pos_embed = nn.Embedding(2 + int(has_env), dim)
        self.decoder_pos_embed = nn.Embedding(self.chunk_size, dim)
        self.action_head = nn.Linear(dim, checkpoint.action_dim)
        self.register_buffer("latent", torch.zeros(1, c("latent_dim")), persistent=False)
        self.register_buffer("decoder_in", torch.zeros(self.chunk_size, dim), persistent=False)

    def forward(self, state: torch.Tensor, env: torch.Tensor, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Normalised state [n], env [m] or None, images [3, H, W] each -> actions [chunk, A]."""
        tokens = [self.encoder_latent_input_proj(self.latent), self.encoder_robot_state_input_proj(state[None])]
        if env is not None:
            tokens.append(self.encoder_env_state_input_proj(env[None]))
        pos = [self.encoder_1d_feature_pos_embed.weight]
        for image in images:
            features = self.encoder_img_feat_input_proj(self.backbone(image[None]))[0]    # [dim, h, w]
            tokens.append(features.flatten(1).transpose(0, 1))                          # [(h w), dim]
        if images:
            pos.append(self.camera_pos)
        x, positions = torch.cat(tokens), torch.cat(pos)                                 # [S, dim]
        for layer in self.encoder.layers:
            x = layer(x, positions)
        memory = self.encoder.norm(x)
        y = self.decoder_in
        for layer in self.decoder.layers:
            y = layer(y, memory, self.decoder_pos_embed.weight, positions)
        return self.action_head(self.decoder.norm(y))                                   # [chunk, A]


class ACTPolicy(LeRobotPolicy):
    """LeRobot's ACTPolicy.select_action + processors as a capturable step (module docstring)."""

    ensemble_weights: torch.Tensor   # buffers (register_buffer) with temporal ensembling, declared for the type checker
    ensemble_cumsum: torch.Tensor

    def __init__(self, checkpoint: Checkpoint, inputs: Sequence[BoundInput], input_norms: Dict[str, Normalization],
                 action_norm: Normalization):
        c = checkpoint.field
        self.ensemble_coeff = c("temporal_ensemble_coeff")
        self.n_action_steps = c("n_action_steps")
        chunk_size = c("chunk_size")
        horizon = chunk_size if self.ensemble_coeff is not None else self.n_action_steps
        super().__init__(checkpoint, inputs, input_norms, action_norm, horizon)
        self.model = ACTModel(checkpoint, self.cameras, self.env_input is not None)
        if self.ensemble_coeff is not None:
            weights = torch.exp(-self.ensemble_coeff * torch.arange(chunk_size))
            self.register_buffer("ensemble_weights", weights, persistent=False)
            self.register_buffer("ensemble_cumsum", torch.cumsum(weights, dim=0), persistent=False)

    def weight_modules(self) -> Dict[str, nn.Module]:
        return {"model": self.model}

    def cadence(self) -> Optional[ChunkCadence]:
        """With an action queue: a chunk of ``chunk_size`` rows, ``n_action_steps`` executed
        per chunk in sync mode; the network reads the input ports. Ensembling: none."""
        if self.ensemble_coeff is not None:
            return None
        return ChunkCadence(length=self.model.chunk_size, horizon=self.n_action_steps,
                            reads=tuple(b.port.name for b in self.inputs))

    def state_spec(self) -> List[BufferSpec]:
        a = self.action_dim
        if self.ensemble_coeff is not None:
            return self.base_specs() + [
                BufferSpec(ENSEMBLE, (self.model.chunk_size - 1, a), torch.float32, BufferKind.CHUNK),
                BufferSpec(ENSEMBLE_COUNT, (self.model.chunk_size - 1,), torch.int64, BufferKind.CHUNK)]
        return self.base_specs() + chunk_specs(self.model.chunk_size, a, [b.port for b in self.inputs])

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        self.reset_base(state, episode=episode, seed=seed)

    def _predict(self, state: State) -> torch.Tensor:
        """The network on this step's inputs -> normalised actions [chunk_size, A]."""
        images = [self.normalized(cam, state[cam.port.name]) for cam in self.cameras]
        env = self.normalized(self.env_input, state[self.env_input.port.name]) if self.env_input else None
        return self.model(self.normalized(self.state_input, state[self.state_input.port.name]), env, images)

    def plan(self, state: State, chunk: torch.Tensor) -> None:
        chunk.copy_(self._predict(state))

    def emit(self, state: State, action: torch.Tensor, upcoming: torch.Tensor) -> None:
        chunk = self.action_norm.unnormalize(upcoming)          # element-wise: row 0 is the action's own bits
        state[CHUNK].copy_(chunk)
        state[ACTION].copy_(chunk[0])
        self.advance(state)

    def step(self, state: State) -> None:
        if self.ensemble_coeff is None:
            chunked_step(self, state, self.n_action_steps)
            return
        ensembled = self._ensemble(state, self._predict(state))                             # [chunk, A]
        state[ACTION].copy_(self.action_norm.unnormalize(ensembled[0]))
        state[CHUNK].copy_(self.action_norm.unnormalize(ensembled))
        self.advance(state)

    def _ensemble(self, state: State, actions: torch.Tensor) -> torch.Tensor:
        """ACTTemporalEnsembler.update without its None branch; returns the full ensembled
        sequence [chunk, A] before the first action is consumed, and keeps the rest."""
        ens, count = state[ENSEMBLE], state[ENSEMBLE_COUNT]
        c = count[:, None]                                                                   # [chunk-1, 1]
        avg = ens * self.ensemble_cumsum[torch.clamp(c - 1, min=0)]
        avg = avg + actions[:-1] * self.ensemble_weights[c]
        avg = avg / self.ensemble_cumsum[c]
        full = torch.cat([avg, actions[-1:]])                                               # [chunk, A]
        ens.copy_(full[1:])
        count.copy_(torch.cat([torch.clamp(count[1:] + 1, max=self.model.chunk_size), count.new_ones(1)]))
        return full

