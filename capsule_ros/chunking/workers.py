"""Refill workers: who plans an asynchronous request's chunk, off the control loop.

A worker owns a small arena of its own holding a copy of the buffers ``plan`` reads
(``ChunkCadence.reads``); ``submit`` copies the live arena's ``chunk.request.*`` into it
and starts a plan, which writes its chunk into the live arena's scratch buffer
``chunk.fresh``; the live ``adopt`` program copies it from there into ``chunk.actions``.
So the live programs read only their own arena, and the graphs' address check covers
what they read (``capsule_ros.runtime.graphs``). Submissions run in order, so the latest
one is the one adopted (an earlier one, made stale by a reset or restore, finishes
unused). Workers belong to the chunking mode of one runtime, which closes them with it:
a ``ThreadRefill``'s thread is the mode's, never the runtime core's.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import List, Optional, Tuple

import torch

from capsule_ros.runtime.arena import ArenaLayout, BufferSpec, StateArena
from capsule_ros.runtime.policy import REQUEST_PREFIX, ChunkCadence, StatefulPolicy
from capsule_ros.runtime.streams import StreamKeeper, on_stream

FRESH = "chunk.fresh"     # live arena scratch: the chunk the worker's last plan wrote, until its takeover
WORKERS = ("auto", "inline")


class RefillWorker:
    """Plans requested chunks off the control loop (see the module docstring)."""

    def __init__(self, policy: StatefulPolicy, live: StateArena, cadence: ChunkCadence,
                 stream: Optional[torch.cuda.Stream]):
        self.policy = policy
        reads: List[BufferSpec] = [live.layout[name].spec for name in cadence.reads]
        self.arena = StateArena(ArenaLayout([BufferSpec(s.name, s.shape, s.dtype, s.kind) for s in reads]),
                                live.device)
        self.stream = stream
        self.fresh = live.scratch_views[FRESH]
        self._pairs = [(live[REQUEST_PREFIX + s.name], self.arena[s.name]) for s in reads]
        self._plan_views = {s.name: self.arena[s.name] for s in reads}

    def copy_request(self) -> None:
        for source, target in self._pairs:
            target.copy_(source)

    def run_plan(self) -> None:
        with torch.inference_mode():
            self.policy.plan(self._plan_views, self.fresh)

    # the interface the chunking mode uses
    def prepare(self) -> None:
        """Warm up (and on a GPU capture) the plan; called once before stepping."""

    def submit(self, live_stream: Optional[torch.cuda.Stream], eager: bool = False) -> None:
        """Start planning the live arena's request (``eager``: a GPU worker runs the Python
        its graph was captured from, as the start-up check's eager pass needs)."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the latest submission has finished (never blocks)."""
        raise NotImplementedError

    def before_adopt(self, live_stream: Optional[torch.cuda.Stream]) -> None:
        """Make the latest submission's chunk visible to the live adopt (waits on a CPU;
        orders the live stream after it on a GPU). Re-raises the plan's error."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class InlineRefill(RefillWorker):
    """Plans at submission, on the caller's thread: the same bits as the other workers,
    without concurrency. For replicas (the recompute fallback), regeneration, checks."""

    def submit(self, live_stream: Optional[torch.cuda.Stream], eager: bool = False) -> None:
        with on_stream(live_stream):
            self.copy_request()
            self.run_plan()

    def ready(self) -> bool:
        return True

    def before_adopt(self, live_stream: Optional[torch.cuda.Stream]) -> None:
        pass


class ThreadRefill(RefillWorker):
    """CPU: one worker thread, the chunking mode's. The request is copied on the caller's
    thread (so the live arena may change right after), the plan runs on the worker's: torch
    releases the GIL inside its kernels, and each thread runs its operators on its own
    intra-op threads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsule-refill")
        self._future: Optional[concurrent.futures.Future] = None

    def submit(self, live_stream: Optional[torch.cuda.Stream], eager: bool = False) -> None:
        self.copy_request()
        self._future = self._pool.submit(self.run_plan)

    def ready(self) -> bool:
        return self._future is None or self._future.done()

    def before_adopt(self, live_stream: Optional[torch.cuda.Stream]) -> None:
        if self._future is not None:
            self._future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamRefill(RefillWorker):
    """GPU: the plan as a CUDA graph on a stream of its own (lower priority than the
    step's). ``submit`` orders the worker after the live step that made the request,
    copies the request and records ``copied`` (the live stream waits for it, so nothing
    later, a restore included, overwrites the request under the copy), then replays the
    plan and records ``done`` (the live adopt waits for it). No host synchronisation."""

    def __init__(self, *args, use_graphs: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.stream is not None
        self.use_graphs = use_graphs
        self._pool = torch.cuda.graph_pool_handle()
        self._copy_graph: Optional[torch.cuda.CUDAGraph] = None
        self._plan_graph: Optional[torch.cuda.CUDAGraph] = None
        self._done: Optional[torch.cuda.Event] = None

    def prepare(self) -> None:
        assert self.stream is not None
        if self._plan_graph is not None:
            return
        saved = self.arena.storage.clone()
        with torch.cuda.stream(self.stream), torch.inference_mode():
            for _ in range(3):
                self.copy_request()
                self.run_plan()
            if self.use_graphs:
                self._copy_graph, self._plan_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._copy_graph, pool=self._pool, stream=self.stream):
                    self.copy_request()
                with torch.cuda.graph(self._plan_graph, pool=self._pool, stream=self.stream):
                    self.run_plan()
            self.arena.storage.copy_(saved)
        self.stream.synchronize()

    def submit(self, live_stream: Optional[torch.cuda.Stream], eager: bool = False) -> None:
        assert self.stream is not None and live_stream is not None
        self.stream.wait_stream(live_stream)
        copied, done = torch.cuda.Event(), torch.cuda.Event()
        with on_stream(self.stream), torch.inference_mode():
            if self._copy_graph is not None and self._plan_graph is not None and not eager:
                self._copy_graph.replay()
                copied.record(self.stream)
                self._plan_graph.replay()
            else:
                self.copy_request()
                copied.record(self.stream)
                self.run_plan()
            done.record(self.stream)
        live_stream.wait_event(copied)
        self._done = done

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def before_adopt(self, live_stream: Optional[torch.cuda.Stream]) -> None:
        if self._done is not None and live_stream is not None:
            live_stream.wait_event(self._done)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._copy_graph = self._plan_graph = None


def make_worker(kind: str, policy: StatefulPolicy, live: StateArena, cadence: ChunkCadence,
                live_stream: Optional[torch.cuda.Stream], streams: StreamKeeper, use_graphs: bool) -> RefillWorker:
    """``inline``: on the caller's thread; ``auto``: a stream of its own on a GPU (its
    ``refill`` stream from ``streams``), else a thread."""
    if kind == "inline":
        return InlineRefill(policy, live, cadence, live_stream)
    if live.device.type == "cuda":
        return StreamRefill(policy, live, cadence, streams.get(live.device, "refill"), use_graphs=use_graphs)
    return ThreadRefill(policy, live, cadence, None)


def time_refills(worker: RefillWorker, live_stream: Optional[torch.cuda.Stream], runs: int) -> Tuple[float, ...]:
    """Seconds of ``runs`` plans on the worker (after one untimed), as a request runs them."""
    seconds = []
    worker.prepare()
    for run in range(max(1, runs) + 1):
        start = time.perf_counter()
        worker.submit(live_stream)
        worker.before_adopt(live_stream)
        if live_stream is not None:
            live_stream.synchronize()
        if run:
            seconds.append(time.perf_counter() - start)
    return tuple(seconds)
