"""Chunk-aware execution: a chunking policy's network runs only when a chunk is due.

A chunking policy (``StatefulPolicy.cadence()``, e.g. ACT with an action queue,
Diffusion Policy) predicts ``length`` actions at once and executes them one per step.
Running its network at every step and discarding the result (the branch-free step a
single CUDA graph needs) costs a whole forward pass per step; here the host decides,
from a mirror of the chunk cursor, which phases each step runs, and replays the one
program (a CUDA graph on a GPU, the same Python eagerly on a CPU) made for that mix:

========== ========================================= =====================================
program    phases                                     when (cursor c, pending p)
========== ========================================= =====================================
refill     observe, plan (into chunk.actions), act    c == end and nothing requested
consume    observe, act                               otherwise
request    observe, request (copy plan's reads), act  async: c == horizon
adopt      adopt (the worker's chunk), observe, act   async: c == end and a request is out
========== ========================================= =====================================

``act`` executes row ``c`` of ``chunk.actions`` (``emit`` gets it and the rows after it)
and advances the cursor. ``end`` = horizon + delay: a chunk is executed up to row
``end - 1``.

Synchronous mode (``control.chunking: sync``, delay 0): exactly LeRobot's
``select_action``: when the chunk is used up, the step plans a new one from its own
observation and executes its first row.

Asynchronous mode (``async``, delay d >= 1 steps, fixed and recorded): the refill for the
chunk that takes over at step t + d is requested at step t from step t's observation
(``request`` copies the buffers ``plan`` reads into ``chunk.request.*``, in the arena) and
planned off the control loop by a ``RefillWorker`` (a thread with its own torch threads on
a CPU, its own stream and graph on a GPU). Steps t .. t+d-1 keep executing the current
chunk; at t + d the new chunk takes over at row d: its first d actions count as already
executed (real-time chunking's convention). Every action is therefore a function of the
inputs and step indices alone, never of wall time. The first chunk of an episode has
nothing to overlap with: it is planned synchronously (rows 0 .. end - 1). A refill that
has not finished by its takeover step is a deadline event: the step waits for it (its
state stays exact) and hands out the safe action (``RefillReport.late``).

The cursor and pending flag live in the arena (meta buffers: a capsule holds them, and
the host reads them back with the outputs); the runtime keeps a host mirror
(``ChunkMark``) so that choosing a program never waits for the device. A capsule carries
the mark of its state; restoring it checks the mark against the capsule's bytes and this
runtime's schedule, and re-issues a pending request from the restored ``chunk.request.*``.
"""
from __future__ import annotations

import concurrent.futures
import enum
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from capsule_ros.errors import ConfigError, CorruptCapsule, FingerprintMismatch
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, BufferSpec, StateArena
from capsule_ros.runtime.chunkmark import ChunkMark, ChunkMode
from capsule_ros.runtime.policy import (
    CHUNK_ACTIONS,
    CHUNK_CURSOR,
    CHUNK_PENDING,
    REQUEST_PREFIX,
    ChunkCadence,
    State,
    StatefulPolicy,
)
from capsule_ros.runtime.streams import on_stream

FRESH = "chunk.fresh"            # the worker's arena: the chunk its last plan wrote


class Program(str, enum.Enum):
    """The step programs of a chunking policy (see the module docstring)."""

    REFILL = "refill"
    CONSUME = "consume"
    REQUEST = "request"
    ADOPT = "adopt"
    ADOPT_REQUEST = "adopt+request"          # delay == horizon: the takeover step also requests


