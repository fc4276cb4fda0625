"""PolicyRuntime: a policy bound to one state arena, its execution mode and its programs.

This is the unit a capsule is bound to (its fingerprint), and the only object that
touches the arena (through the programs and the mode it owns). It provides mechanism
only: write inputs, step, read outputs, reset, prefill, undo a step, take a capsule's
mark. When to do what is decided above it (``capsule_ros.serving``). The core owns no
loop and no thread, and is not thread-safe: callers serialise. Which program each step
runs is its execution mode's (``capsule_ros.runtime.mode``: the policy's ``step`` by
default; ``capsule_ros.chunking`` for a chunking policy's network only when a chunk is
due); a mode may own threads (the chunking mode's refill worker on a CPU), never the core.

A runtime is built by ``capsule_ros.runtime.builder.build_policy_runtime``, in named
phases; the constructor only keeps what the builder made.

Host <-> device traffic per step is two copies (``capsule_ros.runtime.transfer``): the
whole input region from a staging buffer (pinned on CUDA) into the arena, and the meta +
output region back.

Step guard (``runtime.guard_steps``, on by default): before each step the runtime keeps
a copy of everything a step writes (the arena minus its inputs) in an undo buffer on the
device, so a caller that finds the step failed or produced non-finite outputs can put
the state back exactly as it was (``undo_step``). Cost: one on-device copy of the state
per step (the same copy a snapshot makes; docs/benchmarks.md has the figures).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, MutableMapping, Optional, Sequence

import numpy as np
import torch

from capsule_ros.config import CONFIGURE, ConfigSection, setting
from capsule_ros.errors import InvalidArgument
from capsule_ros.runtime import numerics
from capsule_ros.runtime.arena import STATE_KINDS, BufferKind, StateArena
from capsule_ros.runtime.fingerprint import FingerprintParts, RuntimeIdentity, device_kind
from capsule_ros.runtime.graphs import StepPrograms
from capsule_ros.runtime.marks import ModeMark
from capsule_ros.runtime.mode import ExecutionMode, MarkBytes, StepReport
from capsule_ros.runtime.numerics import FLOAT32_MATMUL_CHOICES, FLOAT32_MATMUL_HIGH, FLOAT32_MATMUL_HIGHEST
from capsule_ros.runtime.policy import ACTION, CHUNK, EPISODE, POSITION, STEP, StatefulPolicy
from capsule_ros.runtime.streams import StreamKeeper, on_stream
from capsule_ros.runtime.transfer import HostTransfer


@dataclass(frozen=True)
class RuntimeConfig(ConfigSection):
    """Where and how the policy runs."""

    SECTION = "runtime"

    device: str = setting("cpu", "cpu, cuda, cuda:N, or auto (cuda when available)",
                          pattern=r"auto|cpu|cuda(:[0-9]+)?", read_only=True)
    cuda_graphs: bool = setting(True, "capture the step as a CUDA graph on a GPU", read_only=True)
    compile: str = setting("auto", "torch.compile the policy's kernels: auto (on CUDA when Triton is present), "
                           "on, off", choices=("auto", "on", "off"), read_only=True)
    deterministic: bool = setting(True, "torch deterministic algorithms (bit-identical replays)", read_only=True)
    float32_matmul: str = setting(
        FLOAT32_MATMUL_HIGHEST, "float32 matrix products on a GPU: highest (full float32, the bits of the policy's "
        "own code, LeRobot's) or high (TensorFloat-32 tensor cores, torch.set_float32_matmul_precision's 'high': "
        "faster, other bits; part of the fingerprint, so capsules and bags keep to it) (docs/vla.md#tf32)",
        choices=FLOAT32_MATMUL_CHOICES, read_only=True)
    debug_checks: bool = setting(False, "check buffer addresses before every graph replay", applies=CONFIGURE)
    cpu_threads: int = setting(1, "torch intra-op threads on CPU (0 = torch's default: the core count, only with "
                               "numerics native)", low=0, high=1024,
                               read_only=True)
    numerics: str = setting(numerics.PORTABLE, numerics.SETTING_DOC, choices=numerics.CHOICES, read_only=True)
    seed: int = setting(0, "seed of the policy's counter-based RNG at reset", low=0, high=2**31 - 1,
                        applies=CONFIGURE)
    guard_steps: bool = setting(True, "keep the state before each step (one on-device copy) so a step that "
                                "fails or outputs non-finite values is undone", read_only=True)
    state_check: bool = setting(True, "at start, check that the policy keeps no state outside its declared buffers: "
                                "steps repeated from a snapshot must give the same bits (five extra steps; skipped "
                                "when deterministic is off)", read_only=True)
    state_check_timing: str = setting(
        "auto", "when the state check runs: before_serving (activation waits for it and fails on a policy that "
        "keeps state outside its buffers), while_serving (policy_node: on a copy of the policy beside the first "
        "steps; a capsule restore waits for its verdict, and after a failed one is refused) or auto (while_serving "
        "on a CPU for a chunking policy, whose check plans chunks a plain start never plans; before_serving "
        "otherwise)", choices=("auto", "before_serving", "while_serving"), read_only=True)
    graph_fallback: str = setting("off", "when the step cannot be captured as a CUDA graph: off (start-up fails, "
                                  "naming the problem) or eager (run it without a graph, slower, with a warning)",
                                  choices=("off", "eager"), read_only=True)

    def check(self) -> None:
        numerics.check_threads(self.numerics, self.cpu_threads)

    @property
    def runs_state_check(self) -> bool:
        """Whether a runtime of this configuration runs the start-up state check (only where
        bit-identity is promised)."""
        return self.state_check and self.deterministic

    def kernel_kind(self) -> str:
        """The device kind the fingerprint binds to (``fingerprint.device_kind``), with
        ``+tf32`` on a GPU whose float32 products run on TensorFloat-32: other kernels,
        other bits."""
        kind = device_kind(self.resolve_device())
        if kind.startswith("cuda") and self.float32_matmul == FLOAT32_MATMUL_HIGH:
            return kind + "+tf32"
        return kind

    def compile_enabled(self, device: torch.device) -> bool:
        if self.compile == "auto":
            if device.type != "cuda":
                return False
            try:
                import triton  # noqa: F401
            except ImportError:
                return False
            return True
        return self.compile == "on"

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgument(f"runtime.device = {self.device!r}: no CUDA device is available")
        return device


def configure_torch(config: RuntimeConfig, device: torch.device) -> str:
    """Process-wide torch settings the determinism contract needs; returns the numerics
    level the runtime records (``numerics.recorded_level``)."""
    numerics.pin(config.numerics)
    if config.deterministic:
        if device.type == "cuda":
            # cuBLAS needs a fixed workspace for deterministic results; must precede its init.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if config.compile_enabled(device):
            torch.use_deterministic_algorithms(True)      # also TorchInductor's flag: its compile needs it
        else:
            # the same switch without importing TorchInductor to set its flag, which
            # ``use_deterministic_algorithms`` does (3 s of a CPU node's start-up; nothing
            # compiles here)
            torch._C._set_deterministic_algorithms(True, warn_only=False)
        # Deterministic mode also fills every new temporary with NaN to expose reads of
        # uninitialised memory: a debugging aid that costs one kernel per temporary.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    if device.type == "cuda":
        # process-wide, like the deterministic switch: each runtime built sets the value its
        # configuration names (CUDA only; a CPU's float32 products stay at the pinned numerics)
        torch.backends.cuda.matmul.allow_tf32 = config.float32_matmul == FLOAT32_MATMUL_HIGH
    if device.type == "cpu" and config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    return numerics.recorded_level(config.numerics)


def release_device_memory(device: torch.device, cublas_workspaces: bool = False) -> None:
    """Collect what was just dropped (cycles included) and hand the CUDA caching
    allocator's free blocks back to the driver, so other processes see the memory.

    ``cublas_workspaces``: free cuBLAS's workspaces too (32 MiB + 1 MiB per stream it ran
    on, which ``empty_cache`` leaves allocated), so that the process is back at what it
    held before configure. Only where no captured graph of this process remains (a node's
    cleanup: its runtime was the only one): a graph replays with the workspace it was
    captured with. The next activation allocates them again while it captures."""
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if cublas_workspaces and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


class StepGuard:
    """The step guard's copy (``runtime.guard_steps``): ``keep`` runs first in every
    program (inside its graph), ``put_back`` restores what the last step changed.
    ``copy``: where the copy lives when its owner keeps it (a fleet slot's range of the
    copy the fleet's programs take of every slot)."""

    def __init__(self, arena: StateArena, copy: Optional[torch.Tensor] = None):
        start, end = arena.layout.byte_range(*STATE_KINDS, BufferKind.OUTPUT)
        self.state = arena.storage[start:end]             # everything a step writes
        self.copy = torch.empty_like(self.state) if copy is None else copy

    def keep(self) -> None:
        self.copy.copy_(self.state)

    def put_back(self, stream: Optional[torch.cuda.Stream]) -> None:
        with on_stream(stream):
            self.state.copy_(self.copy, non_blocking=True)


CHECKED_OUTPUTS = (ACTION, CHUNK)      # the outputs a step's action may reach the robot only if finite


class StepOutputs:
    """Host copies of one step's outputs (the caller owns them)."""

    __slots__ = ("action", "chunk", "step", "position", "episode")

    def __init__(self, action: np.ndarray, chunk: np.ndarray, step: int, position: int, episode: int):
        self.action, self.chunk = action, chunk
        self.step, self.position, self.episode = step, position, episode

    def finite(self) -> bool:
        """Whether every value of ``CHECKED_OUTPUTS`` is finite."""
        return bool(np.isfinite(self.action).all() and np.isfinite(self.chunk).all())


class PolicyRuntime:
    """A policy, its arena, its execution mode and its programs (see the module
    docstring). Made by ``build_policy_runtime``: the constructor assigns what its phases
    built."""

    # Who builds a replica of this runtime (``builder.replica_of``) when a plain one would
    # compute other bits: a fleet slot's replica is a slot of a fleet of the same shape
    # (``capsule_ros.runtime.fleet``). None: ``replica_of`` builds a plain runtime.
    make_replica: Optional[Callable[[str], PolicyRuntime]] = None

    def __init__(self, *, config: RuntimeConfig, device: torch.device, numerics_level: str,
                 policy: StatefulPolicy, arena: StateArena, mode: ExecutionMode, graphs: StepPrograms,
                 transfer: HostTransfer, guard: Optional[StepGuard], fold_outputs: bool, identity: RuntimeIdentity,
                 inputs: Mapping[str, object], stream: Optional[torch.cuda.Stream], streams: StreamKeeper):
        self.config = config
        self.device = device
        self.numerics = numerics_level          # the CPU numerics level its capsules record
        self.policy = policy
        self.arena = arena
        self.layout = arena.layout
        self.mode = mode
        self.graphs = graphs
        self.transfer = transfer
        self.guard = guard
        self.identity = identity
        self.inputs = dict(inputs)              # input buffer name -> what fills it (part of the fingerprint)
        self.stream = stream
        self.streams = streams
        # a GPU step's programs copy their outputs to the host themselves (read_step_outputs)
        self._fold_outputs = fold_outputs
        self._outputs_in_host = False           # the last step's program copied its outputs to the host
        self._text_inputs = dict(policy.text_inputs())
        self._texts: Dict[str, str] = {}        # the text staged into each text input (stage_text)
        for name, text_input in self._text_inputs.items():
            self.stage_text(name, text_input.default)

    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint

    @property
    def fingerprint_parts(self) -> FingerprintParts:
        """The fingerprint's components (capsule headers carry them: ``capsule-ros check``)."""
        return self.identity.parts

    # -- state ------------------------------------------------------------------------------
    def reset(self, episode: int, seed: Optional[int] = None) -> None:
        """Write the policy's initial state (eagerly) for a new episode."""
        self._outputs_in_host = False
        with torch.no_grad(), on_stream(self.stream):
            self.policy.init_state(self.arena.views, episode=episode,
                                   seed=self.config.seed if seed is None else seed)
            self.mode.reset()
        self.synchronize()

    def set_episode(self, episode: int) -> None:
        """Relabel the live state's episode id (a reset from a capsule keeps its state)."""
        self._outputs_in_host = False
        with on_stream(self.stream):
            self.arena[EPISODE].fill_(episode)

    def load_state(self, data: torch.Tensor) -> None:
        """Overwrite the whole arena with ``data`` (uint8, the arena's size), ordered on the
        runtime's stream and complete on return; the mode reads its state back from it."""
        self._outputs_in_host = False
        with on_stream(self.stream):
            self.arena.storage.copy_(data.to(self.device))
        self.synchronize()
        self.mode.resync()

    # -- inputs / step / outputs --------------------------------------------------------------
    @property
    def staging(self) -> Mapping[str, np.ndarray]:
        """name -> numpy view of the host staging buffer of each input (write these)."""
        return self.transfer.staging

    @property
    def input_staging(self) -> torch.Tensor:
        """The whole staging buffer (uint8: one step's inputs, as the input log keeps them)."""
        return self.transfer.input_staging

    @property
    def texts(self) -> MutableMapping[str, str]:
        """name -> the text staged into each text input (``stage_text``; the serving layer's
        text ports write it beside the encoding), which ``prepare_inputs`` reads."""
        return self._texts

    def stage_text(self, name: str, text: str) -> None:
        """Stage the text input ``name`` (``StatefulPolicy.text_inputs``): its encoding into
        the staging buffer, and the text itself, which the policy's ``prepare_inputs`` reads
        on the host. Each text input starts with its default."""
        text_input = self._text_inputs.get(name)
        if text_input is None:
            raise InvalidArgument(f"input {name!r} is not a text input of the policy (text inputs: "
                                  f"{sorted(self._text_inputs)})")
        self.transfer.staging[name][...] = text_input.encode(text)
        self._texts[name] = text

    def load_inputs(self, row: Optional[torch.Tensor] = None) -> bool:
        """Copy the whole staging area (or ``row``, the same bytes from elsewhere, e.g. an
        input log already on the device) into the arena's input region: one copy, ordered
        on the runtime's stream. On CUDA the copy is asynchronous: the staging area must not
        change until the step's outputs are read (``PolicySession.tick`` ensures it). Returns
        whether it copied: a step that reads no input (``reads_inputs``) uploads none. From
        the staging area, a step whose network runs (``ExecutionMode.plans``) first lets the
        policy prepare its inputs on the host (``StatefulPolicy.prepare_inputs``); a ``row``
        already holds them."""
        if not self.mode.reads_inputs():
            return False
        if row is None and self.mode.plans():
            self.policy.prepare_inputs(self.transfer.staging, self._texts)
        self.transfer.upload(self.stream, row)
        return True

    def reads_inputs(self) -> bool:
        """Whether the next step reads its inputs (a chunking policy's consume step reads
        none, and ``load_inputs`` then uploads none): a replay needs a row exactly then."""
        return self.mode.reads_inputs()

    def step(self, *, eager: bool = False) -> StepReport:
        """Run one step over the arena (asynchronous on CUDA): the program the mode chose.
        With the step guard, the state before it is kept first (see ``undo_step``).
        ``eager``: run the captured program's Python instead (the start-up check)."""
        program = self.mode.before_step()
        self.graphs.step(program, eager=eager)
        self._outputs_in_host = self._fold_outputs
        return self.mode.after_step(program, eager)

    @property
    def guarded(self) -> bool:
        return self.guard is not None

    def undo_step(self) -> None:
        """Put the state back as it was before the last ``step`` (guard on; complete on
        return). For a step that raised or whose outputs the caller refused."""
        self._outputs_in_host = False
        if self.guard is None:
            raise InvalidArgument("runtime.guard_steps is off: there is no copy to undo the step with")
        self.guard.put_back(self.stream)
        self.synchronize()
        self.mode.undo()

    def prefill(self, tokens) -> None:
        """Consume a token prefix (from the initial state) through the parallel path."""
        if not self.policy.supports_prefill:
            raise InvalidArgument("this policy has no prefix input (vocab_size = 0)")
        self.graphs.prefill(torch.as_tensor(tokens, dtype=torch.int64))

    def read_outputs(self) -> StepOutputs:
        """Copy meta + outputs to the host (one copy, synchronises the runtime's stream)."""
        self._outputs_in_host = False
        return self._host_outputs(self.transfer.download(self.stream))

    def read_step_outputs(self) -> StepOutputs:
        """``read_outputs`` right after ``step``, with nothing in between that writes the
        arena: on a GPU the step's program already copied them to the host, so this only
        waits for it (one launch fewer per control step)."""
        if not self._outputs_in_host:
            return self.read_outputs()
        self._outputs_in_host = False
        self.wait_for_step()
        return self._host_outputs(self.transfer.outputs)

    def wait_for_step(self) -> None:
        """Block until the last ``step`` (its outputs' copy to the host included) is done."""
        self.synchronize()

    def _host_outputs(self, v: Mapping[str, np.ndarray]) -> StepOutputs:
        if self.config.debug_checks:
            self.mode.check_outputs(v)
        return StepOutputs(v[ACTION].copy(), v[CHUNK].copy(), int(v[STEP][0]), int(v[POSITION][0]),
                           int(v[EPISODE][0]))

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    # -- capsules: the mode's mark ---------------------------------------------------------------
    def mark(self) -> Optional[ModeMark]:
        """The mark a capsule of the live state carries (``capsule_ros.runtime.marks``)."""
        return self.mode.mark()

    def admit(self, mark: Optional[ModeMark], data: MarkBytes, capsule_id: str) -> None:
        """Refuse, before anything changes, a capsule (its mark; its bytes ``data()``, read
        only if needed) whose mode state this runtime cannot take: FingerprintMismatch,
        CorruptCapsule. The capsule store calls it before a restore's copy."""
        self.mode.admit(mark, data, capsule_id)

    def after_restore(self, mark: Optional[ModeMark], kinds: Sequence[BufferKind] = ()) -> None:
        """A restore put a capsule's bytes (of ``kinds`` only, when given) with ``mark``
        into the arena: the mode takes up its state (a chunking mode re-issues a pending
        refill). The restore's caller calls it; the store starts no work."""
        self._outputs_in_host = False
        self.mode.after_restore(mark, kinds)

    def close(self) -> None:
        """Release the arena, graphs, staging and weights (the node's lifecycle ``cleanup``);
        on CUDA the device memory goes back to the driver. The runtime cannot step again."""
        self.synchronize()
        self.mode.close()
        self.graphs.close()
        del self.graphs, self.arena, self.policy, self.guard, self.transfer, self.mode
        self.stream = None
        release_device_memory(self.device)
