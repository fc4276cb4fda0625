"""The graph plan: one policy step (and each prefill length) as a fixed plan over one arena.

A plan holds named *programs*: ``step`` (the policy's step) for most policies; for a
chunking policy the programs of its chunk schedule (``refill``, ``consume``, ... from
``capsule_ros.runtime.chunking``), one CUDA graph each, captured from one memory pool
(they never run at the same time), chosen by the host before each replay.

``prepare`` runs the step a few times before the first control step, on every device:
the first run of a step pays one-off costs (lazy initialisation, the allocator's first
blocks, kernel selection) that would otherwise make the first control step a cold one
(tens of ms on a CPU, over a typical deadline). It also proves the policy can take the
configured inputs at all: a step that raises there fails start-up with a message that
names the inputs, instead of failing every control step. On CUDA the step is then
captured as a CUDA graph on the runtime's own stream with a private memory pool, and
every later step replays it over the same buffers. On CPU the very same Python calls
run eagerly. Either way the plan never allocates state: temporaries live in the graph
pool (CUDA) or are freed by the step.

Steps run under ``torch.inference_mode`` (cheaper per operation than ``no_grad``: no
version counters or view tracking; in-place writes to the arena are allowed there).

Warm-up and capture execute the step for real, so the arena's bytes are saved before and
put back after: preparing leaves the live state exactly as it was.

A step that cannot be captured (it synchronises with the host, e.g. ``.item()``, or
branches in Python on tensor values) fails start-up with a PolicyStepError that names
the problem, unless ``eager_fallback`` (``runtime.graph_fallback: eager``) is set: then
the plan runs the step eagerly, like on a CPU, and logs a warning.

Debug check (``debug_checks=True``): before each replay the arena's view addresses are
compared with those recorded at capture; a graph replayed over moved buffers would read
and write freed memory, so a mismatch raises instead.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Mapping, Optional

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import BufferKind, StateArena
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.runtime.streams import on_stream

LOG = logging.getLogger(__name__)
STEP_PROGRAM = "step"


class GraphAddressError(RuntimeError):
    """A buffer moved after capture (debug check)."""


class PolicyStepError(ConfigError):
    """The policy's step fails on the configured inputs (found while preparing the plan)."""


class GraphPlan:
    """Runs ``policy.step`` / ``policy.prefill`` over ``arena`` (see module docstring)."""

    def __init__(self, policy: StatefulPolicy, arena: StateArena, *, use_graphs: bool,
                 stream: Optional[torch.cuda.Stream], debug_checks: bool = False, warmup_steps: int = 3,
                 eager_fallback: bool = False, programs: Optional[Mapping[str, Callable[[], None]]] = None):
        """``programs``: name -> a capturable call over the arena (default: ``step``, the
        policy's step)."""
        self.policy = policy
        self.arena = arena
        # a policy whose step runs outside torch (ONNX Runtime) is never captured by torch
        self.use_graphs = bool(use_graphs and arena.device.type == "cuda" and policy.torch_graph_capture)
        self.eager_fallback = eager_fallback
        self.stream = stream
        self.debug_checks = debug_checks
        self.warmup_steps = warmup_steps
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.programs: Dict[str, Callable[[], None]] = dict(programs) if programs else {
            STEP_PROGRAM: lambda: policy.step(arena.views)}
        self._graphs: Dict[str, torch.cuda.CUDAGraph] = {}
        self._prefill_graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._prefill_tokens: Dict[int, torch.Tensor] = {}
        self._addresses: Dict[str, int] = arena.addresses()

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
        when the capture fails and the eager fallback is allowed (the plan is then eager)."""
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
        self._addresses = self.arena.addresses()
        return graph

    def _capture_failed(self, exc: Exception) -> None:
        """A step that cannot be captured: PolicyStepError naming the cause, or (eager
        fallback) a warning and an eager plan."""
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

    def prepare(self) -> None:
        """Warm every program up (and check it runs at all), then capture each on CUDA; the
        arena keeps its bytes. Raises PolicyStepError when the step fails on these inputs."""
        saved = self.arena.storage.clone()
        try:
            for name, program in self.programs.items():
                try:
                    self._warm_up(program)
                except Exception as exc:
                    inputs = ", ".join(f"{slot.spec.name} {str(slot.spec.dtype).replace('torch.', '')}"
                                       f"{list(slot.spec.shape)}" for slot in self.arena.layout
                                       if slot.spec.kind == BufferKind.INPUT)
                    which = "step" if name == STEP_PROGRAM else f"step ({name} program)"
                    raise PolicyStepError(f"the policy's {which} fails on the configured inputs ({inputs}): "
                                          f"{type(exc).__name__}: {exc}; check the ports' shapes and dtypes") from exc
                finally:
                    with self._stream_ctx():
                        self.arena.storage.copy_(saved)
                    if self.stream is not None:
                        self.stream.synchronize()
        finally:
            with self._stream_ctx():
                self.arena.storage.copy_(saved)
        for name, program in self.programs.items():
            if not self.use_graphs:
                break
            if name not in self._graphs:
                graph = self._capture(program)
                if graph is None:                    # eager fallback: every program runs eagerly
                    self._graphs.clear()
                    break
                self._graphs[name] = graph

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def close(self) -> None:
        """Drop the captured graphs (their memory pool is freed with them)."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._prefill_tokens.clear()
        self._pool = None

    # -- run -------------------------------------------------------------------------------
    def _check_addresses(self) -> None:
        now = self.arena.addresses()
        if now != self._addresses:
            moved = sorted(n for n in now if now[n] != self._addresses.get(n))
            raise GraphAddressError(f"arena buffers moved since capture: {moved}")

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