@dataclass(frozen=True)
class ChunkSchedule:
    """The fixed numbers of one runtime's chunk execution: mode, delay d, horizon e (rows
    executed per chunk), the policy's chunk length L. ``end`` = e + d."""

    mode: ChunkMode
    delay: int
    horizon: int
    length: int

    @property
    def end(self) -> int:
        return self.horizon + self.delay

    @classmethod
    def resolve(cls, cadence: ChunkCadence, mode: str, delay: int, horizon: int = 0) -> ChunkSchedule:
        """The schedule for ``cadence`` in ``mode`` with delay ``delay`` steps (async) and
        ``horizon`` rows per chunk (0: the cadence's own; in async mode at most
        length - delay). Raises ConfigError with the numbers when they cannot work."""
        chunk_mode = ChunkMode(mode)
        length = cadence.length
        if chunk_mode == ChunkMode.SYNC:
            executed = horizon or cadence.horizon
            if not 1 <= executed <= length:
                raise ConfigError(f"control.execution_horizon = {executed}: must be in [1, {length}] (the policy "
                                  f"predicts {length} actions per chunk)")
            return cls(chunk_mode, 0, executed, length)
        if delay < 1:
            raise ConfigError(f"control.inference_delay_steps = {delay}: async chunking needs a delay of at least 1 "
                              "step (0 would be sync)")
        if delay >= length:
            raise ConfigError(
                f"control.chunking async with inference_delay_steps = {delay}: a chunk of {length} actions has none "
                f"left to execute (each chunk is executed from row {delay}: its first {delay} actions count as "
                f"executed while it is planned); the delay must be below {length}, at most {length // 2} to leave as "
                "many rows as it takes to plan the next; lower the delay or predict longer chunks")
        executed = horizon or min(cadence.horizon, length - delay)
        if executed < 1 or executed + delay > length:
            raise ConfigError(
                f"control.chunking async with inference_delay_steps = {delay} and execution horizon {executed}: a "
                f"chunk of {length} actions has too few left; each chunk is executed from row {delay} (its first "
                f"{delay} actions count as executed while it is planned) for {executed} rows, needing delay + "
                f"horizon <= {length}; lower the delay, lower control.execution_horizon, or predict longer chunks")
        if executed < delay:
            raise ConfigError(
                f"control.chunking async: execution horizon {executed} < inference_delay_steps {delay}: a refill would "
                f"be requested every {executed} steps but takes {delay} steps, so refills would overlap; raise "
                f"control.execution_horizon to at least {delay} (delay + horizon <= {length}) or lower the delay")
        return cls(chunk_mode, delay, executed, length)

    def describe(self) -> str:
        if self.mode == ChunkMode.SYNC:
            return f"sync, {self.horizon} of {self.length} actions per chunk"
        return (f"async, inference delay {self.delay} steps, rows {self.delay}..{self.end - 1} of {self.length} "
                f"executed per chunk ({self.horizon} steps)")


@dataclass(frozen=True)
class RefillReport:
    """What the last step did with the chunk: which program ran and, for a takeover,
    whether the refill it adopts had not finished in time (a deadline event)."""

    program: Optional[Program] = None
    late: bool = False


@dataclass
class ChunkCounters:
    refills: int = 0            # plans run (synchronous refills and submitted requests)
    consumes: int = 0           # steps that ran no network
    late_refills: int = 0       # takeovers whose refill had not finished in time


# -- refill workers ------------------------------------------------------------------------------


class RefillWorker:
    """Plans requested chunks off the control loop (async mode). It owns a small arena of
    its own, ``reads`` buffers plus ``chunk.fresh``; ``submit`` copies the live arena's
    ``chunk.request.*`` into it and starts a plan; the live ``adopt`` program copies
    ``chunk.fresh`` back. Submissions run in order, so the latest one is the one adopted
    (an earlier one, made stale by a reset or restore, finishes unused)."""

    def __init__(self, policy: StatefulPolicy, live: StateArena, cadence: ChunkCadence,
                 stream: Optional[torch.cuda.Stream]):
        self.policy = policy
        self.live = live
        reads = [live.layout[name].spec for name in cadence.reads]
        self.arena = StateArena(ArenaLayout(
            [BufferSpec(s.name, s.shape, s.dtype, s.kind) for s in reads]
            + [BufferSpec(FRESH, live[CHUNK_ACTIONS].shape, torch.float32, BufferKind.OUTPUT)]), live.device)
        self.stream = stream
        self._pairs = [(live[REQUEST_PREFIX + s.name], self.arena[s.name]) for s in reads]
        self._plan_views = {s.name: self.arena[s.name] for s in reads}

    @property
    def fresh(self) -> torch.Tensor:
        return self.arena[FRESH]

    def copy_request(self) -> None:
        for source, target in self._pairs:
            target.copy_(source)

    def run_plan(self) -> None:
        with torch.inference_mode():
            self.policy.plan(self._plan_views, self.fresh)

    # the interface the runtime uses
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
    """CPU: one worker thread. The request is copied on the caller's thread (so the live
    arena may change right after), the plan runs on the worker's: torch releases the GIL
    inside its kernels, and each thread runs its operators on its own intra-op threads."""

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


# -- the executor --------------------------------------------------------------------------------


