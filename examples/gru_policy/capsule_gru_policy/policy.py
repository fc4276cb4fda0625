"""The ``gru_chunk`` policy kind: ``GruChunkModule`` served as a capsule_ros StatefulPolicy.

What lives in the arena (``state_spec``): the ports' input buffers, the GRU hidden state,
the action queue and its index, and the standard meta and output buffers (step,
position, episode, the RNG's (seed, counter), action, chunk). Nothing else is kept
between steps: the module's weights never change, and ``step`` reads the buffers, calls
the pure forward and copies the results back in place, so a capsule (one copy of the
arena) holds the whole episode state, and the step has no host synchronisation and no
data-dependent Python branch, so it is captured as one CUDA graph.
"""
from __future__ import annotations

from typing import List

import torch

from capsule_ros.policies.registry import BuildContext, PolicyKind
from capsule_ros.runtime.arena import BufferSpec
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
from capsule_ros.runtime.weights import load_weights

from .model import GruChunkConfig, GruChunkModule


class GruChunkPolicy(StatefulPolicy):
    """A GRU with an action-chunk queue (see the module docstring)."""

    def __init__(self, module: GruChunkModule):
        super().__init__()
        self.module = module
        self.action_dim, self.chunk_horizon = module.action_dim, module.chunk_horizon
        standard = {s.name for s in standard_specs(self.action_dim, self.chunk_horizon)}
        # the module's own state, less the standard buffers it shares (rng)
        self._own_state = [s for s in module.state if s.name not in standard]
        self._arguments = [s.name for s in module.inputs + module.state]

    def architecture(self) -> dict:
        return {"policy": "gru_chunk", **self.module.cfg.to_mapping(),
                "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype)} for s in self.module.inputs]}

    def state_spec(self) -> List[BufferSpec]:
        return [*self.module.inputs, *self._own_state, *standard_specs(self.action_dim, self.chunk_horizon)]

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        inputs = {s.name for s in self.module.inputs}
        for name, view in state.items():
            if name not in inputs:
                view.zero_()
        for name, value in self.module.initial_state().items():
            state[name].copy_(value)
        state[EPISODE].fill_(episode)
        state[RNG][0] = seed & 0xFFFFFFFF

    def step(self, state: State) -> None:
        # batch of one: views with a leading dimension of 1, no copies
        action, chunk, *new_state = self.module(*(state[name].unsqueeze(0) for name in self._arguments))
        for spec, value in zip(self.module.state, new_state, strict=True):
            state[spec.name].copy_(value[0])
        state[ACTION].copy_(action[0])
        state[CHUNK].copy_(chunk[0])
        state[STEP].add_(1)
        state[POSITION].add_(1)


def seeded_module(cfg: GruChunkConfig, inputs: List[BufferSpec], seed: int) -> GruChunkModule:
    """The module with weights drawn from ``seed``, on the CPU: the same seed gives the same
    weights on every device, and the same as ``capsule-ros export`` of the same settings."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GruChunkModule(cfg, inputs)


def build(context: BuildContext) -> GruChunkPolicy:
    """The policy for the configured ports: seeded weights, then ``policy.weights`` if set
    (a safetensors file with the module's parameter names)."""
    assert isinstance(context.settings, GruChunkConfig)
    module = seeded_module(context.settings, list(context.inputs), context.seed)
    if context.weights is not None:
        load_weights(module, context.weights)
    return GruChunkPolicy(module)


POLICY_KIND = PolicyKind("gru_chunk", GruChunkConfig, build,
                         "a GRU over the observations with an action-chunk queue: one chunk predicted every "
                         "chunk_horizon steps, one action popped per step")
