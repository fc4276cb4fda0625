"""PolicyRuntime: a policy bound to one state arena and one graph plan.

This is the unit a capsule is bound to (its fingerprint), and the only object that
touches the arena. It provides mechanism only: write inputs, step, read outputs, reset,
prefill, replica. When to do what is decided above it (``capsule_ros.serving``); the
runtime owns no loop and no thread, and is not thread-safe: callers serialise.

Host <-> device traffic per step is two copies: the whole input region from a staging
buffer (pinned on CUDA) into the arena, and the meta + output region back.

Step guard (``runtime.guard_steps``, on by default): before each step the runtime keeps
a copy of everything a step writes (the arena minus its inputs) in an undo buffer on the
device, so a caller that finds the step failed or produced non-finite outputs can put
the state back exactly as it was (``undo_step``). Cost: one on-device copy of the state
per step (the same copy a snapshot makes; docs/benchmarks.md has the figures).

Chunking policies (``StatefulPolicy.cadence()``) run through a ``ChunkExecutor``
(``capsule_ros.runtime.chunking``): the host picks each step's program (refill, consume,
and in async mode request / adopt) from a mirror of the chunk cursor, so a step that only
consumes the chunk runs no network and, when the policy's every-step part reads no
inputs, uploads none.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, MutableMapping, Optional, Tuple

import numpy as np
import torch

from capsule_ros.config import CONFIGURE, ConfigSection, setting
from capsule_ros.errors import ConfigError, InvalidArgument
from capsule_ros.runtime import numerics
from capsule_ros.runtime.arena import STATE_KINDS, ArenaLayout, BufferKind, StateArena
from capsule_ros.runtime.chunking import (
    ChunkExecutor,
    ChunkMark,
    ChunkSchedule,
    InlineRefill,
    RefillReport,
    RefillWorker,
    StreamRefill,
    ThreadRefill,
    measured_delay,
)
from capsule_ros.runtime.contract import check_state_contract
from capsule_ros.runtime.fingerprint import (
    FingerprintParts,
    compute_fingerprint,
    device_kind,
    fingerprint_parts,
    weights_digest,
)
from capsule_ros.runtime.plan import STEP_PROGRAM, GraphPlan
from capsule_ros.runtime.policy import ACTION, CHUNK, CHUNK_CURSOR, EPISODE, POSITION, STEP, StatefulPolicy
from capsule_ros.runtime.streams import on_stream

LOG = logging.getLogger(__name__)


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
    graph_fallback: str = setting("off", "when the step cannot be captured as a CUDA graph: off (start-up fails, "
                                  "naming the problem) or eager (run it without a graph, slower, with a warning)",
                                  choices=("off", "eager"), read_only=True)

    def check(self) -> None:
        numerics.check_threads(self.numerics, self.cpu_threads)

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
        torch.use_deterministic_algorithms(True)
        # Deterministic mode also fills every new temporary with NaN to expose reads of
        # uninitialised memory: a debugging aid that costs one kernel per temporary.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    if device.type == "cpu" and config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    return numerics.recorded_level(config.numerics)


def runtime_identity(policy: StatefulPolicy, config: RuntimeConfig,
                     inputs: Optional[Mapping[str, object]] = None) -> Tuple[str, FingerprintParts]:
    """The fingerprint and its parts (``FingerprintParts``) a PolicyRuntime of ``policy``
    will have, computed without building it (no arena, no device memory: the node's
    ``configure`` knows them before ``activate``), from one pass over the weights."""
    architecture, layout = policy.architecture(), ArenaLayout(policy.state_spec())
    weights, kind = weights_digest(policy), device_kind(config.resolve_device())
    return (compute_fingerprint(architecture, layout, weights, kind, dict(inputs or {})),
            fingerprint_parts(architecture, layout, weights, kind, dict(inputs or {})))


def release_device_memory(device: torch.device) -> None:
    """Collect what was just dropped (cycles included) and hand the CUDA caching
    allocator's free blocks back to the driver, so other processes see the memory."""
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class ChunkingOptions:
    """How a chunking policy's chunks are scheduled (``control.chunking`` and friends;
    ignored for other policies). ``delay``: steps (async), None = measure at start
    (``auto``: the refill's p99 over ``rate_hz``). ``horizon``: rows executed per chunk,
    0 = the policy's. ``worker``: ``auto`` (a thread on a CPU, a stream on a GPU) or
    ``inline`` (plans at request time on the caller's thread: same bits, no overlap)."""

    mode: str = "sync"
    delay: Optional[int] = None
    horizon: int = 0
    rate_hz: float = 20.0
    worker: str = "auto"
    auto_runs: int = 5


