"""Diffusion Policy as LeRobot 0.4 runs it at inference, as a StatefulPolicy.

The network (parameter names are LeRobot's, under ``diffusion.``): per camera image a
resize (``resize_shape``, torchvision's antialiased bilinear, after normalisation as in
LeRobot), a centre crop, a ResNet trunk (group norm by default), spatial softmax keypoints and a
linear + ReLU (``rgb_encoder``, shared by the cameras or one per camera); the
per-observation-step condition is [state, camera features..., env state]; the
``n_obs_steps`` most recent conditions, flattened, condition a 1-D U-Net with FiLM
(``unet``) that denoises a ``horizon x action_dim`` trajectory over the scheduler's
timesteps (DDPM or DDIM, ``schedulers.py``). Actions ``n_obs_steps - 1`` onwards,
``n_action_steps`` of them, go to the action queue.

Episode state in the arena:

- ``diffusion.obs.<port>`` [n_obs_steps, *port shape] in the port's dtype, CONV, one per
  input: the raw values of the last ``n_obs_steps`` steps, oldest first. Each is a fixed
  sliding window over time (shift by one, append), which is what a causal-convolution
  state is, hence CONV. On the first step of an episode (``step == 0``) the window is
  filled with copies of the current input, as LeRobot's ``populate_queues`` does. The
  windows hold raw inputs, not encoded features: LeRobot encodes the ``n_obs_steps``
  frames as one batch at each inference, and the CPU convolutions give different last
  bits for a batch of one frame (7.6e-7 on the features of the diffusion fixture, which
  the sampling loop amplifies past 1e-5 on the actions), so the encoder sees the same
  batch here. Normalisation is element-wise, so normalising the
  window at use is exact.
- a chunk cadence (``capsule_ros.chunking``): ``chunk.actions`` holds the
  sampled trajectory from the current observation step on (rows ``n_obs_steps - 1`` ..
  ``horizon - 1``, normalised), ``chunk.cursor`` the row to execute next. In sync mode
  ``n_action_steps`` rows are executed per chunk, as LeRobot's action deque does; the
  rest of the trajectory is what async mode executes while the next chunk is sampled.
  ``chunk`` (output) is the unnormalised rest of the executed rows, current action first,
  padded with the last action.
- the sampling noise is drawn at each plan from the arena's ``rng`` (seed, counter), as
  ``counter_normal(rng, (num_inference_steps + 1, horizon, A))``: row 0 the initial
  sample, row k + 1 the noise of denoising step k; the counter advances by one per step.

Phases: ``observe`` (every step) appends the inputs to their windows; ``plan`` is the
observation encoder over the whole windows (``n_obs_steps`` frames per camera, as
LeRobot's inference does) and the sampling loop (``num_inference_steps`` U-Net passes);
it reads the windows and ``rng`` only, which an async request copies.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from capsule_ros.chunking.reference import chunked_step
from capsule_ros.policies.binding import Requirement
from capsule_ros.policies.lerobot.checkpoint import Checkpoint, Normalization
from capsule_ros.policies.lerobot.common import (
    RESNET_CHANNELS,
    NormFactory,
    resize_image,
    resnet_feature_size,
    resnet_trunk,
)
from capsule_ros.policies.lerobot.features import OBS_STATE, VISUAL, BoundInput
from capsule_ros.policies.lerobot.policy import LeRobotPolicy
from capsule_ros.policies.lerobot.schedulers import NoiseScheduler, SchedulerConfig
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.policy import ACTION, CHUNK, RNG, STEP, ChunkCadence, State, chunk_specs
from capsule_ros.runtime.rng import counter_normal

OBS_PREFIX = "diffusion.obs."
BUFFER_NAMES: tuple = ()


def _resize_valid(resize: Any) -> bool:
    return resize is None or (isinstance(resize, (list, tuple)) and len(resize) == 2
                              and all(isinstance(d, int) and d > 0 for d in resize))


def _camera_sizes(checkpoint: Checkpoint) -> List[List[int]]:
    return [list(f.shape[1:]) for f in checkpoint.inputs.values() if f.type == VISUAL]


def _cropped_from(checkpoint: Checkpoint) -> List[List[int]]:
    """The image sizes the crop is taken from: resize_shape, else the cameras'."""
    resize, images = checkpoint.field("resize_shape"), _camera_sizes(checkpoint)
    return [list(resize)] if resize is not None and images else images


