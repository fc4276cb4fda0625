"""The flow-matching sampler of LeRobot's VLAs, with the noise from the arena's counter-based RNG.

LeRobot 0.6.1 (``lerobot/policies/common/flow_matching.py``, ``euler_integrate``; SmolVLA, π0 and π0.5
all call it) integrates the velocity field from t = 1 (noise) to t = 0 (actions) by forward
Euler: ``dt = -1 / num_steps``, at step k the time is ``1.0 + k * dt`` and
``x_t <- x_t + dt * v_t``. Each step's time reaches the model as
``torch.tensor(time, dtype=float32, device=device).expand(batch)``: a host-to-device copy per
step. Here the times are made once, by the same conversion, into a constant buffer; the loop
is unrolled over the fixed number of steps, with the same Python floats for ``dt`` (and for
the guidance's ``time``), so a whole chunk runs without a host synchronisation.

The initial noise: LeRobot draws ``torch.normal`` of shape [1, chunk_size, max_action_dim];
capsule_ros draws ``counter_normal(rng, (chunk_size, max_action_dim))`` from the arena's
``rng`` = (seed, counter) at the step that plans the chunk (the counter counts steps since
reset), so the draw is part of the state a capsule restores and an asynchronous request
copies. The parity fixtures feed LeRobot this very draw (``tools/lerobot_fixtures``).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import nn

from capsule_ros.policies.vla.rtc import RTCGuidance
from capsule_ros.runtime.rng import counter_normal

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]    # (x_t [1, T, A], time [1]) -> v_t [1, T, A]


def flow_noise(rng_state: torch.Tensor, chunk_size: int, max_action_dim: int) -> torch.Tensor:
    """The chunk's initial sample x_1, [1, chunk_size, max_action_dim] float32, from the
    generator state ``rng_state`` (int64[2]; only read)."""
    return counter_normal(rng_state, (chunk_size, max_action_dim))[None]


class EulerFlow(nn.Module):
    """``euler_integrate`` over a fixed number of steps (module docstring)."""

    time_values: torch.Tensor        # [num_steps, 1] float32 (register_buffer), declared for the type checker

    def __init__(self, num_steps: int):
        super().__init__()
        if num_steps < 1:
            raise ValueError(f"num_steps = {num_steps}: at least 1")
        self.num_steps = num_steps
        self.dt = -1.0 / num_steps
        self.times: List[float] = [1.0 + step * self.dt for step in range(num_steps)]
        values = torch.stack([torch.tensor(time, dtype=torch.float32).expand(1) for time in self.times])
        self.register_buffer("time_values", values, persistent=False)

    def integrate(self, velocity: Velocity, noise: torch.Tensor, guidance: Optional[RTCGuidance] = None,
                  prev: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x_0 from x_1 = ``noise``; with ``guidance`` (and its leftover ``prev`` / ``valid``)
        each step's velocity is guided as LeRobot's RTC guides it."""
        x_t = noise
        for step, time in enumerate(self.times):
            v_t = velocity(x_t, self.time_values[step])
            if guidance is not None:
                assert prev is not None and valid is not None
                v_t = guidance.guide(v_t, x_t, time, step, prev, valid)
            x_t = x_t + self.dt * v_t
        return x_t
