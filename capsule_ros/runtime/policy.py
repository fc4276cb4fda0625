"""The policy protocol: a model declares its state spec and a step over static buffers.

Contract (what makes capsules and CUDA graphs possible):

- ``state_spec()`` declares EVERY buffer the policy reads or writes between steps:
  inputs, KV cache, recurrent / conv state, action-chunk state, metadata, outputs. Nothing
  the policy keeps between steps may live outside these buffers (no Python-side queues,
  no growing tensors, no attributes that change after construction).
- ``step(state)`` reads the input buffers and the state, writes the state and the output
  buffers, all in place. It must be capturable in a CUDA graph: no host synchronisation
  (no ``.item()``, no data-dependent Python control flow), no new persistent tensors.
- ``init_state(state, ...)`` writes the initial state in place (run eagerly, at reset).
- ``prefill(state, tokens)`` (optional) consumes a prefix of token ids through the
  fastest parallel path, from the initial state.

Standard buffers every policy has (the runtime and the node rely on their names):
``step``, ``position``, ``episode``, ``rng`` (meta) and ``action``, ``chunk`` (outputs).
"""
from __future__ import annotations

import abc
from typing import List, Mapping

import torch
from torch import nn

from capsule_ros.runtime.arena import BufferKind, BufferSpec

# Standard buffer names.
STEP = "step"          # int64[1]: control steps taken in this state's history
POSITION = "position"  # int64[1]: tokens consumed (prefix + steps); the KV ring slot is position % context
EPISODE = "episode"    # int64[1]: episode id the state belongs to
RNG = "rng"            # int64[2]: (seed, counter) of the counter-based generator
ACTION = "action"      # float32[action_dim]
CHUNK = "chunk"        # float32[chunk_horizon, action_dim]

State = Mapping[str, torch.Tensor]


def standard_specs(action_dim: int, chunk_horizon: int) -> List[BufferSpec]:
    """The meta and output buffers every policy declares."""
    return [
        BufferSpec(STEP, (1,), torch.int64, BufferKind.META),
        BufferSpec(POSITION, (1,), torch.int64, BufferKind.META),
        BufferSpec(EPISODE, (1,), torch.int64, BufferKind.META),
        BufferSpec(RNG, (2,), torch.int64, BufferKind.META),
        BufferSpec(ACTION, (action_dim,), torch.float32, BufferKind.OUTPUT),
        BufferSpec(CHUNK, (chunk_horizon, action_dim), torch.float32, BufferKind.OUTPUT),
    ]


class StatefulPolicy(nn.Module, abc.ABC):
    """Base class of policies served by capsule_ros (see the module docstring)."""

    action_dim: int
    chunk_horizon: int
    # False for a step that runs outside torch (ONNX Runtime's kernels): torch's CUDA graph
    # capture cannot record it, so the plan runs it eagerly on CUDA too (it may capture its own).
    torch_graph_capture: bool = True

    @abc.abstractmethod
    def state_spec(self) -> List[BufferSpec]:
        """Every buffer, including ``standard_specs(...)`` and the inputs."""

    @abc.abstractmethod
    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        """Write the initial state in place (everything but the inputs)."""

    @abc.abstractmethod
    def step(self, state: State) -> None:
        """One control step over the static buffers (capturable)."""

    def prefill(self, state: State, tokens: torch.Tensor) -> None:
        """Consume a prefix of token ids (int64[P]) from the initial state."""
        raise NotImplementedError(f"{type(self).__name__} has no prefix input")

    @property
    def supports_prefill(self) -> bool:
        return False

    def compile_kernels(self, enabled: bool = True) -> None:
        """Optionally switch to torch.compile'd kernels (the runtime calls it on CUDA)."""

    @abc.abstractmethod
    def architecture(self) -> dict:
        """JSON-able description of the architecture (part of the capsule fingerprint)."""

    def input_specs(self) -> List[BufferSpec]:
        return [s for s in self.state_spec() if s.kind == BufferKind.INPUT]