def _crop_fits(checkpoint: Checkpoint) -> bool:
    crop = checkpoint.field("crop_shape")
    return crop is None or all(crop[0] <= s[0] and crop[1] <= s[1] for s in _cropped_from(checkpoint))


def _last_action_step(checkpoint: Checkpoint) -> int:
    return checkpoint.field("horizon") - checkpoint.field("n_obs_steps") + 1


# The Diffusion options this implementation reproduces (in order: a row may assume those before hold).
REQUIREMENTS = (
    Requirement(lambda ck: _resize_valid(ck.field("resize_shape")),
                lambda ck: f"Diffusion resize_shape = {ck.field('resize_shape')!r}: must be a pair of positive "
                           "integers (as LeRobot's)"),
    Requirement(lambda ck: ck.field("spatial_softmax_num_keypoints") is not None,
                lambda ck: "Diffusion spatial_softmax_num_keypoints = null is not supported"),
    Requirement(lambda ck: not (ck.field("use_group_norm", True) and ck.field("pretrained_backbone_weights")),
                lambda ck: "Diffusion use_group_norm with pretrained_backbone_weights: LeRobot refuses it too"),
    Requirement(lambda ck: OBS_STATE in ck.inputs,
                lambda ck: f"Diffusion needs an {OBS_STATE!r} input feature"),
    Requirement(lambda ck: ck.field("horizon") % (2 ** len(ck.field("down_dims"))) == 0,
                lambda ck: f"Diffusion horizon = {ck.field('horizon')} is not a multiple of 2^len(down_dims)"),
    Requirement(lambda ck: 1 <= ck.field("n_action_steps") <= _last_action_step(ck),
                lambda ck: f"Diffusion n_action_steps = {ck.field('n_action_steps')} must be in [1, horizon - "
                           f"n_obs_steps + 1 = {_last_action_step(ck)}]"),
    Requirement(lambda ck: all(size == _camera_sizes(ck)[0] for size in _camera_sizes(ck)),
                lambda ck: f"Diffusion camera features have different sizes {_camera_sizes(ck)}; LeRobot needs one "
                           "size"),
    Requirement(_crop_fits,
                lambda ck: f"Diffusion crop_shape = {list(ck.field('crop_shape'))} does not fit the camera images "
                           f"{'resized to ' if ck.field('resize_shape') is not None else ''}"
                           f"{(_cropped_from(ck) or [[]])[0]}"),
)


# --- observation encoder ----------------------------------------------------------------------


class SpatialSoftmax(nn.Module):
    """1x1 conv to K keypoint maps, softmax over pixels, expected (x, y) on ``pos_grid``."""

    pos_grid: torch.Tensor           # a buffer (register_buffer), declared for the type checker

    def __init__(self, channels: int, height: int, width: int, keypoints: int):
        super().__init__()
        self.nets = nn.Conv2d(channels, keypoints, kernel_size=1)
        self.keypoints, self.pixels = keypoints, height * width
        pos_x, pos_y = np.meshgrid(np.linspace(-1.0, 1.0, width), np.linspace(-1.0, 1.0, height))
        grid = np.concatenate([pos_x.reshape(-1, 1), pos_y.reshape(-1, 1)], axis=1)
        self.register_buffer("pos_grid", torch.from_numpy(grid).float())                # [h w, 2] (in the file)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, K, 2]."""
        attention = F.softmax(self.nets(features).reshape(-1, self.pixels), dim=-1)
        return (attention @ self.pos_grid).view(-1, self.keypoints, 2)


