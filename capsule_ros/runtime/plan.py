"""The graph plan: one policy step (and each prefill length) as a fixed plan over one arena.

On CUDA the step is warmed up, then captured as a CUDA graph on the runtime's own
stream with a private memory pool, and every later step replays it over the same
buffers. On CPU the very same Python calls run eagerly. Either way the plan never
allocates state: temporaries live in the graph pool (CUDA) or are freed by the step.

Steps run under ``torch.inference_mode`` (cheaper per operation than ``no_grad``: no
version counters or view tracking; in-place writes to the arena are allowed there).

Warm-up and capture execute the step for real, so the arena's bytes are saved before and
put back after: capturing leaves the live state exactly as it was.

Debug check (``debug_checks=True``): before each replay the arena's view addresses are
compared with those recorded at capture; a graph replayed over moved buffers would read
and write freed memory, so a mismatch raises instead.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, Optional

import torch

from capsule_ros.runtime.arena import StateArena
from capsule_ros.runtime.policy import StatefulPolicy

LOG = logging.getLogger(__name__)


class GraphAddressError(RuntimeError):
    """A buffer moved after capture (debug check)."""


class GraphPlan:
    """Runs ``policy.step`` / ``policy.prefill`` over ``arena`` (see module docstring)."""

    def __init__(self, policy: StatefulPolicy, arena: StateArena, *, use_graphs: bool,
                 stream: Optional["torch.cuda.Stream"], debug_checks: bool = False, warmup_steps: int = 3):
        self.policy = policy
        self.arena = arena
        self.use_graphs = bool(use_graphs and arena.device.type == "cuda")
        self.stream = stream
        self.debug_checks = debug_checks
        self.warmup_steps = warmup_steps
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._step_graph: Optional[torch.cuda.CUDAGraph] = None
        self._prefill_graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._prefill_tokens: Dict[int, torch.Tensor] = {}
        self._addresses: Dict[str, int] = arena.addresses()

    # -- capture ---------------------------------------------------------------------------
    def _stream_ctx(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _capture(self, fn) -> "torch.cuda.CUDAGraph":
        """Warm up ``fn`` then capture it; the arena is restored to its bytes before."""
        saved = self.arena.storage.clone()
        with torch.inference_mode(), self._stream_ctx():
            for _ in range(self.warmup_steps):
                fn()
            self.stream.synchronize()
            free_before = torch.cuda.mem_get_info(self.arena.device)[0]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self.stream):
                fn()
            self.arena.storage.copy_(saved)
            self.stream.synchronize()
            free_after = torch.cuda.mem_get_info(self.arena.device)[0]
        LOG.info("captured CUDA graph (%d warm-up runs); graph pool grew by %.1f MiB",
                 self.warmup_steps, (free_before - free_after) / 2**20)
        self._addresses = self.arena.addresses()
        return graph

    def capture_step(self) -> None:
        if self.use_graphs and self._step_graph is None:
            self._step_graph = self._capture(lambda: self.policy.step(self.arena.views))

    @property
    def captured(self) -> bool:
        return self._step_graph is not None

    # -- run -------------------------------------------------------------------------------
    def _check_addresses(self) -> None:
        now = self.arena.addresses()
        if now != self._addresses:
            moved = sorted(n for n in now if now[n] != self._addresses.get(n))
            raise GraphAddressError(f"arena buffers moved since capture: {moved}")

    def step(self) -> None:
        """One control step (graph replay on CUDA, eager on CPU); asynchronous on CUDA."""
        if self.debug_checks:
            self._check_addresses()
        with torch.inference_mode(), self._stream_ctx():
            if self._step_graph is not None:
                self._step_graph.replay()
            else:
                self.policy.step(self.arena.views)

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
                self._prefill_tokens[length] = static
                self._prefill_graphs[length] = self._capture(lambda: self.policy.prefill(self.arena.views, static))
            self._prefill_tokens[length].copy_(tokens, non_blocking=True)
            if self.debug_checks:
                self._check_addresses()
            self._prefill_graphs[length].replay()
