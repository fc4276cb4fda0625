"""What every flow-matching VLA policy shares as a StatefulPolicy (SmolVLA, π0, π0.5).

A kind subclasses ``VLAPolicy`` and writes only its model: ``encode_prefix(state)`` (images,
task tokens and state through the VLM, giving the prefix K/V and whatever else the
velocity reads) and ``velocity(prefix, x_t, time)`` (one pass of the action expert over
that prefix). Everything else is here:

- the chunk cadence (``capsule_ros.chunking``): a chunk of ``chunk_size`` rows in the
  model's normalised action units (``chunk.actions``), ``n_action_steps`` of them executed per
  chunk in sync mode (LeRobot's ``select_action`` queue), the plan reading the inputs, the
  task tokens and ``rng`` (and, with RTC guidance, the chunk being executed and its
  cursor): exactly what an asynchronous request copies;
- the plan: the initial noise from the arena's counter-based RNG (``flow.flow_noise``), the
  prefix, the Euler loop with optional RTC guidance (``flow.EulerFlow``, ``rtc.RTCGuidance``),
  the chunk cut to the action's own dimensions;
- ``emit``: the action unnormalised as LeRobot's postprocessor does, the rest of the
  executed rows as the published chunk;
- the task input (``tokens.py``): the token buffer int64 [2, max_length] is either the INPUT
  buffer of a ``std_msgs/msg/String`` port (``text_inputs`` tells the session how to encode a
  message into it, and the ``policy.task`` default it starts with), or, without a task port,
  a state buffer ``vla.task`` that every episode starts with the ``policy.task`` tokens. Either
  way the tokens are arena bytes: a capsule holds them, a pending request holds the copy it
  plans from, and a new task takes effect at the next chunk, as in LeRobot.

The prefix K/V of a chunk is scratch: made and consumed inside one plan, never state.
Between steps the policy's state is the chunk, its cursor, a pending request, the task
tokens and the RNG counter.
"""
from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from capsule_ros.chunking.reference import chunked_step
from capsule_ros.chunking.schedule import ChunkSchedule, RefillTiming
from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import Checkpoint, Normalization
from capsule_ros.policies.lerobot.features import BoundInput
from capsule_ros.policies.lerobot.policy import LeRobotPolicy
from capsule_ros.policies.vla.flow import EulerFlow, flow_noise
from capsule_ros.policies.vla.rtc import RTCGuidance, RTCSettings
from capsule_ros.policies.vla.side_by_side import SideBySide
from capsule_ros.policies.vla.tokens import MASK, TOKENS, TaskTokenizer
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.policy import (
    ACTION,
    CHUNK,
    CHUNK_ACTIONS,
    CHUNK_CURSOR,
    RNG,
    ChunkCadence,
    State,
    TextInput,
    chunk_specs,
)

TASK_BUFFER = "vla.task"        # the task tokens when no port feeds them


