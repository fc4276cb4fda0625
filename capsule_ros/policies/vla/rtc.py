"""Real-time chunking (RTC) guidance, computed as LeRobot 0.6.1 computes it, without autograd.

LeRobot (``lerobot/policies/rtc/modeling_rtc.py``, ``RTCProcessor.denoise_step``) guides each Euler
step of a flow-matching chunk towards the part of the previous chunk that is still to be
executed (the *leftover*, ``prev``):

    v   = velocity(x_t)                      # computed BEFORE x_t.requires_grad_(True)
    x1  = x_t - time * v
    err = (prev - x1) * w                    # w: the prefix weights, [1, T, 1]
    correction = autograd.grad(x1, x_t, err) # = err: v does not depend on x_t in the graph
    v'  = v - gw(time) * correction

Because the velocity is computed before ``x_t`` requires grad, the vector-Jacobian product
is the identity (a test of LeRobot's own, in ``tests/policies/rtc/``, pins that value), so the
guided velocity is exactly ``v - gw * ((prev - (x_t - time * v)) * w)``: a few element-wise
operations per step, in LeRobot's order, on the device. Everything LeRobot computes on the
host per step (the weights ``w``, the guidance weight ``gw`` from ``tau = 1 - time``) is a
function of the configuration and the delay alone, so it is computed once here, with
LeRobot's float32 arithmetic, and kept as constants: no host synchronisation inside a
chunk, which is what a captured CUDA graph needs.

The leftover (``leftover``): the rows of the chunk being executed from the cursor at the
request step on (rows c .. L - 1, in the model's normalised action units), padded with zero
rows or truncated to the execution horizon H as LeRobot's RTC engine does
(``rollout/inference/rtc.py``, ``_normalize_prev_actions_length``), then zero-padded to the
chunk's [T, max_action_dim] as ``denoise_step`` pads it. The first chunk of an episode has
none (LeRobot passes ``prev_chunk_left_over=None``: no guidance); ``valid`` selects the
unguided velocity then, branch-free.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from capsule_ros.errors import ConfigError

OFF, GUIDED = "off", "guided"
SCHEDULES = ("ZEROS", "ONES", "LINEAR", "EXP")      # LeRobot's RTCAttentionSchedule


@dataclass(frozen=True)
class RTCSettings:
    """``control.rtc`` and its settings, with LeRobot's names (``RTCConfig``).

    ``execution_horizon``: how many leftover rows guide the next chunk (LeRobot's
    ``execution_horizon``); 0: the leftover's own length, L - e (e rows executed per chunk).
    """

    mode: str = OFF
    max_guidance_weight: float = 10.0
    prefix_attention_schedule: str = "LINEAR"
    execution_horizon: int = 0

    def __post_init__(self) -> None:
        if self.mode not in (OFF, GUIDED):
            raise ConfigError(f"control.rtc = {self.mode!r}: one of {OFF!r}, {GUIDED!r}")
        if self.prefix_attention_schedule not in SCHEDULES:
            raise ConfigError(f"control.rtc_prefix_attention_schedule = {self.prefix_attention_schedule!r}: one of "
                              f"{list(SCHEDULES)}")
        if not self.max_guidance_weight > 0:           # LeRobot's RTCConfig refuses it too
            raise ConfigError(f"control.rtc_max_guidance_weight = {self.max_guidance_weight!r}: must be positive")
        if self.execution_horizon < 0:
            raise ConfigError(f"control.rtc_execution_horizon = {self.execution_horizon}: must be >= 0")

    @property
    def guided(self) -> bool:
        return self.mode == GUIDED

    def describe(self) -> dict:
        """What changes the numbers (part of a guided policy's architecture, hence its fingerprint)."""
        return asdict(self) if self.guided else {"mode": OFF}


# --- LeRobot's host-side arithmetic, done once ----------------------------------------------------

def prefix_weights(schedule: str, start: int, end: int, total: int) -> torch.Tensor:
    """``RTCProcessor.get_prefix_weights(start, end, total)``: float32 [total], on the CPU,
    by LeRobot's operations (``start`` = the delay d, ``end`` = the execution horizon H)."""
    start = min(start, end)
    if schedule == "ZEROS":
        weights = torch.zeros(total)
        weights[:start] = 1.0
    elif schedule == "ONES":
        weights = torch.ones(total)
        weights[end:] = 0.0
    else:
        lin = _linweights(start, end, total)
        if schedule == "EXP":
            lin = lin * torch.expm1(lin).div(math.e - 1)
        weights = _add_leading_ones(_add_trailing_zeros(lin, total, end), start, total)
    return weights


def _linweights(start: int, end: int, total: int) -> torch.Tensor:
    skip_steps_at_end = max(total - end, 0)
    linspace_steps = total - skip_steps_at_end - start
    if end <= start or linspace_steps <= 0:
        return torch.tensor([])
    return torch.linspace(1, 0, linspace_steps + 2)[1:-1]


def _add_trailing_zeros(weights: torch.Tensor, total: int, end: int) -> torch.Tensor:
    zeros_len = total - end
    if zeros_len <= 0:
        return weights
    return torch.cat([weights, torch.zeros(zeros_len)])


def _add_leading_ones(weights: torch.Tensor, start: int, total: int) -> torch.Tensor:
    ones_len = min(start, total)
    if ones_len <= 0:
        return weights
    return torch.cat([torch.ones(ones_len), weights])


def guidance_weight(time: float, max_guidance_weight: float) -> float:
    """The guidance weight LeRobot applies at Euler time ``time`` (a float32 value, as a
    Python float): ``min(nan_to_num(c * inv_r2), max)`` with ``tau = 1 - time``, in float32."""
    tau = 1 - time
    max_weight = torch.as_tensor(max_guidance_weight)
    tau_tensor = torch.as_tensor(tau)
    squared_one_minus_tau = (1 - tau_tensor) ** 2
    inv_r2 = (squared_one_minus_tau + tau_tensor ** 2) / squared_one_minus_tau
    c = torch.nan_to_num((1 - tau_tensor) / tau_tensor, posinf=float(max_weight))     # the float32 value, as LeRobot's
    weight = torch.nan_to_num(c * inv_r2, posinf=float(max_weight))
    return float(torch.minimum(weight, max_weight))


# --- the guidance of one chunk --------------------------------------------------------------------

class RTCGuidance(nn.Module):
    """Guided velocities for one policy's chunks (module docstring).

    Built with the settings and the chunk's shape; ``bind`` fixes the numbers that depend on
    the chunk schedule (the delay d and the rows e executed per chunk), which an ``auto``
    delay only knows at activate. The prefix weights are a non-persistent buffer: the
    fingerprint covers the settings (``describe``), the capsule's chunk mark the delay.
    """

    weights: torch.Tensor            # [1, T, 1] float32 (register_buffer), declared for the type checker
    row_index: torch.Tensor          # [T] int64 (register_buffer)

    def __init__(self, settings: RTCSettings, chunk_size: int, action_dim: int, max_action_dim: int,
                 times: Sequence[float]):
        super().__init__()
        if settings.execution_horizon > chunk_size:
            raise ConfigError(f"control.rtc_execution_horizon = {settings.execution_horizon}: at most the chunk's "
                              f"{chunk_size} rows (LeRobot cannot pad a leftover past its chunk either)")
        self.settings = settings
        self.chunk_size, self.action_dim, self.max_action_dim = chunk_size, action_dim, max_action_dim
        self.step_weights: List[float] = [guidance_weight(t, settings.max_guidance_weight) for t in times]
        self.rows = 0                 # H: leftover rows that guide (set by bind)
        self.end = chunk_size         # cursor value at which a chunk is used up (e + d; set by bind)
        self.register_buffer("weights", torch.zeros(1, chunk_size, 1), persistent=False)
        self.register_buffer("row_index", torch.arange(chunk_size), persistent=False)

    def bind(self, delay: int, executed: int) -> Tuple[int, torch.Tensor]:
        """Fix the schedule: delay d, e rows executed per chunk. Returns (H, the weights [T])."""
        self.rows = self.settings.execution_horizon or self.chunk_size - executed
        self.end = executed + delay
        weights = prefix_weights(self.settings.prefix_attention_schedule, delay, self.rows, self.chunk_size)
        self.weights.copy_(weights.reshape(1, -1, 1))
        return self.rows, weights

    def leftover(self, chunk: torch.Tensor, cursor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(prev [1, T, max_action_dim] float32, valid bool []) from ``chunk`` [L, A] (the chunk
        being executed, normalised) and its ``cursor`` [1] at the request step: rows
        c .. c + H - 1 where they exist, zero rows after (module docstring)."""
        length = chunk.shape[0]
        index = cursor + self.row_index                                              # [T]
        keep = (self.row_index < self.rows) & (index < length)
        rows = chunk.index_select(0, torch.clamp(index, max=length - 1))               # [T, A]
        prev = torch.where(keep[:, None], rows, torch.zeros_like(rows))
        if self.max_action_dim > self.action_dim:
            prev = nn.functional.pad(prev, (0, self.max_action_dim - self.action_dim))
        return prev[None], (cursor < self.end).reshape(())

    def guide(self, v_t: torch.Tensor, x_t: torch.Tensor, time: float, step: int, prev: torch.Tensor,
              valid: torch.Tensor) -> torch.Tensor:
        """The guided velocity of Euler step ``step`` at time ``time`` (LeRobot's operations,
        in its order); the unguided ``v_t`` where ``valid`` is false."""
        x1_t = x_t - time * v_t
        err = (prev - x1_t) * self.weights
        guided = v_t - self.step_weights[step] * err
        return torch.where(valid, guided, v_t)

    def describe(self) -> dict:
        return self.settings.describe()


def settings_of(values: Optional[dict]) -> RTCSettings:
    """RTCSettings from a plain mapping (None: off)."""
    return RTCSettings(**values) if values else RTCSettings()
