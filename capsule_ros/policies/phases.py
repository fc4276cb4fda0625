"""Batch-first pure functions (the export interface) run over arena buffers.

A module that keeps the export interface (``capsule_ros.policies.export``) computes with
batch-first tensors and returns new values instead of writing its arguments. Served,
its functions run on views of the arena with a batch dimension of one, and the results
are copied back in place. Two shapes of module:

- every step: ``forward(*inputs, *state) -> (action, chunk, *new_state)``;
- a chunking policy (it has ``cadence``): ``observe(*inputs, *state) -> new_state``
  (every step), ``plan(*reads) -> chunk [B, length, A]`` (when a chunk is due) and
  ``emit(action, upcoming, *state) -> (action, chunk, *new_state)`` (the selected row of
  the chunk and the rows after it, ``capsule_ros.chunking``).

``ModuleSteps`` runs either shape for a ``StatefulPolicy`` (the example package's
``gru_chunk`` kind with its module, ``policy.kind: exported`` with the traced programs).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from capsule_ros.runtime.arena import BufferSpec
from capsule_ros.runtime.policy import ACTION, CHUNK, POSITION, STEP, ChunkCadence, State

Function = Callable[..., Tuple[torch.Tensor, ...]]


class ModuleSteps:
    """The functions of one module over the arena (see the module docstring)."""

    def __init__(self, inputs: Sequence[BufferSpec], state: Sequence[BufferSpec], *,
                 forward: Optional[Function] = None, cadence: Optional[ChunkCadence] = None,
                 observe: Optional[Function] = None, plan: Optional[Callable[..., torch.Tensor]] = None,
                 emit: Optional[Function] = None):
        self.inputs = [s.name for s in inputs]
        self.state = [s.name for s in state]
        self.forward, self.cadence = forward, cadence
        self.observe_fn, self.plan_fn, self.emit_fn = observe, plan, emit

    def _store(self, state: State, names: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        """Copy results back in place; one that is a view of the arena (a state passed
        through unchanged) is read before any write."""
        arena = state[ACTION].untyped_storage().data_ptr()
        values = [v.clone() if v.untyped_storage().data_ptr() == arena else v for v in values]
        for name, value in zip(names, values, strict=True):
            state[name].copy_(value[0])

    def _batch(self, state: State, names: Sequence[str]):
        return (state[name].unsqueeze(0) for name in names)

    @staticmethod
    def _advance(state: State) -> None:
        state[STEP].add_(1)
        state[POSITION].add_(1)

    def step(self, state: State) -> None:
        """``forward``: one whole step."""
        assert self.forward is not None
        action, chunk, *new_state = self.forward(*self._batch(state, self.inputs + self.state))
        self._store(state, [ACTION, CHUNK, *self.state], [action, chunk, *new_state])
        self._advance(state)

    def observe(self, state: State) -> None:
        if self.observe_fn is not None:
            self._store(state, self.state, self.observe_fn(*self._batch(state, self.inputs + self.state)))

    def plan(self, state: State, chunk: torch.Tensor) -> None:
        assert self.plan_fn is not None and self.cadence is not None
        chunk.copy_(self.plan_fn(*self._batch(state, self.cadence.reads))[0])

    def emit(self, state: State, action: torch.Tensor, upcoming: torch.Tensor) -> None:
        assert self.emit_fn is not None
        action_out, chunk, *new_state = self.emit_fn(action[None], upcoming[None], *self._batch(state, self.state))
        self._store(state, [ACTION, CHUNK, *self.state], [action_out, chunk, *new_state])
        self._advance(state)


class EagerLoop:
    """A module's step in the loop its author would write without capsule_ros, over static
    batch-first tensors: ``forward`` with the state threaded through, or a chunking
    module's ``observe`` every step, ``plan`` every ``horizon`` steps and ``emit`` of the row
    due. The baseline ``capsule-ros bench step --policy exported`` measures against."""

    def __init__(self, module, inputs: Sequence[torch.Tensor], device: torch.device):
        self.module = module
        self.inputs = list(inputs)
        initial = module.initial_state()
        self.names = [s.name for s in (*module.inputs, *module.state)]
        self.state = [initial[s.name][None].to(device) for s in module.state]
        self.cadence: Optional[ChunkCadence] = getattr(module, "cadence", None)
        self.t = 0
        self.chunk: Optional[torch.Tensor] = None

    def step(self) -> None:
        with torch.inference_mode():
            if self.cadence is None:
                _, _, *new_state = self.module(*self.inputs, *self.state)
            else:
                state = list(self.module.observe(*self.inputs, *self.state))
                index = self.t % self.cadence.horizon
                if index == 0 or self.chunk is None:
                    values = dict(zip(self.names, [*self.inputs, *state], strict=True))
                    self.chunk = self.module.plan(*(values[r] for r in self.cadence.reads))
                rows = torch.clamp(index + torch.arange(self.module.chunk_horizon, device=self.chunk.device),
                                   max=self.cadence.horizon - 1)
                _, _, *new_state = self.module.emit(self.chunk[:, index], self.chunk[:, rows], *state)
            for static, value in zip(self.state, new_state, strict=True):
                static.copy_(value)
        self.t += 1