class VLAPolicy(LeRobotPolicy):
    """Base of the flow-matching VLA policies (module docstring)."""

    def __init__(self, checkpoint: Checkpoint, inputs: Sequence[BoundInput], input_norms: Dict[str, Normalization],
                 action_norm: Normalization, *, tokenizer: TaskTokenizer, task_port: Optional[BufferSpec],
                 default_task: str, chunk_size: int, n_action_steps: int, max_action_dim: int, num_steps: int,
                 rtc: RTCSettings):
        super().__init__(checkpoint, inputs, input_norms, action_norm, n_action_steps)
        if not 1 <= n_action_steps <= chunk_size:
            raise ConfigError(f"n_action_steps = {n_action_steps}: must be in [1, chunk_size = {chunk_size}]")
        if self.action_dim > max_action_dim:
            raise ConfigError(f"the action has {self.action_dim} values, more than max_action_dim = {max_action_dim}")
        self.tokenizer = tokenizer
        self.default_task = default_task
        self.chunk_size, self.n_action_steps = chunk_size, n_action_steps
        self.max_action_dim = max_action_dim
        shape = (2, tokenizer.max_length)
        if task_port is not None and (tuple(task_port.shape) != shape or task_port.dtype != torch.int64):
            raise ConfigError(f"port {task_port.name!r} feeds the task: it must be int64 {list(shape)} (token ids and "
                              f"their mask, max_length {tokenizer.max_length}), not {task_port.dtype} "
                              f"{list(task_port.shape)}")
        self.task_spec = (BufferSpec(task_port.name, shape, torch.int64, BufferKind.INPUT) if task_port is not None
                          else BufferSpec(TASK_BUFFER, shape, torch.int64, BufferKind.CHUNK))
        self.default_tokens = tokenizer.encode(default_task)
        self.flow = EulerFlow(num_steps)
        self.rtc = rtc
        self.guidance = (RTCGuidance(rtc, chunk_size, self.action_dim, max_action_dim, self.flow.times)
                         if rtc.guided else None)
        self.side_by_side = SideBySide()           # independent calls (cameras, projections) side by side on a GPU

    # -- what a kind writes ---------------------------------------------------------------------
    @abc.abstractmethod
    def encode_prefix(self, state: State) -> Any:
        """The chunk's prefix from the plan's reads (images, task tokens, state): scratch."""

    @abc.abstractmethod
    def velocity(self, prefix: Any, x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """v_t [1, chunk_size, max_action_dim] float32 at ``x_t`` and ``time`` [1] float32."""

    # -- the task tokens ------------------------------------------------------------------------
    def task_tokens(self, state: State, exact_length: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids int64 [1, n], mask bool [1, n]) as LeRobot's preprocessor hands them to the
        model. ``exact_length``: n is the number of tokens (``padding: longest`` on a CPU: the
        host reads the count from the arena, which is CPU memory there); else the buffer's
        whole length (what ``max_length`` padding gives, and a captured graph can run)."""
        buffer = state[self.task_spec.name]
        ids, mask = buffer[TOKENS], buffer[MASK]
        if exact_length:
            n = int(mask.sum())
            ids, mask = ids[:n], mask[:n]
        return ids[None], mask[None].bool()

    def text_inputs(self) -> Dict[str, TextInput]:
        if self.task_spec.kind != BufferKind.INPUT:
            return {}
        return {self.task_spec.name: TextInput(self.tokenizer.encode, self.default_task)}

    # -- StatefulPolicy -------------------------------------------------------------------------
    def _reads(self) -> List[str]:
        names = [b.port.name for b in self.inputs] + [self.task_spec.name, RNG]
        return names + ([CHUNK_ACTIONS, CHUNK_CURSOR] if self.guidance is not None else [])

    def cadence(self) -> ChunkCadence:
        return ChunkCadence(length=self.chunk_size, horizon=self.n_action_steps, reads=tuple(self._reads()))

    def state_spec(self) -> List[BufferSpec]:
        base = self.base_specs() + [self.task_spec]
        chunk = chunk_specs(self.chunk_size, self.action_dim, [])
        by_name = {spec.name: spec for spec in base + chunk}
        return base + chunk_specs(self.chunk_size, self.action_dim, [by_name[name] for name in self._reads()])

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        self.reset_base(state, episode=episode, seed=seed)
        if self.task_spec.kind != BufferKind.INPUT:
            state[self.task_spec.name].copy_(torch.from_numpy(self.default_tokens))

    def bind_schedule(self, schedule: ChunkSchedule) -> None:
        if self.guidance is None:
            return
        if schedule.timing != RefillTiming.ASYNC:
            raise ConfigError("control.rtc guided needs control.chunking async: RTC guides a chunk planned while the "
                              "previous one is executing (LeRobot's select_action refuses RTC too)")
        self.guidance.bind(schedule.delay, schedule.execution_horizon)

    def plan(self, state: State, chunk: torch.Tensor) -> None:
        """Noise, prefix, the Euler loop (guided by the leftover with RTC); the chunk in the
        model's normalised units, cut to the action's dimensions (LeRobot's unpadding)."""
        noise = flow_noise(state[RNG], self.chunk_size, self.max_action_dim)
        prev = valid = None
        if self.guidance is not None:
            prev, valid = self.guidance.leftover(state[CHUNK_ACTIONS], state[CHUNK_CURSOR])
        prefix = self.encode_prefix(state)
        actions = self.flow.integrate(lambda x_t, time: self.velocity(prefix, x_t, time), noise, self.guidance,
                                      prev, valid)
        chunk.copy_(actions[0, :, :self.action_dim])

    def emit(self, state: State, action: torch.Tensor, upcoming: torch.Tensor) -> None:
        rows = self.action_norm.unnormalize(upcoming)           # element-wise: row 0 is the action's own bits
        state[CHUNK].copy_(rows)
        state[ACTION].copy_(rows[0])
        self.advance(state)

    def step(self, state: State) -> None:
        chunked_step(self, state, self.n_action_steps)

    def architecture(self) -> dict:
        """Beside the checkpoint's: the task buffer and tokenizer, the denoising steps, the RTC
        settings, and the versions of transformers and tokenizers (kernel keys of the
        fingerprint: their code computes the layers and the tokens)."""
        import tokenizers
        import transformers
        out = super().architecture()
        out.update(task={"buffer": self.task_spec.name, "tokenizer": self.tokenizer.describe()},
                   denoise_steps=self.flow.num_steps, rtc=self.rtc.describe(),
                   transformers=transformers.__version__, tokenizers=tokenizers.__version__)
        return out
