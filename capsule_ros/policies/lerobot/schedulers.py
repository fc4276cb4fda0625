"""The DDPM and DDIM inference steps LeRobot's Diffusion Policy uses (diffusers 0.35 semantics).

LeRobot builds ``DDPMScheduler`` or ``DDIMScheduler`` with ``num_train_timesteps``,
``beta_start``, ``beta_end``, ``beta_schedule``, ``clip_sample``, ``clip_sample_range`` and
``prediction_type`` from its config, everything else at diffusers' defaults
(``timestep_spacing = "leading"``, ``steps_offset = 0``, DDPM ``variance_type =
"fixed_small"``, DDIM ``set_alpha_to_one = True`` and ``eta = 0``), then runs
``set_timesteps(num_inference_steps)`` and one ``step`` per timestep.

Here the per-timestep scalars are computed once, at build time, by the same float32
tensor expressions diffusers evaluates inside ``step``; the in-graph update then applies
them with the same operations in the same order. The noise a DDPM step adds comes from
the caller (the arena's counter-based RNG), not from a generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch
from torch import nn

from capsule_ros.errors import ConfigError

SCHEDULERS = ("DDPM", "DDIM")
PREDICTION_TYPES = ("epsilon", "sample")


def _cosine_betas(n: int, max_beta: float = 0.999) -> torch.Tensor:
    """diffusers' ``betas_for_alpha_bar`` with the cosine transform (``squaredcos_cap_v2``)."""
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return torch.tensor([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)],
                        dtype=torch.float32)


def betas(schedule: str, n: int, start: float, end: float, scheduler: str) -> torch.Tensor:
    if schedule == "linear":
        return torch.linspace(start, end, n, dtype=torch.float32)
    if schedule == "scaled_linear":
        return torch.linspace(start ** 0.5, end ** 0.5, n, dtype=torch.float32) ** 2
    if schedule == "squaredcos_cap_v2":
        return _cosine_betas(n)
    if schedule == "sigmoid" and scheduler == "DDPM":
        return torch.sigmoid(torch.linspace(-6, 6, n)) * (end - start) + start
    raise ConfigError(f"Diffusion beta_schedule = {schedule!r} is not supported by {scheduler}; supported: linear, "
                      f"scaled_linear, squaredcos_cap_v2{', sigmoid' if scheduler == 'DDPM' else ''}")


def leading_timesteps(num_train: int, num_inference: int) -> List[int]:
    """``set_timesteps`` with ``timestep_spacing = "leading"``, ``steps_offset = 0``."""
    if not 1 <= num_inference <= num_train:
        raise ConfigError(f"Diffusion num_inference_steps = {num_inference} must be in [1, num_train_timesteps = "
                          f"{num_train}]")
    ratio = num_train // num_inference
    return [int(t) for t in (np.arange(0, num_inference) * ratio).round()[::-1].astype(np.int64)]


@dataclass(frozen=True)
class SchedulerConfig:
    kind: str                   # DDPM or DDIM
    num_train_timesteps: int
    num_inference_steps: int
    beta_schedule: str
    beta_start: float
    beta_end: float
    prediction_type: str
    clip_sample: bool
    clip_sample_range: float

    @classmethod
    def from_checkpoint(cls, field) -> SchedulerConfig:
        kind = field("noise_scheduler_type", "DDPM")
        if kind not in SCHEDULERS:
            raise ConfigError(f"Diffusion noise_scheduler_type = {kind!r}: supported {list(SCHEDULERS)}")
        prediction = field("prediction_type", "epsilon")
        if prediction not in PREDICTION_TYPES:
            raise ConfigError(f"Diffusion prediction_type = {prediction!r}: supported {list(PREDICTION_TYPES)}")
        num_train = int(field("num_train_timesteps", 100))
        steps = field("num_inference_steps")
        return cls(kind, num_train, num_train if steps is None else int(steps), field("beta_schedule",
                   "squaredcos_cap_v2"), float(field("beta_start", 1e-4)), float(field("beta_end", 0.02)),
                   prediction, bool(field("clip_sample", True)), float(field("clip_sample_range", 1.0)))


