"""The GRU action-chunk policy as pure functions, and its settings.

A chunking policy (capsule_ros's chunk cadence, docs/bring-your-own-policy.md): the module
declares ``cadence`` and three pure, batch-first functions that write nothing; the
served policy (``policy.py``) runs them over its arena buffers, and ``capsule-ros export``
traces each into the ``.pt2`` program, so the exported program computes exactly what the
``gru_chunk`` kind computes.

- ``observe(*inputs, *state) -> new_state`` runs at every step: the observation (every
  input, flattened, concatenated) is encoded and fed through ``layers`` stacked GRU cells;
  the hidden state ``gru.h`` advances;
- ``plan(gru.h) -> chunk [B, chunk_horizon, A]`` runs only when a chunk is due (every
  ``chunk_horizon`` steps in sync mode): the head on the last layer's hidden state;
- ``emit(action, upcoming, *state) -> (action, chunk, *new_state)``: the action is the
  chunk row the runtime selected (plus optional Gaussian noise from the counter-based
  generator kept in ``rng``), the published chunk the rows from it on; the counter moves on.

The chunk itself and its cursor are the runtime's standard buffers (``chunk.actions``,
``chunk.cursor``), not the module's state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from capsule_ros.config import ConfigSection, dims, setting
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.policy import RNG, ChunkCadence
from capsule_ros.runtime.rng import counter_normal

HIDDEN = "gru.h"            # float32[layers, hidden]: the GRU's hidden state


@dataclass(frozen=True)
class GruChunkConfig(ConfigSection):
    """Shape of the GRU action-chunk policy (every field shapes the graph: read-only)."""

    SECTION = "policy.gru_chunk"

    hidden: int = setting(64, "GRU hidden size", low=1, high=4096, read_only=True)
    layers: int = setting(1, "stacked GRU cells", low=1, high=16, read_only=True)
    action_dim: int = setting(2, "action values per step", low=1, high=1024, read_only=True)
    chunk_horizon: int = setting(8, "actions per predicted chunk; in sync chunking a new chunk every chunk_horizon "
                                 "steps", low=1, high=1024, read_only=True)
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
    """The policy's phases as pure, batch-first functions (see the module docstring).

    It follows capsule_ros's export interface for chunking policies: ``inputs`` and
    ``state`` list the tensors the phases take (shapes without the batch dimension),
    ``initial_state()`` gives the state of a new episode, ``action_dim`` /
    ``chunk_horizon`` size the outputs, ``cadence`` says how the chunk is used.
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
            BufferSpec(RNG, (2,), torch.int64, BufferKind.META),      # seeded by the runtime at every reset
        ]
        self.cadence = ChunkCadence(length=cfg.chunk_horizon, horizon=cfg.chunk_horizon, reads=(HIDDEN,),
                                    inputs_every_step=True)
        self.encoder = nn.Linear(sum(dims(s.shape) for s in self.inputs), cfg.hidden)
        self.input_gates = nn.ModuleList(nn.Linear(cfg.hidden, 3 * cfg.hidden) for _ in range(cfg.layers))
        self.hidden_gates = nn.ModuleList(nn.Linear(cfg.hidden, 3 * cfg.hidden) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.hidden, cfg.chunk_horizon * cfg.action_dim)
        # a constant of the step, made once: a step allocates no persistent tensor
        self.register_buffer("rng_advance", torch.tensor([0, 1]), persistent=False)

    def initial_state(self) -> Dict[str, torch.Tensor]:
        """The state of a new episode: a zero hidden state (rng is seeded by the runtime)."""
        return {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in self.state}

    def observe(self, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """(*inputs, hidden, rng) -> (new hidden, rng): the GRU update of this step."""
        n = len(self.inputs)
        inputs, (hidden, rng) = tensors[:n], tensors[n:]
        batch = hidden.shape[0]
        x = torch.tanh(self.encoder(torch.cat([t.reshape(batch, -1).float() for t in inputs], dim=-1)))
        layers = []
        for i, (input_gates, hidden_gates) in enumerate(zip(self.input_gates, self.hidden_gates, strict=True)):
            x = gru_cell(x, hidden[:, i], input_gates, hidden_gates)
            layers.append(x)
        return torch.stack(layers, dim=1), rng

    def plan(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, layers, hidden] -> a chunk [B, chunk_horizon, A] from the last layer."""
        batch = hidden.shape[0]
        return (self.cfg.action_scale * torch.tanh(self.head(hidden[:, -1]))).view(
            batch, self.chunk_horizon, self.action_dim)

    def emit(self, action: torch.Tensor, upcoming: torch.Tensor, hidden: torch.Tensor,
             rng: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """(selected row [B, A], rows from it on [B, H, A], hidden, rng) ->
        (action, chunk, hidden, rng advanced)."""
        if self.cfg.action_noise_std > 0:         # a setting, fixed at construction: not data-dependent
            action = action + self.cfg.action_noise_std * counter_normal(rng[0], (self.action_dim,))
        return action, upcoming, hidden, rng + self.rng_advance
