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

Chunking policies (an action-chunk model such as ACT or Diffusion Policy) declare a
``ChunkCadence``: run in the chunking mode (``capsule_ros.chunking``), their network runs
only when a chunk is due, not at every step. Their step is split into phases the mode
schedules on the host:

- ``observe(state)``: what must run at every step (Diffusion's observation history, a
  recurrent update); nothing by default;
- ``plan(state, chunk)``: the network, reading only the buffers ``cadence().reads``
  names (which may include ``chunk.actions`` and ``chunk.cursor``: the chunk it replaces),
  writing a fresh action chunk ``[length, action_dim]`` into ``chunk``;
- ``emit(state, action, upcoming)``: the outputs of one step from the chunk row the
  mode selected (``action`` [A]) and the rows after it (``upcoming`` [chunk_horizon, A]),
  and the step's own bookkeeping (``advance``: step, position, RNG counter).

The chunk, its cursor and an asynchronous request's copy of ``reads`` live in standard
buffers (``chunk_specs``), so a capsule holds them like any other state.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import BufferKind, BufferSpec

# Standard buffer names.
STEP = "step"          # int64[1]: control steps taken in this state's history
POSITION = "position"  # int64[1]: tokens consumed (prefix + steps); the KV ring slot is position % context
EPISODE = "episode"    # int64[1]: episode id the state belongs to
RNG = "rng"            # int64[2]: (seed, counter) of the counter-based generator
ACTION = "action"      # float32[action_dim]
CHUNK = "chunk"        # float32[chunk_horizon, action_dim]

# Standard buffers of a chunking policy (``chunk_specs``).
CHUNK_ACTIONS = "chunk.actions"     # float32[length, action_dim]: the chunk being executed (the policy's units)
CHUNK_CURSOR = "chunk.cursor"       # int64[1]: index of the next row of chunk.actions to execute
CHUNK_PENDING = "chunk.pending"     # int64[1]: 1 while an asynchronous refill request is outstanding
REQUEST_PREFIX = "chunk.request."   # chunk.request.<name>: the request's copy of each buffer plan() reads
# The standard names above: a policy kind that binds a checkpoint's features to buffers keeps them for these.
STANDARD_NAMES = (STEP, POSITION, EPISODE, RNG, ACTION, CHUNK, CHUNK_ACTIONS, CHUNK_CURSOR, CHUNK_PENDING)

State = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ChunkCadence:
    """How a chunking policy uses its chunk (see the module docstring).

    ``length``: rows a ``plan`` writes (ACT: chunk_size; Diffusion: its trajectory from the
    current observation step on). ``horizon``: the policy's own execution horizon, rows
    executed from each chunk before the next one is due unless ``control.execution_horizon``
    says otherwise (LeRobot's ``n_action_steps``). ``reads``: the
    buffers ``plan`` reads, after ``observe`` (an asynchronous request copies exactly
    these). ``inputs_every_step``: whether ``observe`` reads the input buffers (else the
    inputs are uploaded only on steps that plan or request).
    """

    length: int
    horizon: int
    reads: Tuple[str, ...]
    inputs_every_step: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.horizon <= self.length:
            raise ValueError(f"chunk cadence: horizon {self.horizon} must be in [1, length = {self.length}]")
        if not self.reads:
            raise ValueError("chunk cadence: reads must name the buffers plan() reads")


@dataclass(frozen=True)
class TextInput:
    """How a text input buffer is filled: ``encode`` turns a string into the buffer's values
    on the host (e.g. a VLA's tokenizer: int64 [2, max_length]), ``default`` is the text the
    buffer holds until a message arrives (``policy.task``). See ``StatefulPolicy.text_inputs``."""

    encode: Callable[[str], np.ndarray]
    default: str


def chunk_specs(length: int, action_dim: int, reads: Sequence[BufferSpec]) -> List[BufferSpec]:
    """The standard buffers of a chunking policy: the chunk, its cursor and pending flag
    (meta, so the host reads them back with the outputs), and the request's copies."""
    return [BufferSpec(CHUNK_ACTIONS, (length, action_dim), torch.float32, BufferKind.CHUNK),
            BufferSpec(CHUNK_CURSOR, (1,), torch.int64, BufferKind.META),
            BufferSpec(CHUNK_PENDING, (1,), torch.int64, BufferKind.META),
            *(BufferSpec(REQUEST_PREFIX + spec.name, spec.shape, spec.dtype, BufferKind.REQUEST) for spec in reads)]


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
        """One control step over the static buffers (capturable). A chunking policy's
        ``step`` is its every-step reference (``capsule_ros.chunking.reference.chunked_step``);
        the chunking mode runs its phases instead."""

    # -- chunking (optional) ---------------------------------------------------------------------
    def cadence(self) -> Optional[ChunkCadence]:
        """The chunk cadence, or None: the network runs at every step (the default)."""
        return None

    def observe(self, state: State) -> None:
        """Chunking: the part of a step that runs at every step (capturable)."""

    def plan(self, state: State, chunk: torch.Tensor) -> None:
        """Chunking: the network: a fresh chunk into ``chunk`` [length, A] (capturable)."""
        raise NotImplementedError(f"{type(self).__name__} declares no chunk cadence")

    def emit(self, state: State, action: torch.Tensor, upcoming: torch.Tensor) -> None:
        """Chunking: outputs and bookkeeping of one step from the selected rows (capturable)."""
        raise NotImplementedError(f"{type(self).__name__} declares no chunk cadence")

    def bind_schedule(self, schedule: Any) -> None:
        """Chunking: the schedule the chunking mode settled (``capsule_ros.chunking``'s
        ``ChunkSchedule``: refill timing, delay, rows executed per chunk), before any program
        is captured; a policy whose plan depends on it (RTC guidance weights the rows the
        delay covers) keeps what it needs. Nothing by default."""

    def text_inputs(self) -> Dict[str, TextInput]:
        """Input buffers filled from text (a ``std_msgs/msg/String`` port), by buffer name;
        none by default."""
        return {}

    def prepare_inputs(self, staging: Mapping[str, np.ndarray], texts: Mapping[str, str]) -> None:
        """Host work on a step's staged inputs right before they go up, on the steps whose
        network runs (a chunking policy's refill or request; every step of a policy without
        a cadence): fill the input buffers that are a host function of other inputs (π0.5's
        prompt: the staged state and task, tokenised). ``staging``: the host staging buffers
        by name (write in place); ``texts``: the last text staged into each text input
        (``PolicyRuntime.stage_text``). What it writes goes up, and into the input log, with
        the other inputs. Nothing by default."""

    def prefill(self, state: State, tokens: torch.Tensor) -> None:
        """Consume a prefix of token ids (int64[P]) from the initial state."""
        raise NotImplementedError(f"{type(self).__name__} has no prefix input")

    @property
    def supports_prefill(self) -> bool:
        return False

    def check_prefix(self, tokens: Sequence[int]) -> None:
        """ConfigError when ``tokens`` (``policy.prefix``) cannot be prefilled: configure
        checks it, so a bad prefix fails configure instead of every reset at activate."""
        if tokens and not self.supports_prefill:
            raise ConfigError(f"policy.prefix = {list(tokens)}: this policy has no prefix input")

    def compile_kernels(self, enabled: bool = True) -> None:
        """Optionally switch to torch.compile'd kernels (the runtime calls it on CUDA)."""

    @abc.abstractmethod
    def architecture(self) -> dict:
        """JSON-able description of the architecture (part of the capsule fingerprint)."""

    def input_specs(self) -> List[BufferSpec]:
        return [s for s in self.state_spec() if s.kind == BufferKind.INPUT]
