"""Check capsule_ros's DDPM / DDIM steps against diffusers for every configuration the
fixtures do not cover (run in the LeRobot environment, from the repository root):

    PYTHONPATH=. /work/lerobot-venv/bin/python tools/lerobot_fixtures/check_schedulers.py

Each scheduler type x beta schedule x prediction type x clipping x step count runs a
whole denoising loop on random model outputs with the same variance noise in both, and
the largest difference is printed (0.0 means bit-identical). Exits 1 on any difference.
"""
from __future__ import annotations

import itertools
import sys

import diffusers.schedulers.scheduling_ddpm as ddpm
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from capsule_ros.policies.lerobot.schedulers import NoiseScheduler, SchedulerConfig


def main() -> int:
    torch.manual_seed(0)
    worst = 0.0
    for kind, schedule, prediction, clip, steps in itertools.product(
            ("DDPM", "DDIM"), ("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"), ("epsilon", "sample"),
            (True, False), (10, 7, 100)):
        if kind == "DDIM" and schedule == "sigmoid":          # diffusers' DDIM has no sigmoid schedule
            continue
        reference = (DDPMScheduler if kind == "DDPM" else DDIMScheduler)(
            num_train_timesteps=100, beta_start=1e-4, beta_end=0.02, beta_schedule=schedule, clip_sample=clip,
            clip_sample_range=1.0, prediction_type=prediction)
        reference.set_timesteps(steps)
        ours = NoiseScheduler(SchedulerConfig(kind, 100, steps, schedule, 1e-4, 0.02, prediction, clip, 1.0))
        assert [int(t) for t in reference.timesteps] == ours.timestep_list
        x = torch.randn(1, 16, 3)
        y = x.clone()
        for k, t in enumerate(reference.timesteps):
            model_output, noise = torch.randn(1, 16, 3), torch.randn(1, 16, 3)
            ddpm.randn_tensor = lambda *args, _noise=noise, **kwargs: _noise
            x = reference.step(model_output, t, x).prev_sample
            y = ours.step(k, model_output, y, noise)
        diff = (x - y).abs().max().item()
        worst = max(worst, diff)
        print(f"{kind} {schedule} {prediction} clip={clip} steps={steps}: max abs diff {diff}")
    print(f"worst {worst}")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