class NoiseScheduler(nn.Module):
    """Denoising updates for a fixed list of timesteps (see module docstring).

    ``timesteps`` int64 [S] and ``coeffs`` float32 [S, 5] are non-persistent buffers (a
    pure function of the config). Per step k the columns are:
    DDPM: sqrt(beta_t), sqrt(alpha_t), x0 coeff, sample coeff, sqrt(variance) (0 at t = 0);
    DDIM: sqrt(beta_t), sqrt(alpha_t), sqrt(alpha_prev), direction coeff, unused.
    """

    timesteps: torch.Tensor          # buffers (register_buffer), declared for the type checker
    coeffs: torch.Tensor

    def __init__(self, cfg: SchedulerConfig):
        super().__init__()
        self.cfg = cfg
        self.timestep_list = leading_timesteps(cfg.num_train_timesteps, cfg.num_inference_steps)
        alphas_cumprod = torch.cumprod(1.0 - betas(cfg.beta_schedule, cfg.num_train_timesteps, cfg.beta_start,
                                                   cfg.beta_end, cfg.kind), dim=0)
        rows = [self._ddpm_row(alphas_cumprod, k) if cfg.kind == "DDPM" else self._ddim_row(alphas_cumprod, t)
                for k, t in enumerate(self.timestep_list)]
        self.register_buffer("timesteps", torch.tensor(self.timestep_list, dtype=torch.int64), persistent=False)
        self.register_buffer("coeffs", torch.stack([torch.stack(r) for r in rows]), persistent=False)

    def _ddpm_row(self, ac: torch.Tensor, k: int) -> List[torch.Tensor]:
        """DDPMScheduler.step / _get_variance scalars for the k-th timestep."""
        t = self.timestep_list[k]
        prev_t = self.timestep_list[k + 1] if k + 1 < len(self.timestep_list) else -1
        one = torch.tensor(1.0)
        alpha_prod_t = ac[t]
        alpha_prod_t_prev = ac[prev_t] if prev_t >= 0 else one
        beta_prod_t = 1 - alpha_prod_t
        beta_prod_t_prev = 1 - alpha_prod_t_prev
        current_alpha_t = alpha_prod_t / alpha_prod_t_prev
        current_beta_t = 1 - current_alpha_t
        x0_coeff = (alpha_prod_t_prev ** 0.5 * current_beta_t) / beta_prod_t
        sample_coeff = current_alpha_t ** 0.5 * beta_prod_t_prev / beta_prod_t
        variance = (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
        std = torch.clamp(variance, min=1e-20) ** 0.5 if t > 0 else torch.tensor(0.0)
        return [beta_prod_t ** 0.5, alpha_prod_t ** 0.5, x0_coeff, sample_coeff, std]

    def _ddim_row(self, ac: torch.Tensor, t: int) -> List[torch.Tensor]:
        """DDIMScheduler.step scalars (eta = 0) for timestep t."""
        prev_t = t - self.cfg.num_train_timesteps // self.cfg.num_inference_steps
        alpha_prod_t = ac[t]
        alpha_prod_t_prev = ac[prev_t] if prev_t >= 0 else torch.tensor(1.0)
        beta_prod_t = 1 - alpha_prod_t
        variance = ((1 - alpha_prod_t_prev) / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
        std_dev_t = 0.0 * variance ** 0.5
        direction = (1 - alpha_prod_t_prev - std_dev_t ** 2) ** 0.5
        return [beta_prod_t ** 0.5, alpha_prod_t ** 0.5, alpha_prod_t_prev ** 0.5, direction, torch.tensor(0.0)]

    @property
    def noise_rows(self) -> int:
        """Rows of noise a sampling run takes: the initial sample, then one per step."""
        return len(self.timestep_list) + 1

    def step(self, k: int, model_output: torch.Tensor, sample: torch.Tensor,
             noise: Optional[torch.Tensor]) -> torch.Tensor:
        """x_t -> x_{t-1} at the k-th timestep; ``noise`` like ``sample`` (DDPM, t > 0)."""
        c = self.coeffs[k]
        cfg = self.cfg
        epsilon: Optional[torch.Tensor]
        if cfg.prediction_type == "epsilon":
            x0, epsilon = (sample - c[0] * model_output) / c[1], model_output
        else:
            x0 = model_output
            epsilon = (sample - c[1] * x0) / c[0] if cfg.kind == "DDIM" else None   # from the unclipped x0
        if cfg.clip_sample:
            x0 = x0.clamp(-cfg.clip_sample_range, cfg.clip_sample_range)
        if cfg.kind == "DDPM":
            prev = c[2] * x0 + c[3] * sample
            if self.timestep_list[k] > 0:
                assert noise is not None, "a DDPM step at t > 0 adds noise"
                prev = prev + c[4] * noise
            return prev
        assert epsilon is not None                 # DDIM: set above for either prediction type
        return c[2] * x0 + c[3] * epsilon
