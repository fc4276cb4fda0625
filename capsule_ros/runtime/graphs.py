"""A runtime's programs, each captured as a CUDA graph over one arena (run eagerly on a CPU).

``ProgramGraphs`` holds the named *programs* its runtime's execution mode defines
(``capsule_ros.runtime.mode``): ``step`` (the policy's step) in the every-step mode; a
chunking policy's ``refill``, ``consume``, ... in the chunking mode (``capsule_ros.chunking``),
one CUDA graph each, captured from one memory pool (they never run at the same time),
chosen by the host before each replay. Each prefill length is captured once too.

``prepare`` runs the step a few times before the first control step, on every device:
the first run of a step pays one-off costs (lazy initialisation, the allocator's first
blocks, kernel selection) that would otherwise make the first control step a cold one
(tens of ms on a CPU, over a typical deadline). It also proves the policy can take the
configured inputs at all: a step that raises there fails start-up with a message that
names the inputs, instead of failing every control step. On CUDA the step is then
captured as a CUDA graph on the runtime's own stream with a private memory pool, and
every later step replays it over the same buffers. On CPU the very same Python calls
run eagerly. Either way the programs never allocate state: temporaries live in the graph
pool (CUDA) or are freed by the step.

Steps run under ``torch.inference_mode`` (cheaper per operation than ``no_grad``: no
version counters or view tracking; in-place writes to the arena are allowed there).

Warm-up and capture execute the step for real, so the arena's bytes are saved before and
put back after: preparing leaves the live state exactly as it was.

A step that cannot be captured (it synchronises with the host, e.g. ``.item()``, or
branches in Python on tensor values) fails start-up with a PolicyStepError that names
the problem, unless ``eager_fallback`` (``runtime.graph_fallback: eager``) is set: then
every program runs eagerly, like on a CPU, and a warning is logged.

Debug checks (``debug_checks=True``, ``runtime.debug_checks``): a captured graph reads and
writes the addresses it was captured with, so every address a program touches must be one
the runtime owns for as long as the graph lives: the arena's buffers (its scratch
included), the policy's own tensors, and the runtime's buffers named in ``owned`` (the
step guard's copy, the host copy of the outputs). ``prepare`` runs each program once more
under a recorder of every tensor its operations touch and refuses, with GraphAddressError
naming it, a tensor of anything else (another object's buffer, which could move or be
freed under the graph), temporaries the program makes itself aside. Before each replay the
addresses of all of them are compared with those at capture; a graph replayed over moved
buffers would read and write freed memory, so a mismatch raises instead.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Protocol, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import ArenaLayout, BufferKind
from capsule_ros.runtime.mode import STEP_PROGRAM
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.runtime.streams import on_stream

LOG = logging.getLogger(__name__)


class ProgramArena(Protocol):
    """What the programs run over: a ``StateArena``, or a fleet's arena of slots
    (``capsule_ros.runtime.slots.FleetArena``): its bytes and scratch bytes (saved and put
    back around warm-up and capture), the single-robot layout (named in errors), the
    device, and the addresses of its views (the debug check)."""

    storage: torch.Tensor
    scratch: torch.Tensor
    layout: ArenaLayout
    device: torch.device

    @property
    def views(self) -> Mapping[str, torch.Tensor]: ...

    def addresses(self) -> Dict[str, int]: ...


class StepPrograms(Protocol):
    """What a runtime steps through (``ProgramGraphs``, or a fleet slot's share of its
    fleet's programs): a program by name, a prefill, whether graphs were captured."""

    @property
    def captured(self) -> bool: ...

    def step(self, program: str = STEP_PROGRAM, eager: bool = False) -> None: ...

    def prefill(self, tokens: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class GraphAddressError(RuntimeError):
    """A program touches a tensor the runtime does not own, or a buffer moved after
    capture (debug checks)."""


class PolicyStepError(ConfigError):
    """The policy's step fails on the configured inputs (found while preparing its programs)."""


def step_failure(layout: ArenaLayout, program: str, exc: BaseException, during: str = "") -> PolicyStepError:
    """The PolicyStepError of ``program`` (a name of the runtime's programs) failing with
    ``exc``: the inputs it was given by name, dtype and shape, and where (``during``)."""
    inputs = ", ".join(f"{slot.spec.name} {str(slot.spec.dtype).replace('torch.', '')}{list(slot.spec.shape)}"
                       for slot in layout if slot.spec.kind == BufferKind.INPUT)
    which = "step" if program == STEP_PROGRAM else f"step ({program} program)"
    return PolicyStepError(f"the policy's {which} fails on the configured inputs ({inputs}){during}: "
                           f"{type(exc).__name__}: {exc}; check the ports' shapes and dtypes")


class ProgramGraphs:
    """Runs a runtime's programs and ``policy.prefill`` over ``arena`` (see the module
    docstring)."""

    def __init__(self, policy: StatefulPolicy, arena: ProgramArena, programs: Mapping[str, Callable[[], None]], *,
                 use_graphs: bool, stream: Optional[torch.cuda.Stream], debug_checks: bool = False,
                 warmup_steps: int = 3, eager_fallback: bool = False,
                 owned: Optional[Mapping[str, torch.Tensor]] = None):
        """``programs``: name -> a capturable call over the arena. ``owned``: the runtime's
        own buffers the programs may touch besides the arena and the policy's tensors."""
        self.policy = policy
        self.arena = arena
        # a policy whose step runs outside torch (ONNX Runtime) is never captured by torch
        self.use_graphs = bool(use_graphs and arena.device.type == "cuda" and policy.torch_graph_capture)
        self.eager_fallback = eager_fallback
        self.stream = stream
        self.debug_checks = debug_checks
        self.warmup_steps = warmup_steps
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.programs: Dict[str, Callable[[], None]] = dict(programs)
        self.owned = dict(owned or {})
        self._graphs: Dict[str, torch.cuda.CUDAGraph] = {}
        self._prefill_graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._prefill_tokens: Dict[int, torch.Tensor] = {}
        self._addresses: Dict[str, int] = self.addresses()

    # -- capture ---------------------------------------------------------------------------
    def _stream_ctx(self):
        return on_stream(self.stream)

    def _warm_up(self, fn) -> None:
        """Run ``fn`` ``warmup_steps`` times before a capture, once otherwise (it runs at
        all: an eager plan has nothing to warm up for, and a camera policy's extra runs
        were seconds of a CPU node's start-up); the caller restores the arena."""
        with torch.inference_mode(), self._stream_ctx():
            for _ in range(self.warmup_steps if self.use_graphs else 1):
                fn()
        if self.stream is not None:
            self.stream.synchronize()

    def _capture(self, fn) -> Optional[torch.cuda.CUDAGraph]:
        """Warm up ``fn`` then capture it; the arena is restored to its bytes before. None
        when the capture fails and the eager fallback is allowed (every program then runs eagerly)."""
        saved = self.arena.storage.clone()
        assert self.stream is not None                          # graphs are captured on CUDA only
        try:
            with torch.inference_mode(), self._stream_ctx():
                self._warm_up(fn)
                free_before = torch.cuda.mem_get_info(self.arena.device)[0]
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=self._pool, stream=self.stream):
                        fn()
                except Exception as exc:  # noqa: BLE001 - any capture failure: say what and how to go on
                    self._capture_failed(exc)
                    return None
                free_after = torch.cuda.mem_get_info(self.arena.device)[0]
        finally:
            with self._stream_ctx():
                self.arena.storage.copy_(saved)
            self.stream.synchronize()
        LOG.info("captured CUDA graph (%d warm-up runs); graph pool grew by %.1f MiB",
                 self.warmup_steps, (free_before - free_after) / 2**20)
        self._addresses = self.addresses()
        return graph

    def _capture_failed(self, exc: Exception) -> None:
        """A step that cannot be captured: PolicyStepError naming the cause, or (eager
        fallback) a warning, and every program runs eagerly."""
        causes: List[str] = []
        cause: Optional[BaseException] = exc
        while cause is not None and len(causes) < 3:        # the original error first (capture_end raises again)
            causes.insert(0, f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}")
            cause = cause.__cause__ or cause.__context__
        problem = f"the policy's step cannot be captured as a CUDA graph ({'; then '.join(causes)})"
        if not self.eager_fallback:
            raise PolicyStepError(f"{problem}; make the step capturable (no .item() or other host synchronisation, "
                                  "no Python control flow on tensor values, no new persistent tensors: "
                                  "docs/bring-your-own-policy.md) or set runtime.graph_fallback: eager to run it "
                                  "without a graph (slower)") from exc
        LOG.warning("%s; runtime.graph_fallback is eager: the step runs without a CUDA graph (slower)", problem)
        self.use_graphs = False

    def prepare(self, check_runs: bool = True) -> None:
        """Warm every program up (and check it runs at all), then capture each on CUDA; the
        arena keeps its bytes. Raises PolicyStepError when the step fails on these inputs.

        ``check_runs`` False: where nothing is captured, the programs' first run is left to
        the start-up state check that follows (``capsule_ros.runtime.contract``), which runs
        every program and reports a failing one the same way: a chunking policy's planning
        network then runs once less at start-up (seconds on a CPU)."""
        if not self.use_graphs and not check_runs:
            self.check_reads()
            return
        saved = self.arena.storage.clone()
        try:
            for name, program in self.programs.items():
                try:
                    self._warm_up(program)
                except Exception as exc:
                    raise step_failure(self.arena.layout, name, exc) from exc
                finally:
                    with self._stream_ctx():
                        self.arena.storage.copy_(saved)
                    if self.stream is not None:
                        self.stream.synchronize()
        finally:
            with self._stream_ctx():
                self.arena.storage.copy_(saved)
        self.check_reads()
        for name, program in self.programs.items():
            if not self.use_graphs:
                break
            if name not in self._graphs:
                graph = self._capture(program)
                if graph is None:                    # eager fallback: every program runs eagerly
                    self._graphs.clear()
                    break
                self._graphs[name] = graph

    def recapture(self, name: str) -> None:
        """Capture program ``name`` again, replacing its graph (the policy's code path for it
        changed: ``bench/profile_vla_chunk.py`` times one refill two ways). The arena keeps its
        bytes; on a CPU, where nothing is captured, nothing changes."""
        if not self.use_graphs:
            return
        graph = self._capture(self.programs[name])
        if graph is not None:
            self._graphs[name] = graph

    def check_reads(self) -> None:
        """With ``debug_checks``: every program reads only what the runtime owns (``_check_reads``)."""
        if self.debug_checks and self.policy.torch_graph_capture:
            for name, program in self.programs.items():
                self._check_reads(name, program)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def close(self) -> None:
        """Drop the captured graphs (their memory pool is freed with them)."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._prefill_tokens.clear()
        self._pool = None

    # -- debug checks ----------------------------------------------------------------------
    def addresses(self) -> Dict[str, int]:
        """data_ptr of everything the programs may touch but their own temporaries: the
        arena's views, the runtime's ``owned`` buffers and the policy's tensors."""
        out = {f"arena {name}": address for name, address in self.arena.addresses().items()}
        out.update((f"runtime {name}", tensor.data_ptr()) for name, tensor in self.owned.items())
        out.update((f"policy {name}", tensor.data_ptr()) for name, tensor in _policy_tensors(self.policy).items())
        return out

    def _check_reads(self, name: str, program: Callable[[], None]) -> None:
        """Run ``program`` once eagerly, recording every tensor its operations touch;
        GraphAddressError for one the runtime does not own (see the module docstring). The
        arena keeps its bytes."""
        allowed = {self.arena.storage.untyped_storage().data_ptr(), self.arena.scratch.untyped_storage().data_ptr()}
        allowed |= {t.untyped_storage().data_ptr() for t in self.owned.values()}
        allowed |= {t.untyped_storage().data_ptr() for t in _reachable_tensors(self.policy)}
        recorder = _TouchRecorder(allowed)
        saved = self.arena.storage.clone()
        try:
            with torch.inference_mode(), self._stream_ctx(), _eager_kernels(), recorder:
                program()
        finally:
            with self._stream_ctx():
                self.arena.storage.copy_(saved)
            if self.stream is not None:
                self.stream.synchronize()
        if recorder.foreign:
            raise GraphAddressError(f"program {name!r} touches memory its runtime does not own: "
                                    f"{'; '.join(recorder.foreign[:3])}; a captured graph would keep that address "
                                    "while its owner may move or free it: put the tensor in the arena (a buffer, "
                                    "or an execution mode's scratch) or in the policy")

    def _check_addresses(self) -> None:
        now = self.addresses()
        if now != self._addresses:
            moved = sorted(n for n in now if now[n] != self._addresses.get(n))
            raise GraphAddressError(f"buffers moved since capture: {moved}")

    # -- run -------------------------------------------------------------------------------

    def step(self, program: str = STEP_PROGRAM, eager: bool = False) -> None:
        """One control step: ``program`` (graph replay on CUDA, eager on CPU, or with
        ``eager`` the Python it was captured from); asynchronous on CUDA."""
        if self.debug_checks:
            self._check_addresses()
        graph = None if eager else self._graphs.get(program)
        if graph is not None:            # a replay needs no autograd mode: the graph's kernels are fixed
            with self._stream_ctx():
                graph.replay()
            return
        with torch.inference_mode(), self._stream_ctx():
            self.programs[program]()

    def prefill(self, tokens: torch.Tensor) -> None:
        """Consume a token prefix; on CUDA each distinct length is captured once."""
        tokens = tokens.to(device=self.arena.device, dtype=torch.int64)
        length = int(tokens.shape[0])
        if not self.use_graphs:
            with torch.inference_mode():
                self.policy.prefill(self.arena.views, tokens)
            return
        with self._stream_ctx():
            if length not in self._prefill_graphs:
                static = torch.zeros(length, dtype=torch.int64, device=self.arena.device)
                static.copy_(tokens)
                graph = self._capture(lambda: self.policy.prefill(self.arena.views, static))
                if graph is None:                              # not capturable, eager fallback allowed
                    with torch.inference_mode():
                        self.policy.prefill(self.arena.views, tokens)
                    return
                self._prefill_tokens[length] = static
                self._prefill_graphs[length] = graph
            self._prefill_tokens[length].copy_(tokens, non_blocking=True)
            if self.debug_checks:
                self._check_addresses()
            self._prefill_graphs[length].replay()


def _eager_kernels() -> ContextManager[Any]:
    """Compiled kernels run as their Python (torch >= 2.6), so that the recorder sees every
    operation; with an older torch they run as they are."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _policy_tensors(policy: StatefulPolicy) -> Dict[str, torch.Tensor]:
    """The policy's parameters and buffers, by name (the addresses checked at each replay)."""
    out: Dict[str, torch.Tensor] = dict(policy.named_parameters())
    out.update(policy.named_buffers())
    return out


def _reachable_tensors(root: object, limit: int = 1_000_000) -> List[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, containers and modules (what
    the policy holds and lives as long as it: its weights, constants, and those of programs
    it keeps outside its registered modules, such as an exported program's)."""
    found: List[torch.Tensor] = []
    seen: Set[int] = set()
    todo: List[object] = [root]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and not callable(getattr(obj, "__func__", None)):
            todo.extend(vars(obj).values())
    return found


class _TouchRecorder(TorchDispatchMode):
    """Notes each tensor an operation touches whose storage is neither ``allowed`` nor made
    by an earlier operation of the run (a temporary)."""

    def __init__(self, allowed: Set[int]):
        super().__init__()
        self.known = set(allowed)
        self.foreign: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        touched, _ = tree_flatten((args, kwargs or {}))
        for value in touched:
            if isinstance(value, torch.Tensor) and value.numel():
                storage = value.untyped_storage().data_ptr()
                if storage not in self.known:
                    self.foreign.append(f"{func} on a {str(value.dtype).replace('torch.', '')}{list(value.shape)} "
                                        f"tensor at {storage:#x}")
                    self.known.add(storage)
        out = func(*args, **(kwargs or {}))
        made, _ = tree_flatten(out)
        self.known.update(t.untyped_storage().data_ptr() for t in made if isinstance(t, torch.Tensor))
        return out