class StreamKeeper:
    """The CUDA streams of runtimes that come and go (the node's lifecycle, a benchmark's
    cycles): one per device and role, reused by every runtime made with this keeper.

    Why: cuBLAS keeps a workspace for every stream it has ever run on (docs/benchmarks.md,
    "Lifecycle: first active step and cleanup"), and
    ``torch.cuda.empty_cache`` does not free it; a fresh stream per activation would leave
    one behind each cycle. Freeing all workspaces instead would pull them from under CUDA
    graphs that other runtimes in the process have captured. The owner outlives the
    runtimes (the node holds one); a runtime made without a keeper gets its own.
    """

    def __init__(self) -> None:
        self._streams: Dict[tuple, torch.cuda.Stream] = {}

    def get(self, device: torch.device, role: str = "step") -> Optional[torch.cuda.Stream]:
        """The stream for ``role`` on ``device`` (None on a CPU)."""
        if device.type != "cuda":
            return None
        key = (device, role)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]


class StepOutputs:
    """Host copies of one step's outputs (the caller owns them)."""

    __slots__ = ("action", "chunk", "step", "position", "episode")

    def __init__(self, action: np.ndarray, chunk: np.ndarray, step: int, position: int, episode: int):
        self.action, self.chunk = action, chunk
        self.step, self.position, self.episode = step, position, episode


