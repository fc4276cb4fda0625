"""The chunking mode: a chunking policy's programs, the host's choice among them, the
refill worker, and the mark its capsules carry (the program table is in the package's
docstring, ``capsule_ros.chunking``).

``Chunking`` is the mode as it is passed to the runtime's builder, settled before the
build (``resolve_chunking`` measures an ``auto`` delay first); ``ChunkingMode`` is that
mode bound to one runtime's arena (``capsule_ros.runtime.mode`` has the protocol).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from capsule_ros.chunking.mark import ChunkingMark
from capsule_ros.chunking.schedule import ChunkingSettings, ChunkSchedule, RefillTiming, measured_delay
from capsule_ros.chunking.workers import FRESH, RefillWorker, make_worker, time_refills
from capsule_ros.errors import ConfigError, CorruptCapsule, FingerprintMismatch
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, BufferSpec, StateArena
from capsule_ros.runtime.marks import ModeMark
from capsule_ros.runtime.mode import EVERY_STEP, ExecutionMode, MarkBytes, ModeContext, ModeSetup, Program, StepReport
from capsule_ros.runtime.policy import (
    CHUNK,
    CHUNK_ACTIONS,
    CHUNK_CURSOR,
    CHUNK_PENDING,
    REQUEST_PREFIX,
    ChunkCadence,
    StatefulPolicy,
)
from capsule_ros.runtime.streams import StreamKeeper, on_stream

LOG = logging.getLogger(__name__)
ROWS = "chunk.rows"       # live arena scratch: 0, 1, ... (the rows of the ``chunk`` output after the cursor)


class ChunkProgram(str, enum.Enum):
    """The step programs of a chunking policy (the package docstring has the table)."""

    REFILL = "refill"
    CONSUME = "consume"
    REQUEST = "request"
    ADOPT = "adopt"
    ADOPT_REQUEST = "adopt+request"          # delay == execution horizon: the takeover step also requests


TAKEOVERS = (ChunkProgram.REFILL, ChunkProgram.ADOPT, ChunkProgram.ADOPT_REQUEST)


@dataclass
class ChunkCounters:
    refills: int = 0            # plans run (synchronous refills and submitted requests)
    consumes: int = 0           # steps that ran no network


@dataclass(frozen=True)
class Chunking:
    """The chunking mode of one runtime, settled before it is built: the schedule, which
    refill worker plans async requests (``auto``: a thread on a CPU, a stream on a GPU;
    ``inline``: on the caller's thread), and the refill times an ``auto`` delay was
    measured from (for reports; empty otherwise)."""

    schedule: ChunkSchedule
    worker: str = "auto"
    refill_seconds: Tuple[float, ...] = ()

    def scratch(self, policy: StatefulPolicy) -> List[BufferSpec]:
        """The row indices ``act`` selects with, and (async) where a refill's chunk lands."""
        specs = {spec.name: spec for spec in policy.state_spec()}
        out = [BufferSpec(ROWS, (specs[CHUNK].shape[0],), torch.int64, BufferKind.META)]
        if self.schedule.timing == RefillTiming.ASYNC:
            out.append(BufferSpec(FRESH, specs[CHUNK_ACTIONS].shape, torch.float32, BufferKind.CHUNK))
        return out

    def bind(self, context: ModeContext) -> ChunkingMode:
        cadence = context.policy.cadence()
        if cadence is None:
            raise ConfigError(f"{type(context.policy).__name__} declares no chunk cadence: it runs every step")
        context.policy.bind_schedule(self.schedule)      # before any program is captured
        rows = context.arena.scratch_views[ROWS]
        rows.copy_(torch.arange(rows.shape[0], dtype=torch.int64))
        worker = None
        if self.schedule.timing == RefillTiming.ASYNC:
            worker = make_worker(self.worker, context.policy, context.arena, cadence, context.stream, context.streams,
                                 context.use_graphs)
        return ChunkingMode(self, context, cadence, worker)

    def for_replica(self) -> Chunking:
        """The same schedule, planned inline: a replica replays, it does not race."""
        return dataclasses.replace(self, worker="inline")


class ChunkingMode(ExecutionMode):
    """A chunking policy's mode over one runtime's arena: its programs, the host mirror of
    the chunk cursor and pending flag, the refill worker (async). Not thread-safe: the
    runtime's caller serialises."""

    setup: Chunking

    def __init__(self, setup: Chunking, context: ModeContext, cadence: ChunkCadence, worker: Optional[RefillWorker]):
        super().__init__(setup, context)
        self.schedule = setup.schedule
        self.cadence = cadence
        self.worker = worker
        self.counters = ChunkCounters()
        self.last = StepReport(ChunkProgram.REFILL.value)
        self.cursor, self.pending = self.schedule.end, False
        self._before: Tuple[int, bool] = (self.cursor, self.pending)
        layout = context.arena.layout
        self._cursor_slot, self._pending_slot = layout[CHUNK_CURSOR], layout[CHUNK_PENDING]

    @property
    def arena(self) -> StateArena:
        return self.context.arena

    @property
    def stream(self) -> Optional[torch.cuda.Stream]:
        return self.context.stream

    # -- programs (capturable; the runtime's graphs replay them) ---------------------------------
    def programs(self) -> Dict[str, Program]:
        views, policy, s = self.arena.views, self.context.policy, self.schedule
        chunk, cursor, pending = views[CHUNK_ACTIONS], views[CHUNK_CURSOR], views[CHUNK_PENDING]
        rows, fresh = self.arena.scratch_views[ROWS], self.arena.scratch_views.get(FRESH)
        last_row = s.end - 1

        def act() -> None:
            # rows cursor, cursor + 1, ... (the last executed row repeated); clamped both ways,
            # so that no state, however it was made, indexes outside the chunk
            upcoming = chunk.index_select(0, torch.clamp(cursor + rows, min=0, max=last_row))
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
            assert fresh is not None
            chunk.copy_(fresh)                 # written by the worker's plan, ordered before this step
            cursor.fill_(s.delay)
            pending.zero_()

        def run(*phases: Program) -> Program:
            def program() -> None:
                for phase in phases:
                    phase()
            return program

        observe = lambda: policy.observe(views)  # noqa: E731
        out = {ChunkProgram.REFILL: run(observe, plan, act), ChunkProgram.CONSUME: run(observe, act)}
        if s.timing == RefillTiming.ASYNC:
            out[ChunkProgram.REQUEST] = run(observe, request, act)
            out[ChunkProgram.ADOPT] = run(adopt, observe, act)
            if s.delay == s.execution_horizon:
                out[ChunkProgram.ADOPT_REQUEST] = run(adopt, observe, request, act)
        return {program.value: fn for program, fn in out.items()}

    def prepare(self) -> None:
        if self.worker is not None:
            self.worker.prepare()

    # -- the host's choice -----------------------------------------------------------------------
    def next_program(self) -> ChunkProgram:
        """The program of the next step, from the host mirror alone."""
        s = self.schedule
        if self.cursor >= s.end:
            if not self.pending:
                return ChunkProgram.REFILL
            return ChunkProgram.ADOPT_REQUEST if s.delay == s.execution_horizon else ChunkProgram.ADOPT
        if s.timing == RefillTiming.ASYNC and self.cursor == s.execution_horizon:
            return ChunkProgram.REQUEST
        return ChunkProgram.CONSUME

    def plans(self) -> bool:
        """Whether the next step plans a chunk (a refill, or an asynchronous request)."""
        return self.next_program() in (ChunkProgram.REFILL, ChunkProgram.REQUEST, ChunkProgram.ADOPT_REQUEST)

    def reads_inputs(self) -> bool:
        return self.cadence.inputs_every_step or self.plans()

    def before_step(self) -> str:
        """Choose the program; for a takeover, note whether its refill is late and make
        its chunk visible to the live program."""
        program = self.next_program()
        self._before = (self.cursor, self.pending)
        late = False
        if program in (ChunkProgram.ADOPT, ChunkProgram.ADOPT_REQUEST):
            assert self.worker is not None
            late = not self.worker.ready()
            try:
                self.worker.before_adopt(self.stream)
            except Exception:
                self.worker.submit(self.stream)          # the next attempt plans the same request again
                raise
        self.last = StepReport(program.value, late)
        return program.value

    def after_step(self, program: str, eager: bool = False) -> StepReport:
        """Advance the mirror as the program advanced the arena; send a new request off
        (``eager``: planned by the Python a GPU worker's graph was captured from)."""
        s, ran = self.schedule, ChunkProgram(program)
        if ran == ChunkProgram.REFILL:
            self.cursor = 0
            self.counters.refills += 1
        elif ran in (ChunkProgram.ADOPT, ChunkProgram.ADOPT_REQUEST):
            self.cursor, self.pending = s.delay, False
        else:
            self.counters.consumes += 1
        if ran in (ChunkProgram.REQUEST, ChunkProgram.ADOPT_REQUEST):
            self.pending = True
            assert self.worker is not None
            self.worker.submit(self.stream, eager)
            self.counters.refills += 1
        self.cursor += 1
        return self.last

    def undo(self) -> None:
        """The mirror goes back with the arena. A request the step sent stays in the
        worker's queue, unused."""
        self.cursor, self.pending = self._before

    def reset(self) -> None:
        """A new episode (after ``init_state``): no chunk, nothing requested."""
        self.cursor, self.pending = self.schedule.end, False
        self.arena[CHUNK_CURSOR].fill_(self.cursor)
        self.arena[CHUNK_PENDING].zero_()

    # -- marks -----------------------------------------------------------------------------------
    def mark(self) -> ModeMark:
        s = self.schedule
        return ChunkingMark(s.timing.value, s.delay, s.execution_horizon, self.cursor, self.pending).to_mode_mark()

    def mark_of(self, data: torch.Tensor) -> ChunkingMark:
        """The mark of arena bytes ``data`` (uint8, the arena's size; any device), read
        from their cursor and pending buffers."""
        def value(slot) -> int:
            return int(data[slot.offset:slot.end].view(torch.int64)[0])
        s = self.schedule
        return ChunkingMark(s.timing.value, s.delay, s.execution_horizon, value(self._cursor_slot),
                            bool(value(self._pending_slot)))

    def admit(self, mark: Optional[ModeMark], data: MarkBytes, capsule_id: str) -> None:
        """Refuse, before anything changes, a capsule whose chunk schedule is not this
        runtime's (FingerprintMismatch) or whose mark is missing, malformed, disagrees with
        its bytes or is out of range (CorruptCapsule)."""
        s = self.schedule
        carried = ChunkingMark.parse(mark, capsule_id)
        if (carried.timing, carried.delay, carried.execution_horizon) != (s.timing.value, s.delay,
                                                                          s.execution_horizon):
            raise FingerprintMismatch(
                f"capsule {capsule_id!r} was made under control.chunking {carried.timing} with inference delay "
                f"{carried.delay} and execution horizon {carried.execution_horizon}; this runtime runs "
                f"{s.timing.value} with delay {s.delay} and horizon {s.execution_horizon}: its chunk state would "
                "mean something else here")
        stored = self.mark_of(data())
        if (stored.cursor, stored.pending) != (carried.cursor, carried.pending):
            raise CorruptCapsule(f"capsule {capsule_id!r}: its chunk cursor {stored.cursor} / pending "
                                 f"{int(stored.pending)} disagree with its metadata ({carried.cursor} / "
                                 f"{int(carried.pending)})")
        if carried.pending:     # requested at cursor == execution horizon, adopted at end
            reachable = s.timing == RefillTiming.ASYNC and s.execution_horizon < carried.cursor <= s.end
        else:                   # after a step (1 .. execution horizon), or a new episode's (end)
            reachable = 1 <= carried.cursor <= s.execution_horizon or carried.cursor == s.end
        if not reachable:
            raise CorruptCapsule(f"capsule {capsule_id!r}: chunk cursor {carried.cursor} (pending "
                                 f"{int(carried.pending)}) cannot occur under this schedule ({s.describe()})")

    def after_restore(self, mark: Optional[ModeMark], kinds: Sequence[BufferKind] = ()) -> None:
        """Mirror the restored mark and re-issue its pending request from the restored
        ``chunk.request.*`` (nothing when ``kinds`` leaves the cursor, a meta buffer, alone)."""
        if kinds and BufferKind.META not in kinds:
            return
        self._take_up(ChunkingMark.parse(mark))

    def resync(self) -> None:
        self._take_up(self.mark_of(self.arena.storage))

    def _take_up(self, mark: ChunkingMark) -> None:
        self.cursor, self.pending = mark.cursor, mark.pending
        if mark.pending:
            assert self.worker is not None
            self.worker.submit(self.stream)

    # -- checks ------------------------------------------------------------------------------------
    def rehearse(self) -> int:
        """Repeated steps that run every program: sync, from one row before the chunk is
        used up (consume, refill); async, from a used-up chunk with nothing requested
        (refill, consume, request, consume while the request is out, adopt)."""
        s = self.schedule
        cursor = s.end if s.timing == RefillTiming.ASYNC else max(0, s.execution_horizon - 1)
        self._place(cursor)
        return s.execution_horizon + s.delay + 1 if s.timing == RefillTiming.ASYNC else s.end - cursor + 1

    def warm_up_position(self) -> None:
        """A full chunk, nothing requested: the warm-up's steps consume. Plans run in the
        state check; one more would cost a camera policy's CPU start-up seconds."""
        self._place(0)

    def _place(self, cursor: int) -> None:
        """The chunk cursor at ``cursor`` with nothing requested, in the arena and the mirror."""
        with on_stream(self.stream):
            self.arena[CHUNK_CURSOR].fill_(cursor)
            self.arena[CHUNK_PENDING].fill_(0)
        self.cursor, self.pending = cursor, False

    def check_outputs(self, outputs: Mapping[str, np.ndarray]) -> None:
        if int(outputs[CHUNK_CURSOR][0]) != self.cursor:
            raise RuntimeError(f"chunk cursor {int(outputs[CHUNK_CURSOR][0])} in the arena, {self.cursor} in the "
                               "host mirror")

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


# -- settling the mode before the runtime is built ---------------------------------------------------

def measure_refills(policy: StatefulPolicy, cadence: ChunkCadence, settings: ChunkingSettings, *,
                    device: torch.device, streams: StreamKeeper, use_graphs: bool) -> Tuple[float, ...]:
    """Seconds of ``settings.auto_runs`` refills (after one untimed) by the worker the mode
    will have, over a scratch arena of the policy's layout on ``device`` (freed on return).
    The policy must be on ``device`` already (``capsule_ros.runtime.builder.place_policy``)."""
    schedule = ChunkSchedule(RefillTiming.ASYNC, 1, 1, cadence.length)      # only its scratch matters here
    arena = StateArena(ArenaLayout(policy.state_spec()), device, scratch=Chunking(schedule).scratch(policy))
    stream = streams.get(device, "step")
    worker = make_worker(settings.worker, policy, arena, cadence, stream, streams, use_graphs)
    try:
        return time_refills(worker, stream, settings.auto_runs)
    finally:
        worker.close()


def resolve_chunking(policy: StatefulPolicy, settings: ChunkingSettings, *, device: torch.device,
                     streams: Optional[StreamKeeper] = None, use_graphs: bool = True) -> Chunking:
    """The chunking mode of ``policy`` (which declares a cadence) under ``settings``; for an
    ``auto`` delay (async), the refill is measured first on ``device``. Raises ConfigError
    with the numbers (and the measurement) when the schedule cannot work."""
    cadence = policy.cadence()
    if cadence is None:
        raise ConfigError(f"{type(policy).__name__} declares no chunk cadence: it runs every step")
    seconds: Tuple[float, ...] = ()
    delay = settings.delay or 0
    if settings.timing == RefillTiming.ASYNC.value and settings.delay is None:
        seconds = measure_refills(policy, cadence, settings, device=device, streams=streams or StreamKeeper(),
                                  use_graphs=use_graphs)
        delay = measured_delay(seconds, settings.rate_hz)
        LOG.info("inference_delay_steps auto: refill p99 %.1f ms at %.1f Hz -> %d steps", max(seconds) * 1e3,
                 settings.rate_hz, delay)
    try:
        schedule = ChunkSchedule.resolve(cadence, settings.timing, delay, settings.execution_horizon)
    except ConfigError as exc:
        if not seconds:
            raise
        raise ConfigError(f"inference_delay_steps auto measured a refill of {max(seconds) * 1e3:.1f} ms (p99 of "
                          f"{len(seconds)}) at control.rate_hz {settings.rate_hz:g}: {delay} steps with its margin; "
                          f"{exc}") from None
    LOG.info("chunk schedule: %s", schedule.describe())
    return Chunking(schedule, settings.worker, seconds)


def mode_for(policy: StatefulPolicy, settings: ChunkingSettings = ChunkingSettings(), *,  # noqa: B008 - frozen
             device: Optional[torch.device] = None, streams: Optional[StreamKeeper] = None,
             use_graphs: bool = True) -> ModeSetup:
    """The mode ``policy`` runs in: chunking under ``settings`` for a policy that declares
    a chunk cadence (``resolve_chunking``; ``device``: where an ``auto`` delay is measured,
    default the policy's), the every-step mode otherwise."""
    if policy.cadence() is None:
        return EVERY_STEP
    if device is None:
        device = next(iter(policy.parameters()), torch.empty(0)).device
    return resolve_chunking(policy, settings, device=device, streams=streams, use_graphs=use_graphs)
