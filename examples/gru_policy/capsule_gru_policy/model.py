"""The GRU action-chunk policy as a pure function, and its settings.

``GruChunkModule.forward(*inputs, *state) -> (action, chunk, *new_state)`` computes one
control step from the observation and the state, batch first, and writes nothing: the
served policy (``policy.py``) copies the new state into its arena buffers, and
``capsule-ros export`` traces this very module into a ``.pt2`` program. One forward serves
both, so the exported program computes exactly what the ``gru_chunk`` kind computes.

One step:

- the observation (every input, flattened, concatenated) is encoded and fed through
  ``layers`` stacked GRU cells; the hidden state ``gru.h`` advances on every step;
- every ``chunk_horizon`` steps (when ``queue.index`` is 0) the head predicts a chunk of
  ``chunk_horizon`` actions into the queue ``queue.actions``; on the other steps the
  queue is kept. The choice is ``torch.where`` on the counter, not a Python ``if``: the
  step has one fixed sequence of kernels, which is what a CUDA graph replays;
- the action is ``queue[index]`` (plus optional Gaussian noise from the counter-based
  generator kept in ``rng``); the published chunk is the queue from ``index`` on, its last
  action repeated to fill the horizon; then ``index`` advances modulo the horizon.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from capsule_ros.config import ConfigSection, dims, setting
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.policy import RNG
from capsule_ros.runtime.rng import counter_normal

HIDDEN = "gru.h"            # float32[layers, hidden]: the GRU's hidden state
QUEUE = "queue.actions"     # float32[chunk_horizon, action_dim]: the chunk being executed
INDEX = "queue.index"       # int64[1]: the queue entry this step executes


@dataclass(frozen=True)
class GruChunkConfig(ConfigSection):
    """Shape of the GRU action-chunk policy (every field shapes the graph: read-only)."""

    SECTION = "policy.gru_chunk"

    hidden: int = setting(64, "GRU hidden size", low=1, high=4096, read_only=True)
    layers: int = setting(1, "stacked GRU cells", low=1, high=16, read_only=True)
    action_dim: int = setting(2, "action values per step", low=1, high=1024, read_only=True)
    chunk_horizon: int = setting(8, "actions per predicted chunk; a new chunk every chunk_horizon steps",
                                 low=1, high=1024, read_only=True)
    action_scale: float = setting(1.0, "actions are action_scale * tanh(head)", low=1e-6, high=1e6, read_only=True)
    action_noise_std: float = setting(0.0, "std of Gaussian noise added to each action (counter-based RNG in "
                                      "the state)", low=0.0, high=1e6, read_only=True)


def gru_cell(x: torch.Tensor, h: torch.Tensor, input_gates: nn.Linear, hidden_gates: nn.Linear) -> torch.Tensor:
    """One GRU cell (the torch.nn.GRUCell equations), written out so that eager and
    exported runs execute the same operations."""
    r_in, z_in, n_in = input_gates(x).chunk(3, dim=-1)
    r_h, z_h, n_h = hidden_gates(h).chunk(3, dim=-1)
    reset = torch.sigmoid(r_in + r_h)
    update = torch.sigmoid(z_in + z_h)
    candidate = torch.tanh(n_in + reset * n_h)
    return (1 - update) * candidate + update * h


class GruChunkModule(nn.Module):
    """The policy's step as a pure, batch-first function (see the module docstring).

    It follows capsule_ros's export interface: ``inputs`` and ``state`` list the tensors
    ``forward`` takes (shapes without the batch dimension), ``initial_state()`` gives the
    state of a new episode, and ``action_dim`` / ``chunk_horizon`` size the outputs.
    """

    def __init__(self, cfg: GruChunkConfig, inputs: Sequence[BufferSpec]):
        super().__init__()
        if not inputs:
            raise ValueError("the GRU chunk policy needs at least one input")
        self.cfg = cfg
        self.action_dim, self.chunk_horizon = cfg.action_dim, cfg.chunk_horizon
        self.inputs: List[BufferSpec] = [BufferSpec(s.name, s.shape, s.dtype, BufferKind.INPUT) for s in inputs]
        self.state: List[BufferSpec] = [
            BufferSpec(HIDDEN, (cfg.layers, cfg.hidden), torch.float32, BufferKind.RECURRENT),
            BufferSpec(QUEUE, (cfg.chunk_horizon, cfg.action_dim), torch.float32, BufferKind.CHUNK),
            BufferSpec(INDEX, (1,), torch.int64, BufferKind.CHUNK),
            BufferSpec(RNG, (2,), torch.int64, BufferKind.META),      # seeded by the runtime at every reset
        ]
        self.encoder = nn.Linear(sum(dims(s.shape) for s in self.inputs), cfg.hidden)
        self.input_gates = nn.ModuleList(nn.Linear(cfg.hidden, 3 * cfg.hidden) for _ in range(cfg.layers))
        self.hidden_gates = nn.ModuleList(nn.Linear(cfg.hidden, 3 * cfg.hidden) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.hidden, cfg.chunk_horizon * cfg.action_dim)
        # constants of the step, made once: a step allocates no persistent tensor
        self.register_buffer("offsets", torch.arange(cfg.chunk_horizon), persistent=False)
        self.register_buffer("rng_advance", torch.tensor([0, 1]), persistent=False)

    def initial_state(self) -> Dict[str, torch.Tensor]:
        """The state of a new episode: an empty queue at index 0, a zero hidden state."""
        return {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in self.state}

    def forward(self, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        n = len(self.inputs)
        inputs, (hidden, queue, index, rng) = tensors[:n], tensors[n:]
        batch = hidden.shape[0]
        horizon, action_dim = self.chunk_horizon, self.action_dim
        x = torch.tanh(self.encoder(torch.cat([t.reshape(batch, -1).float() for t in inputs], dim=-1)))
        layers = []
        for i, (input_gates, hidden_gates) in enumerate(zip(self.input_gates, self.hidden_gates, strict=True)):
            x = gru_cell(x, hidden[:, i], input_gates, hidden_gates)
            layers.append(x)
        predicted = (self.cfg.action_scale * torch.tanh(self.head(x))).view(batch, horizon, action_dim)
        refill = (index == 0).view(batch, 1, 1)
        new_queue = torch.where(refill, predicted, queue)
        ahead = torch.clamp(index + self.offsets, max=horizon - 1)                   # [B, H]
        upcoming = torch.gather(new_queue, 1, ahead.unsqueeze(-1).expand(batch, horizon, action_dim))
        action = upcoming[:, 0]
        if self.cfg.action_noise_std > 0:         # a setting, fixed at construction: not data-dependent
            action = action + self.cfg.action_noise_std * counter_normal(rng[0], (action_dim,))
        return (action, upcoming, torch.stack(layers, dim=1), new_queue, torch.remainder(index + 1, horizon),
                rng + self.rng_advance)