class PolicyRuntime:
    """A policy, its arena and its graph plan (see module docstring)."""

    def __init__(self, policy: StatefulPolicy, config: RuntimeConfig = RuntimeConfig(), *,
                 inputs: Optional[Mapping[str, object]] = None, streams: Optional[StreamKeeper] = None,
                 stream_role: str = "step", policy_checked: bool = False, chunking: ChunkingOptions = ChunkingOptions(),
                 _fingerprint: Optional[str] = None, _parts: Optional[FingerprintParts] = None):
        """``inputs``: input buffer name -> what fills it (part of the fingerprint; the
        node passes each port's binding). ``streams``: where the CUDA stream comes from
        (``StreamKeeper``; ``stream_role`` names which of its streams). Raises
        PolicyStepError (a ConfigError) when the policy's step cannot run on its declared
        inputs or cannot be captured, and PolicyStateError when it keeps state outside its
        buffers (``runtime.state_check``; skipped with ``policy_checked``, for a replica whose
        policy passed it with the original). ``chunking``: the chunk schedule of a chunking
        policy (ConfigError when its numbers cannot work)."""
        self.config = config
        self.device = config.resolve_device()
        self.numerics = configure_torch(config, self.device)     # the level its capsules record
        self.policy = policy.to(self.device).eval()
        for p in self.policy.parameters():
            p.requires_grad_(False)
        if config.compile_enabled(self.device):
            self.policy.compile_kernels(True)
        self.layout = ArenaLayout(policy.state_spec())
        self.arena = StateArena(self.layout, self.device)
        self._streams = streams or StreamKeeper()
        self.stream = self._streams.get(self.device, stream_role)
        self.chunking = chunking
        self.refill_seconds: List[float] = []           # timed plans (async auto delay), for reports
        self.executor = self._chunk_executor(policy, chunking) if policy.cadence() is not None else None
        state_start, state_end = self.layout.byte_range(*STATE_KINDS, BufferKind.OUTPUT)
        self._state_region = self.arena.storage[state_start:state_end]
        self._undo = torch.empty_like(self._state_region) if config.guard_steps else None
        # a GPU step's outputs come back inside its graph (see _programs; read_step_outputs)
        self._fold_outputs = self.device.type == "cuda" and config.cuda_graphs and policy.torch_graph_capture
        self._outputs_in_host = False       # the last step's program copied its outputs to the host
        self.plan = GraphPlan(policy, self.arena, use_graphs=config.cuda_graphs, stream=self.stream,
                              debug_checks=config.debug_checks, eager_fallback=config.graph_fallback == "eager",
                              programs=self._programs())
        self.inputs = dict(inputs or {})
        if _fingerprint is None:
            _fingerprint, _parts = runtime_identity(policy, config, self.inputs)
        self.fingerprint = _fingerprint
        self._parts = _parts
        pin = self.device.type == "cuda"
        in_start, in_end = self.layout.byte_range(BufferKind.INPUT)
        self.input_staging = torch.zeros(in_end - in_start, dtype=torch.uint8, pin_memory=pin)
        self._staging_views: Dict[str, np.ndarray] = {}
        for slot in self.layout:
            if slot.spec.kind == BufferKind.INPUT:
                raw = self.input_staging[slot.offset - in_start:slot.end - in_start]
                self._staging_views[slot.spec.name] = raw.view(slot.spec.dtype).view(slot.spec.shape).numpy()
        self._text_inputs = dict(policy.text_inputs())
        self._texts: Dict[str, str] = {}
        for name, text_input in self._text_inputs.items():
            self.stage_text(name, text_input.default)
        out_start, out_end = self.layout.byte_range(BufferKind.META, BufferKind.OUTPUT)
        self._input_region = self.arena.storage[in_start:in_end]       # views made once: no per-step slicing
        self._output_region = self.arena.storage[out_start:out_end]
        self._out_host = torch.zeros(out_end - out_start, dtype=torch.uint8, pin_memory=pin)
        self._out_views = {}
        for slot in self.layout:
            if slot.spec.kind in (BufferKind.META, BufferKind.OUTPUT):
                raw = self._out_host[slot.offset - out_start:slot.end - out_start]
                self._out_views[slot.spec.name] = raw.view(slot.spec.dtype).view(slot.spec.shape).numpy()
        self.reset(episode=0)
        self.plan.prepare()
        if self.executor is not None and self.executor.worker is not None:
            self.executor.worker.prepare()
        if config.state_check and config.deterministic and not policy_checked:
            check_state_contract(self)
        LOG.info("runtime on %s: arena %d bytes in %d buffers, graphs=%s, fingerprint %s",
                 self.device, self.layout.nbytes, len(self.layout), self.plan.captured, self.fingerprint[:12])

    def _programs(self) -> Dict[str, Callable[[], None]]:
        """The plan's programs: the policy's step, or its chunk schedule's. With the step
        guard each begins by keeping the state it may change (``undo_step``); on a GPU each
        ends by copying meta + outputs to the pinned host buffer ``read_step_outputs``
        reads. Both copies are inside the program's graph: two launches fewer per step."""
        programs = self.executor.programs() if self.executor is not None else {
            STEP_PROGRAM: lambda: self.policy.step(self.arena.views)}
        undo, state = self._undo, self._state_region
        fold_outputs = self._fold_outputs

        def wrapped(program: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                if undo is not None:
                    undo.copy_(state)
                program()
                if fold_outputs:
                    self._out_host.copy_(self._output_region, non_blocking=True)
            return run
        if undo is None and not fold_outputs:
            return programs
        return {name: wrapped(program) for name, program in programs.items()}

    # -- state ------------------------------------------------------------------------------
    def _chunk_executor(self, policy: StatefulPolicy, options: ChunkingOptions) -> ChunkExecutor:
        """The chunk schedule, its refill worker (async) and, for ``auto``, the measured delay."""
        cadence = policy.cadence()
        assert cadence is not None
        worker: Optional[RefillWorker] = None
        delay = options.delay or 0
        if options.mode == "async":
            worker = self._refill_worker(cadence, options)
            if options.delay is None:
                worker.prepare()
                self.refill_seconds = self._time_refills(worker, options.auto_runs)
                delay = measured_delay(self.refill_seconds, options.rate_hz)
                LOG.info("inference_delay_steps auto: refill p99 %.1f ms at %.1f Hz -> %d steps",
                         max(self.refill_seconds) * 1e3, options.rate_hz, delay)
        try:
            schedule = ChunkSchedule.resolve(cadence, options.mode, delay, options.horizon)
        except ConfigError as exc:
            if options.mode != "async" or options.delay is not None:
                raise
            raise ConfigError(f"inference_delay_steps auto measured a refill of {max(self.refill_seconds) * 1e3:.1f} "
                              f"ms (p99 of {len(self.refill_seconds)}) at control.rate_hz {options.rate_hz:g}: "
                              f"{delay} steps with its margin; {exc}") from None
        LOG.info("chunk schedule: %s", schedule.describe())
        policy.bind_schedule(schedule)
        return ChunkExecutor(policy, self.arena, cadence, schedule, worker)

    def _refill_worker(self, cadence, options: ChunkingOptions) -> RefillWorker:
        if options.worker == "inline":
            return InlineRefill(self.policy, self.arena, cadence, self.stream)
        if self.device.type == "cuda":
            return StreamRefill(self.policy, self.arena, cadence, self._streams.get(self.device, "refill"),
                                use_graphs=self.config.cuda_graphs)
        return ThreadRefill(self.policy, self.arena, cadence, None)

    def _time_refills(self, worker: RefillWorker, runs: int) -> List[float]:
        """Seconds of ``runs`` plans on the worker (after one untimed), as a request runs them."""
        seconds = []
        for run in range(max(1, runs) + 1):
            start = time.perf_counter()
            worker.submit(self.stream)
            worker.before_adopt(self.stream)
            self.synchronize()
            if run:
                seconds.append(time.perf_counter() - start)
        return seconds

    @property
    def fingerprint_parts(self) -> FingerprintParts:
        """The fingerprint's components (capsule headers carry them: ``capsule-ros check``);
        computed on first use when the constructor was given only the fingerprint."""
        if self._parts is None:
            self._parts = runtime_identity(self.policy, self.config, self.inputs)[1]
        return self._parts

    @property
    def schedule(self) -> Optional[ChunkSchedule]:
        """The chunk schedule (None for a policy without a cadence)."""
        return self.executor.schedule if self.executor is not None else None

    def reset(self, episode: int, seed: Optional[int] = None) -> None:
        """Write the policy's initial state (eagerly) for a new episode."""
        self._outputs_in_host = False
        with torch.no_grad(), self._stream_ctx():
            self.policy.init_state(self.arena.views, episode=episode,
                                   seed=self.config.seed if seed is None else seed)
            if self.executor is not None:
                self.executor.reset()
        self.synchronize()

    def set_episode(self, episode: int) -> None:
        """Relabel the live state's episode id (a reset from a capsule keeps its state)."""
        self._outputs_in_host = False
        with self._stream_ctx():
            self.arena[EPISODE].fill_(episode)

    # -- inputs / step / outputs --------------------------------------------------------------
    @property
    def staging(self) -> Mapping[str, np.ndarray]:
        """name -> numpy view of the host staging buffer of each input (write these)."""
        return self._staging_views

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
        self._staging_views[name][...] = text_input.encode(text)
        self._texts[name] = text

    def load_inputs(self, row: Optional[torch.Tensor] = None) -> bool:
        """Copy the whole staging area (or ``row``, the same bytes from elsewhere, e.g. an
        input log already on the device) into the arena's input region: one copy, ordered
        on the runtime's stream. On CUDA the copy is asynchronous: the staging area must not
        change until the step's outputs are read (``PolicySession.tick`` ensures it). Returns
        whether it copied: a chunking policy's step that reads no input uploads none. From
        the staging area, a step whose network runs first lets the policy prepare its
        inputs on the host (``StatefulPolicy.prepare_inputs``); a ``row`` already holds them."""
        if self.executor is not None and not self.executor.reads_inputs():
            return False                             # the next step runs no network and reads no input
        if row is None and (self.executor is None or self.executor.plans()):
            self.policy.prepare_inputs(self._staging_views, self._texts)
        source = self.input_staging if row is None else row
        if self.stream is None:
            self._input_region.copy_(source)
            return True
        with on_stream(self.stream):
            self._input_region.copy_(source, non_blocking=True)
        return True

    def reads_inputs(self) -> bool:
        """Whether the next step reads its inputs (a chunking policy's consume step reads
        none, and ``load_inputs`` then uploads none): a replay needs a row exactly then."""
        return self.executor is None or self.executor.reads_inputs()

    def load_state(self, data: torch.Tensor) -> None:
        """Overwrite the whole arena with ``data`` (uint8, the arena's size), ordered on the
        runtime's stream and complete on return."""
        self._outputs_in_host = False
        with self._stream_ctx():
            self.arena.storage.copy_(data.to(self.device))
        self.synchronize()
        if self.executor is not None:
            self.executor.resume(self.executor.mark_of(self.arena.storage), self.stream)

    def step(self, *, eager: bool = False) -> RefillReport:
        """Run one step over the arena (asynchronous on CUDA). With the step guard, the
        state before it is kept first (see ``undo_step``). Returns which chunk program ran
        and whether a takeover's refill was late (empty for a policy without a cadence).
        ``eager``: run the captured program's Python instead (the start-up check)."""
        program = self.executor.before_step(self.stream) if self.executor is not None else None
        self.plan.step(program.value if program is not None else STEP_PROGRAM, eager=eager)
        self._outputs_in_host = self._fold_outputs
        if self.executor is None or program is None:
            return RefillReport()
        self.executor.after_step(program, self.stream, eager)
        return self.executor.last

    @property
    def guarded(self) -> bool:
        return self._undo is not None

    def undo_step(self) -> None:
        """Put the state back as it was before the last ``step`` (guard on; complete on
        return). For a step that raised or whose outputs the caller refused."""
        self._outputs_in_host = False
        if self._undo is None:
            raise InvalidArgument("runtime.guard_steps is off: there is no copy to undo the step with")
        with self._stream_ctx():
            self._state_region.copy_(self._undo, non_blocking=True)
        self.synchronize()
        if self.executor is not None:
            self.executor.undo()

    def prefill(self, tokens) -> None:
        """Consume a token prefix (from the initial state) through the parallel path."""
        if not self.policy.supports_prefill:
            raise InvalidArgument("this policy has no prefix input (vocab_size = 0)")
        self.plan.prefill(torch.as_tensor(tokens, dtype=torch.int64))

    def read_outputs(self) -> StepOutputs:
        """Copy meta + outputs to the host (one copy, synchronises the runtime's stream)."""
        self._outputs_in_host = False
        if self.stream is None:
            self._out_host.copy_(self._output_region)
        else:
            with on_stream(self.stream):
                self._out_host.copy_(self._output_region, non_blocking=True)
            self.stream.synchronize()
        return self._host_outputs()

    def read_step_outputs(self) -> StepOutputs:
        """``read_outputs`` right after ``step``, with nothing in between that writes the
        arena: on a GPU the step's program already copied them to the host, so this only
        waits for it (one launch fewer per control step)."""
        if not self._outputs_in_host:
            return self.read_outputs()
        self._outputs_in_host = False
        assert self.stream is not None
        self.stream.synchronize()
        return self._host_outputs()

    def _host_outputs(self) -> StepOutputs:
        v = self._out_views
        if self.executor is not None and self.config.debug_checks and int(v[CHUNK_CURSOR][0]) != self.executor.cursor:
            raise RuntimeError(f"chunk cursor {int(v[CHUNK_CURSOR][0])} in the arena, {self.executor.cursor} in "
                               "the host mirror")
        return StepOutputs(v[ACTION].copy(), v[CHUNK].copy(), int(v[STEP][0]), int(v[POSITION][0]),
                           int(v[EPISODE][0]))

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    # -- chunk marks (capsules) --------------------------------------------------------------------
    def chunk_mark(self) -> Optional[ChunkMark]:
        """The host mirror of the chunk state, which a capsule of this state carries."""
        return self.executor.mark() if self.executor is not None else None

    def check_chunk_mark(self, mark: Optional[ChunkMark], data: torch.Tensor, capsule_id: str) -> None:
        """Refuse a capsule (its mark and bytes ``data``) whose chunk state this runtime
        cannot take, before anything changes (FingerprintMismatch, CorruptCapsule)."""
        if self.executor is not None:
            self.executor.check(mark, data, capsule_id)

    def resume_chunk_mark(self, mark: Optional[ChunkMark]) -> None:
        """The arena was restored to a state with ``mark``: mirror it, re-issue its request."""
        if self.executor is not None and mark is not None:
            self.executor.resume(mark, self.stream)

    def _stream_ctx(self):
        return on_stream(self.stream)

    def close(self) -> None:
        """Release the arena, graphs, staging and weights (the node's lifecycle ``cleanup``);
        on CUDA the device memory goes back to the driver. The runtime cannot step again."""
        self.synchronize()
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        self.plan.close()
        del self.plan, self.arena, self.policy, self._undo
        del self._input_region, self._output_region, self._state_region
        self._staging_views, self._out_views = {}, {}
        del self.input_staging, self._out_host
        self.stream = None
        release_device_memory(self.device)

    # -- replica -------------------------------------------------------------------------------
    def replica(self, role: str = "replica") -> PolicyRuntime:
        """A second live runtime over the same weights with its own arena and graphs (and,
        on CUDA, the stream of ``role``).

        Both share the fingerprint, so capsules move freely between them; they never share
        state, so the two branches cannot affect each other.
        """
        schedule = self.schedule
        chunking = self.chunking
        if schedule is not None:       # the same schedule, planned inline: a replica replays, it does not race
            chunking = ChunkingOptions(schedule.mode.value, schedule.delay or None, schedule.horizon, worker="inline")
        return PolicyRuntime(self.policy, self.config, inputs=self.inputs, streams=self._streams,
                             stream_role=role, policy_checked=True, chunking=chunking,
                             _fingerprint=self.fingerprint, _parts=self._parts)

