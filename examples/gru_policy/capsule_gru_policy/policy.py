"""The ``gru_chunk`` policy kind: ``GruChunkModule`` served as a capsule_ros StatefulPolicy.

What lives in the arena (``state_spec``): the ports' input buffers, the GRU hidden state,
the runtime's chunk buffers (the chunk, its cursor, an asynchronous request's copy of the
hidden state) and the standard meta and output buffers (step, position, episode, the
RNG's (seed, counter), action, chunk). Nothing else is kept between steps: the module's
weights never change, and each phase reads the buffers, calls the module's pure function
and copies the results back in place (``capsule_ros.policies.phases``), so a capsule (one
copy of the arena) holds the whole episode state. The GRU update runs at every step, the
head only when a chunk is due; each program of the chunk schedule is captured as a CUDA
graph on a GPU.
"""
from __future__ import annotations

from typing import List

import torch

from capsule_ros.chunking.reference import chunked_step
from capsule_ros.policies.phases import ModuleSteps
from capsule_ros.policies.registry import BuildContext, PolicyKind
from capsule_ros.runtime.arena import BufferSpec
from capsule_ros.runtime.policy import EPISODE, RNG, ChunkCadence, State, StatefulPolicy, chunk_specs, standard_specs
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
        self.steps = ModuleSteps(module.inputs, module.state, cadence=module.cadence, observe=module.observe,
                                 plan=module.plan, emit=module.emit)

    def architecture(self) -> dict:
        return {"policy": "gru_chunk", **self.module.cfg.to_mapping(),
                "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype)} for s in self.module.inputs]}

    def cadence(self) -> ChunkCadence:
        return self.module.cadence

    def state_spec(self) -> List[BufferSpec]:
        reads = [s for s in self.module.state if s.name in self.module.cadence.reads]
        return [*self.module.inputs, *self._own_state, *standard_specs(self.action_dim, self.chunk_horizon),
                *chunk_specs(self.module.cadence.length, self.action_dim, reads)]

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        inputs = {s.name for s in self.module.inputs}
        for name, view in state.items():
            if name not in inputs:
                view.zero_()
        for name, value in self.module.initial_state().items():
            state[name].copy_(value)
        state[EPISODE].fill_(episode)
        state[RNG][0] = seed & 0xFFFFFFFF

    def observe(self, state: State) -> None:
        self.steps.observe(state)

    def plan(self, state: State, chunk: torch.Tensor) -> None:
        self.steps.plan(state, chunk)

    def emit(self, state: State, action: torch.Tensor, upcoming: torch.Tensor) -> None:
        self.steps.emit(state, action, upcoming)

    def step(self, state: State) -> None:
        chunked_step(self, state, self.module.cadence.horizon)


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
                         "a GRU over the observations with an action chunk: the GRU advances every step, its head "
                         "predicts a chunk of chunk_horizon actions when one is due")