class RgbEncoder(nn.Module):
    """LeRobot's DiffusionRgbEncoder in eval mode: resize (``resize_shape``), centre crop,
    trunk, keypoints, linear + ReLU."""

    def __init__(self, checkpoint: Checkpoint, height: int, width: int):
        super().__init__()
        c = checkpoint.field
        resize = c("resize_shape")
        self.resize = None if resize is None else (int(resize[0]), int(resize[1]))
        if self.resize is not None:
            height, width = self.resize
        crop = c("crop_shape")
        self.crop = None
        if crop is not None:
            ch, cw = int(crop[0]), int(crop[1])
            # torchvision's center_crop offsets (Python's round: halves to even)
            self.crop = (int(round((height - ch) / 2.0)), int(round((width - cw) / 2.0)), ch, cw)
            height, width = ch, cw
        norm: NormFactory
        if c("use_group_norm", True):
            def norm(channels: int) -> nn.Module:
                return nn.GroupNorm(channels // 16, channels)
        else:
            norm = nn.BatchNorm2d
        self.backbone = nn.Sequential(*resnet_trunk(c("vision_backbone", "resnet18"), norm).values())
        keypoints = int(c("spatial_softmax_num_keypoints"))
        self.pool = SpatialSoftmax(RESNET_CHANNELS, *resnet_feature_size(height, width), keypoints)
        self.feature_dim = 2 * keypoints
        self.out = nn.Linear(2 * keypoints, self.feature_dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised images [B, 3, H, W] -> features [B, feature_dim]."""
        if self.resize is not None:
            images = resize_image(images, self.resize)
        if self.crop is not None:
            top, left, ch, cw = self.crop
            images = images[..., top:top + ch, left:left + cw]
        keypoints = self.pool(self.backbone(images))                                      # [B, K, 2]
        return F.relu(self.out(torch.flatten(keypoints, start_dim=1)))


# --- U-Net --------------------------------------------------------------------------------------


class Conv1dBlock(nn.Module):
    """Conv1d -> GroupNorm -> Mish (``block.0/1/2``)."""

    def __init__(self, cin: int, cout: int, kernel: int, groups: int):
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(cin, cout, kernel, padding=kernel // 2), nn.GroupNorm(groups, cout),
                                   nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class ResidualBlock(nn.Module):
    """Two conv blocks with FiLM from the condition in between, plus a (1x1) shortcut."""

    def __init__(self, cin: int, cout: int, cond_dim: int, kernel: int, groups: int, film_scale: bool):
        super().__init__()
        self.cout, self.film_scale = cout, film_scale
        self.conv1 = Conv1dBlock(cin, cout, kernel, groups)
        self.cond_encoder = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, 2 * cout if film_scale else cout))
        self.conv2 = Conv1dBlock(cout, cout, kernel, groups)
        self.residual_conv = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        out = self.conv1(x)
        embed = self.cond_encoder(cond).unsqueeze(-1)                                     # [1, C or 2C, 1]
        if self.film_scale:
            out = embed[:, :self.cout] * out + embed[:, self.cout:]
        else:
            out = out + embed
        return self.conv2(out) + self.residual_conv(x)


class ConditionalUnet1d(nn.Module):
    """LeRobot's DiffusionConditionalUnet1d (same modules, same names)."""

    def __init__(self, checkpoint: Checkpoint, global_cond_dim: int):
        super().__init__()
        c = checkpoint.field
        dims = [int(d) for d in c("down_dims")]
        embed_dim, kernel, groups = int(c("diffusion_step_embed_dim")), int(c("kernel_size")), int(c("n_groups"))
        film = bool(c("use_film_scale_modulation", True))
        cond_dim = embed_dim + global_cond_dim
        self.diffusion_step_encoder = nn.Sequential()
        self.diffusion_step_encoder.add_module("1", nn.Linear(embed_dim, 4 * embed_dim))
        self.diffusion_step_encoder.add_module("3", nn.Linear(4 * embed_dim, embed_dim))
        self.embed_dim = embed_dim

        def block(cin: int, cout: int) -> ResidualBlock:
            return ResidualBlock(cin, cout, cond_dim, kernel, groups, film)

        in_out = [(checkpoint.action_dim, dims[0])] + list(zip(dims[:-1], dims[1:], strict=True))
        self.down_modules = nn.ModuleList(
            nn.ModuleList([block(cin, cout), block(cout, cout),
                           nn.Conv1d(cout, cout, 3, 2, 1) if i < len(in_out) - 1 else nn.Identity()])
            for i, (cin, cout) in enumerate(in_out))
        self.mid_modules = nn.ModuleList([block(dims[-1], dims[-1]), block(dims[-1], dims[-1])])
        # LeRobot's "is_last" test never holds on the way up: every up stage ends with an upsampling
        self.up_modules = nn.ModuleList(
            nn.ModuleList([block(2 * cin, cout), block(cout, cout), nn.ConvTranspose1d(cout, cout, 4, 2, 1)])
            for cout, cin in reversed(in_out[1:]))
        self.final_conv = nn.Sequential(Conv1dBlock(dims[0], dims[0], kernel, 8),   # LeRobot: default 8 groups
                                        nn.Conv1d(dims[0], checkpoint.action_dim, 1))

    def timestep_embedding(self, timestep: torch.Tensor) -> torch.Tensor:
        """DiffusionSinusoidalPosEmb, then Linear, Mish, Linear: int64 [1] -> [1, embed_dim]."""
        half = self.embed_dim // 2
        scale = math.log(10000) / (half - 1)
        emb = torch.exp(torch.arange(half, device=timestep.device) * -scale)
        emb = timestep.unsqueeze(-1) * emb.unsqueeze(0)
        emb = torch.cat((emb.sin(), emb.cos()), dim=-1)
        first, second = self.diffusion_step_encoder
        return second(F.mish(first(emb)))

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, global_cond: torch.Tensor) -> torch.Tensor:
        """x [1, horizon, A], timestep int64 [1], global_cond [1, G] -> [1, horizon, A]."""
        x = x.transpose(1, 2)                                                             # [1, A, horizon]
        cond = torch.cat([self.timestep_embedding(timestep), global_cond], dim=-1)
        skips: List[torch.Tensor] = []
        for resnet, resnet2, downsample in cast(Sequence[Sequence[nn.Module]], self.down_modules):
            x = resnet2(resnet(x, cond), cond)
            skips.append(x)
            x = downsample(x)
        for mid in self.mid_modules:
            x = mid(x, cond)
        for resnet, resnet2, upsample in cast(Sequence[Sequence[nn.Module]], self.up_modules):
            x = torch.cat((x, skips.pop()), dim=1)
            x = upsample(resnet2(resnet(x, cond), cond))
        return self.final_conv(x).transpose(1, 2)


class DiffusionModel(nn.Module):
    """``diffusion.*``: the observation encoder(s), the U-Net and the noise scheduler."""

    def __init__(self, checkpoint: Checkpoint, cameras: Sequence[BoundInput], cond_per_step: int):
        super().__init__()
        c = checkpoint.field
        self.separate = bool(c("use_separate_rgb_encoder_per_camera", False))
        self.rgb_encoder: nn.Module
        if cameras:
            h, w = cameras[0].image_size
            if self.separate:
                self.rgb_encoder = nn.ModuleList(RgbEncoder(checkpoint, h, w) for _ in cameras)
            else:
                self.rgb_encoder = RgbEncoder(checkpoint, h, w)
        self.unet = ConditionalUnet1d(checkpoint, cond_per_step * int(c("n_obs_steps")))
        self.scheduler = NoiseScheduler(SchedulerConfig.from_checkpoint(c))

    def encode_cameras(self, frames: torch.Tensor) -> torch.Tensor:
        """Normalised frames [S, N, 3, H, W] (steps, cameras) -> features [S, N * F], batched
        exactly as LeRobot's ``_prepare_global_conditioning``: one (s n) batch through the
        shared encoder, or one batch of S per camera through its own encoder."""
        steps = frames.shape[0]
        if self.separate:
            encoders = cast(Sequence[nn.Module], self.rgb_encoder)                # one per camera
            return torch.cat([encoder(frames[:, n]) for n, encoder in enumerate(encoders)], dim=-1)
        return self.rgb_encoder(frames.flatten(0, 1)).reshape(steps, -1)

    def sample(self, global_cond: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The scheduler's denoising loop: global_cond [1, G], noise [S + 1, horizon, A]
        -> trajectory [horizon, A] (normalised actions)."""
        x = noise[0][None]
        for k in range(len(self.scheduler.timestep_list)):
            out = self.unet(x, self.scheduler.timesteps[k:k + 1], global_cond)
            x = self.scheduler.step(k, out, x, noise[k + 1][None])
        return x[0]


class DiffusionPolicy(LeRobotPolicy):
    """LeRobot's DiffusionPolicy.select_action + processors as a capturable step (module docstring)."""

    def __init__(self, checkpoint: Checkpoint, inputs: Sequence[BoundInput], input_norms: Dict[str, Normalization],
                 action_norm: Normalization):
        c = checkpoint.field
        self.n_obs_steps, self.n_action_steps, self.horizon = c("n_obs_steps"), c("n_action_steps"), c("horizon")
        super().__init__(checkpoint, inputs, input_norms, action_norm, self.n_action_steps)
        keypoint_dim = 2 * int(c("spatial_softmax_num_keypoints"))
        self.cond_dim = sum(b.shape[0] for b in (self.state_input, self.env_input) if b is not None)
        self.cond_dim += keypoint_dim * len(self.cameras)
        self.diffusion = DiffusionModel(checkpoint, self.cameras, self.cond_dim)
        self.chunk_length = self.horizon - self.n_obs_steps + 1

    def weight_modules(self) -> Dict[str, nn.Module]:
        return {"diffusion": self.diffusion}

    def _windows(self) -> List[BufferSpec]:
        return [BufferSpec(OBS_PREFIX + b.port.name, (self.n_obs_steps, *b.port.shape), b.port.dtype, BufferKind.CONV)
                for b in self.inputs]

    def cadence(self) -> ChunkCadence:
        """The trajectory from the current observation step on; ``n_action_steps`` of it
        executed per chunk in sync mode; the windows are appended at every step."""
        return ChunkCadence(length=self.chunk_length, horizon=self.n_action_steps,
                            reads=(*(w.name for w in self._windows()), RNG), inputs_every_step=True)

    def state_spec(self) -> List[BufferSpec]:
        base = self.base_specs()
        rng = next(spec for spec in base if spec.name == RNG)
        return base + self._windows() + chunk_specs(self.chunk_length, self.action_dim, [*self._windows(), rng])

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        self.reset_base(state, episode=episode, seed=seed)

    def observe(self, state: State) -> None:
        """Append this step's inputs to their windows (fill them on the episode's first step)."""
        first = state[STEP] == 0                                                          # [1] bool
        for b in self.inputs:
            window, current = state[OBS_PREFIX + b.port.name], state[b.port.name]
            shifted = torch.cat([window[1:], current[None]])
            window.copy_(torch.where(first, current.expand_as(window), shifted))

    def global_condition(self, state: State) -> torch.Tensor:
        """[1, n_obs_steps * cond_dim]: per step [state, camera features, env], time-major."""
        def window(b: BoundInput) -> torch.Tensor:
            return self.normalized(b, state[OBS_PREFIX + b.port.name])
        parts = [window(self.state_input)]                                                # [S, n]
        if self.cameras:
            parts.append(self.diffusion.encode_cameras(torch.stack([window(c) for c in self.cameras], dim=1)))
        if self.env_input is not None:
            parts.append(window(self.env_input))
        return torch.cat(parts, dim=-1).reshape(1, -1)

    def plan(self, state: State, chunk: torch.Tensor) -> None:
        """Sample a trajectory from the windows with this step's noise; keep it from the
        current observation step on."""
        noise = counter_normal(state[RNG], (self.diffusion.scheduler.noise_rows, self.horizon, self.action_dim))
        trajectory = self.diffusion.sample(self.global_condition(state), noise)          # [horizon, A]
        chunk.copy_(trajectory[self.n_obs_steps - 1:])

    def emit(self, state: State, action: torch.Tensor, upcoming: torch.Tensor) -> None:
        chunk = self.action_norm.unnormalize(upcoming)          # element-wise: row 0 is the action's own bits
        state[CHUNK].copy_(chunk)
        state[ACTION].copy_(chunk[0])
        self.advance(state)

    def step(self, state: State) -> None:
        chunked_step(self, state, self.n_action_steps)