class ChunkExecutor:
    """The chunk schedule of one runtime: the programs over its arena, the host mirror,
    the refill worker (async). Not thread-safe: the runtime's caller serialises."""

    def __init__(self, policy: StatefulPolicy, arena: StateArena, cadence: ChunkCadence, schedule: ChunkSchedule,
                 worker: Optional[RefillWorker]):
        self.policy = policy
        self.arena = arena
        self.cadence = cadence
        self.schedule = schedule
        self.worker = worker
        self.counters = ChunkCounters()
        self.last = RefillReport()
        self.cursor, self.pending = schedule.end, False
        self._before: Tuple[int, bool] = (self.cursor, self.pending)
        views = arena.views
        horizon_rows = views["chunk"].shape[0]
        self._rows = torch.arange(horizon_rows, device=arena.device)
        self._cursor_slot, self._pending_slot = arena.layout[CHUNK_CURSOR], arena.layout[CHUNK_PENDING]

    # -- programs (capturable; GraphPlan replays them) -------------------------------------------
    def programs(self) -> Dict[str, Callable[[], None]]:
        views, policy, s = self.arena.views, self.policy, self.schedule
        chunk, cursor, pending = views[CHUNK_ACTIONS], views[CHUNK_CURSOR], views[CHUNK_PENDING]
        last_row = s.end - 1

        def act() -> None:
            # rows cursor, cursor + 1, ... (the last executed row repeated); clamped both ways,
            # so that no state, however it was made, indexes outside the chunk
            upcoming = chunk.index_select(0, torch.clamp(cursor + self._rows, min=0, max=last_row))
            policy.emit(views, upcoming[0], upcoming)
            cursor.add_(1)

        def plan() -> None:
            policy.plan(views, chunk)
            cursor.zero_()

        def request() -> None:
            for name in self.cadence.reads:
                views[REQUEST_PREFIX + name].copy_(views[name])
            pending.fill_(1)

        def adopt() -> None:
            assert self.worker is not None
            chunk.copy_(self.worker.fresh)
            cursor.fill_(s.delay)
            pending.zero_()

        def run(*phases: Callable[[], None]) -> Callable[[], None]:
            def program() -> None:
                for phase in phases:
                    phase()
            return program

        observe = lambda: policy.observe(views)  # noqa: E731
        out = {Program.REFILL: run(observe, plan, act), Program.CONSUME: run(observe, act)}
        if s.mode == ChunkMode.ASYNC:
            out[Program.REQUEST] = run(observe, request, act)
            out[Program.ADOPT] = run(adopt, observe, act)
            if s.delay == s.horizon:
                out[Program.ADOPT_REQUEST] = run(adopt, observe, request, act)
        return {program.value: fn for program, fn in out.items()}

    # -- the host decision -------------------------------------------------------------------------
    def next_program(self) -> Program:
        """The program of the next step, from the host mirror alone."""
        s = self.schedule
        if self.cursor >= s.end:
            if not self.pending:
                return Program.REFILL
            return Program.ADOPT_REQUEST if s.delay == s.horizon else Program.ADOPT
        if s.mode == ChunkMode.ASYNC and self.cursor == s.horizon:
            return Program.REQUEST
        return Program.CONSUME

    def plans(self) -> bool:
        """Whether the next step plans a chunk (a refill, or an asynchronous request)."""
        return self.next_program() in (Program.REFILL, Program.REQUEST, Program.ADOPT_REQUEST)

    def reads_inputs(self) -> bool:
        """Whether the next step reads the input buffers (else they need no upload)."""
        return self.cadence.inputs_every_step or self.plans()

    def before_step(self, live_stream: Optional[torch.cuda.Stream]) -> Program:
        """Choose the program; for a takeover, note whether its refill is late and make
        its chunk visible to the live program."""
        program = self.next_program()
        self._before = (self.cursor, self.pending)
        late = False
        if program in (Program.ADOPT, Program.ADOPT_REQUEST):
            assert self.worker is not None
            late = not self.worker.ready()
            try:
                self.worker.before_adopt(live_stream)
            except Exception:
                self.worker.submit(live_stream)          # the next attempt plans the same request again
                raise
        self.last = RefillReport(program, late)
        return program

    def after_step(self, program: Program, live_stream: Optional[torch.cuda.Stream], eager: bool = False) -> None:
        """Advance the mirror as the program advanced the arena; send a new request off
        (``eager``: planned by the Python a GPU worker's graph was captured from)."""
        s = self.schedule
        if program == Program.REFILL:
            self.cursor = 0
            self.counters.refills += 1
        elif program in (Program.ADOPT, Program.ADOPT_REQUEST):
            self.cursor, self.pending = s.delay, False
            self.counters.late_refills += int(self.last.late)
        else:
            self.counters.consumes += 1
        if program in (Program.REQUEST, Program.ADOPT_REQUEST):
            self.pending = True
            assert self.worker is not None
            self.worker.submit(live_stream, eager)
            self.counters.refills += 1
        self.cursor += 1

    def undo(self) -> None:
        """The step was undone (runtime step guard): the mirror goes back with the arena.
        A request it sent stays in the worker's queue, unused."""
        self.cursor, self.pending = self._before

    # -- marks -------------------------------------------------------------------------------------
    def mark(self) -> ChunkMark:
        s = self.schedule
        return ChunkMark(s.mode.value, s.delay, s.horizon, self.cursor, self.pending)

    def reset(self) -> None:
        """A new episode (after ``init_state``): no chunk, nothing requested."""
        self.cursor, self.pending = self.schedule.end, False
        self.arena[CHUNK_CURSOR].fill_(self.cursor)
        self.arena[CHUNK_PENDING].zero_()

    def mark_of(self, data: torch.Tensor) -> ChunkMark:
        """The mark of arena bytes ``data`` (uint8, the arena's size; any device), read
        from their cursor and pending buffers."""
        def value(slot) -> int:
            return int(data[slot.offset:slot.end].view(torch.int64)[0])
        s = self.schedule
        return ChunkMark(s.mode.value, s.delay, s.horizon, value(self._cursor_slot), bool(value(self._pending_slot)))

    def check(self, mark: Optional[ChunkMark], data: torch.Tensor, capsule_id: str) -> None:
        """Refuse, before anything changes, a capsule whose chunk schedule is not this
        runtime's (FingerprintMismatch) or whose mark disagrees with its bytes or is out
        of range (CorruptCapsule)."""
        s = self.schedule
        if mark is None:
            raise CorruptCapsule(f"capsule {capsule_id!r} carries no chunk schedule; this policy's chunk state "
                                 "needs one")
        if (mark.mode, mark.delay, mark.horizon) != (s.mode.value, s.delay, s.horizon):
            raise FingerprintMismatch(
                f"capsule {capsule_id!r} was made under control.chunking {mark.mode} with inference delay {mark.delay} "
                f"and execution horizon {mark.horizon}; this runtime runs {s.mode.value} with delay {s.delay} and "
                f"horizon {s.horizon}: its chunk state would mean something else here")
        stored = self.mark_of(data)
        if (stored.cursor, stored.pending) != (mark.cursor, mark.pending):
            raise CorruptCapsule(f"capsule {capsule_id!r}: its chunk cursor {stored.cursor} / pending "
                                 f"{int(stored.pending)} disagree with its metadata ({mark.cursor} / "
                                 f"{int(mark.pending)})")
        if mark.pending:        # requested at cursor == horizon, adopted at end
            reachable = s.mode == ChunkMode.ASYNC and s.horizon < mark.cursor <= s.end
        else:                   # after a step (1 .. horizon), or a new episode's (end)
            reachable = 1 <= mark.cursor <= s.horizon or mark.cursor == s.end
        if not reachable:
            raise CorruptCapsule(f"capsule {capsule_id!r}: chunk cursor {mark.cursor} (pending {int(mark.pending)}) "
                                 f"cannot occur under this schedule ({s.describe()})")

    def resume(self, mark: ChunkMark, live_stream: Optional[torch.cuda.Stream]) -> None:
        """The arena now holds a state with ``mark`` (restored): mirror it and re-issue its
        pending request from the restored ``chunk.request.*``."""
        self.cursor, self.pending = mark.cursor, mark.pending
        if mark.pending:
            assert self.worker is not None
            self.worker.submit(live_stream)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def chunked_step(policy: StatefulPolicy, state: State, horizon: int) -> None:
    """A chunking policy's every-step reference: synchronous mode as one branch-free step
    (the network runs every step; its chunk is kept only when the current one is used
    up). Capturable, and what a plain ``step`` caller (an export check) gets."""
    chunk, cursor = state[CHUNK_ACTIONS], state[CHUNK_CURSOR]
    policy.observe(state)
    fresh = torch.empty_like(chunk)
    policy.plan(state, fresh)
    due = cursor >= horizon
    chunk.copy_(torch.where(due, fresh, chunk))
    cursor.copy_(torch.where(due, torch.zeros_like(cursor), cursor))
    rows = torch.arange(state["chunk"].shape[0], device=chunk.device)
    upcoming = chunk.index_select(0, torch.clamp(cursor + rows, max=horizon - 1))
    policy.emit(state, upcoming[0], upcoming)
    cursor.add_(1)


def resolve_delay(setting: str) -> Optional[int]:
    """``control.inference_delay_steps``: an integer, or None for ``auto``."""
    return None if setting == "auto" else int(setting)


def measured_delay(seconds: Sequence[float], rate_hz: float, margin: float = 1.5) -> int:
    """The delay (steps) for ``auto``: the refill's p99 (of the timed plans) with a margin
    for the control loop sharing the machine, in control periods, at least 1."""
    p99 = float(np.percentile(np.asarray(seconds), 99))
    return max(1, math.ceil(p99 * margin * rate_hz))


__all__ = ["ChunkExecutor", "ChunkMark", "ChunkMode", "ChunkSchedule", "ChunkCounters", "InlineRefill", "Program",
           "RefillReport", "RefillWorker", "StreamRefill", "ThreadRefill", "chunked_step", "measured_delay",
           "resolve_delay"]
