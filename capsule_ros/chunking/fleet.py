"""The chunking mode over a batched fleet: each robot's chunk schedule is its own, its
refills fall on its own steps, and each refill computes one robot's chunk at batch 1.

Each slot keeps the single robot's ``ChunkingMode`` (``capsule_ros.chunking.mode``) over its
slot: its cursor mirror, its marks, what it admits, its resets and undos. What runs is the
fleet's: the phases of the single robot's programs (``observe``, ``plan``, ``emit``; the
request's copy; the takeover's adoption), the per-slot choice made by masks. Every phase
but the plan runs over all S slots at once (``torch.func.vmap``); the plan runs at batch 1
for one planning slot (``SlotPlan``: that slot's rows gathered into a one-robot staging
arena by a device index, the policy's own unbatched ``plan`` on it, the chunk scattered
back; one captured graph whichever the slot). A fleet step is one of:

=============== ========================================================================
fleet programs  phases, in order (each phase of a slot applies only where its mask is on)
=============== ========================================================================
consume         adopt [adopt], observe, request [request], act
consume.steady  observe, act                    (async: no slot adopts or requests this step)
refill.observe  adopt [adopt], observe                                    (opens the step)
refill.plan     plan at batch 1 of the next slot in [plan]      (once per planning slot)
refill.act      request [request], act                                   (closes the step)
=============== ========================================================================

A step in which any stepping slot's own mode chose its refill runs the ``refill.*``
sequence, with ``refill.plan`` once for each such slot; otherwise ``consume``: no network.
An asynchronous fleet's consume step in which no slot adopts or requests (most steps: each
robot does each once a chunk) runs ``consume.steady``, the same bytes without the masked
passes: the request's copy covers every slot's copy of what the plan reads (a camera's
frame each), a pass over all S of them in every step that runs it.
A slot's choices are its own mode's (refill, consume, request, adopt, adopt+request), so
its cursor, the rows it executes and its takeovers are a single robot's.

Why batch 1 for every plan, never one batched plan when several slots plan on one step: a
robot's chunk must not depend on which other robots plan with it. A batched plan at a fixed
shape S keeps each row independent of the other rows' values, but its bits are those of
batch S, not of batch 1 (the batch size is part of what computes them), so switching
between the two by how many slots plan would make a robot's bits depend on its neighbours'
schedules; and a batched plan over all S slots whenever any one of them refills (the
fleet's former design) computes S chunks to keep one. One batch-1 plan per planning slot
costs a single runtime's refill per refill, and its chunk is bit for bit the chunk a single
runtime of the same policy plans from the same observed buffers (docs/fleet.md says what
that leaves to S).

Asynchronous refills: the requests of one fleet step go to the fleet's refill worker
(``FleetRefill``: a thread on a CPU, a stream with its captured graphs on a GPU), which
copies them and plans each asking slot at batch 1 in turn (its own ``SlotPlan``), landing
each chunk in that slot's scratch ``chunk.fresh``; a slot's takeover waits for the plan
that holds its request. A request made outside a fleet step (a restore re-issuing a
pending one) is planned at once.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from capsule_ros.chunking.mode import Chunking, ChunkingMode, ChunkProgram
from capsule_ros.chunking.schedule import RefillTiming
from capsule_ros.chunking.workers import FRESH, RefillWorker
from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, BufferSpec, StateArena
from capsule_ros.runtime.batching import vmapped
from capsule_ros.runtime.fleetmode import FleetContext, FleetMode, FleetProgram
from capsule_ros.runtime.mode import ExecutionMode, ModeContext, ModeSetup
from capsule_ros.runtime.policy import (
    CHUNK_ACTIONS,
    CHUNK_CURSOR,
    CHUNK_PENDING,
    REQUEST_PREFIX,
    ChunkCadence,
    State,
    StatefulPolicy,
)
from capsule_ros.runtime.slots import FleetArena
from capsule_ros.runtime.streams import on_stream

ROWS = "chunk.rows"
PLAN, ADOPT, REQUEST = "plan", "adopt", "request"
CONSUME_PROGRAM = ChunkProgram.CONSUME.value
CONSUME_STEADY = "consume.steady"
REFILL_OBSERVE, REFILL_PLAN, REFILL_ACT = "refill.observe", "refill.plan", "refill.act"


class SlotPlan:
    """One robot's ``plan`` at batch 1 inside a fleet program, for a slot named by a device
    index, so that one captured graph serves every slot. ``begin`` takes the slots that plan
    (a device mask); each ``run`` plans the lowest of them not planned yet: it gathers that
    slot's rows of the buffers ``plan`` reads, and of the chunk it replaces, into a one-robot
    staging arena, runs the policy's own (unbatched) ``plan`` there, and scatters the chunk
    back into the slot's row. The host runs it once per slot of the mask. The staging lays
    its buffers out as a single runtime's arena does (aligned, contiguous), so the chunk is
    the one a single runtime plans from the same buffers, bit for bit.

    ``sources``: name -> ``[S, *shape]`` view of each buffer ``plan`` reads (``specs`` has
    their specs); ``chunk``: ``[S, length, A]``, where each slot's chunk is read from and
    written to; ``chunk_read_as``: the name under which ``plan`` also reads that chunk (a
    single runtime's synchronous refill passes ``chunk.actions`` as both), if it does."""

    def __init__(self, policy: StatefulPolicy, specs: Mapping[str, BufferSpec], sources: Mapping[str, torch.Tensor],
                 chunk: torch.Tensor, chunk_read_as: Optional[str] = None):
        self.policy = policy
        self.slots = int(chunk.shape[0])
        chunk_name = chunk_read_as or "chunk.planned"
        layout = ArenaLayout([*(specs[name] for name in sources),
                              BufferSpec(chunk_name, tuple(chunk.shape[1:]), chunk.dtype, BufferKind.CHUNK)])
        self.staging = StateArena(layout, chunk.device)
        self.chunk = chunk
        self.staged_chunk = self.staging[chunk_name]
        self.pairs = [(source, self.staging[name]) for name, source in sources.items()]
        self.state = {name: self.staging[name] for name in (*sources, *([chunk_read_as] if chunk_read_as else ()))}
        self.todo = torch.zeros(self.slots, dtype=torch.bool, device=chunk.device)
        self.slot_ids = torch.arange(self.slots, dtype=torch.int64, device=chunk.device)

    def begin(self, mask: torch.Tensor) -> None:
        """Capturable: the slots to plan (bool ``[S]`` on the device)."""
        self.todo.copy_(mask)

    def run(self) -> torch.Tensor:
        """Capturable: plan the lowest slot still to plan (the last slot when none is left:
        the host never asks for that); its index, ``[1]`` on the device."""
        slot = torch.where(self.todo, self.slot_ids, self.slots).amin().clamp(max=self.slots - 1).view(1)
        for source, staged in self.pairs:
            staged.copy_(source.index_select(0, slot)[0])
        self.staged_chunk.copy_(self.chunk.index_select(0, slot)[0])
        self.policy.plan(self.state, self.staged_chunk)
        self.chunk.index_copy_(0, slot, self.staged_chunk.unsqueeze(0))
        self.todo.index_fill_(0, slot, False)
        return slot

    def owned(self, prefix: str) -> Dict[str, torch.Tensor]:
        """Its device buffers, named (the graphs' address check)."""
        return {f"{prefix} staging": self.staging.storage, f"{prefix} slots to plan": self.todo,
                f"{prefix} slot ids": self.slot_ids}


@dataclass(frozen=True)
class FleetChunking:
    """The chunking mode as a batched fleet takes it: the single robot's ``Chunking`` (its
    schedule and worker; every slot runs it) with a fleet form (``fleet_masks``,
    ``bind_fleet``). A loop fleet binds ``chunking`` per slot, as a single runtime does."""

    chunking: Chunking

    def scratch(self, policy: StatefulPolicy) -> List[BufferSpec]:
        return self.chunking.scratch(policy)

    def bind(self, context: ModeContext) -> ExecutionMode:
        return self.chunking.bind(context)

    def for_replica(self) -> FleetChunking:
        return FleetChunking(self.chunking.for_replica())

    def fleet_masks(self) -> Tuple[str, ...]:
        return (PLAN, ADOPT, REQUEST) if self.chunking.schedule.timing == RefillTiming.ASYNC else (PLAN,)

    def bind_fleet(self, context: FleetContext) -> ChunkingFleet:
        cadence = context.policy.cadence()
        if cadence is None:
            raise ConfigError(f"{type(context.policy).__name__} declares no chunk cadence: it runs every step")
        context.policy.bind_schedule(self.chunking.schedule)     # before any program is captured
        rows = context.arena.scratch_views[ROWS]
        rows.copy_(torch.arange(rows.shape[1], dtype=torch.int64, device=rows.device).expand_as(rows))
        worker = None
        if self.chunking.schedule.timing == RefillTiming.ASYNC:
            worker = FleetRefill(context.policy, context.arena, cadence, context.stream, context.streams.get(
                context.arena.device, "refill"), inline=self.chunking.worker == "inline",
                use_graphs=context.use_graphs)
        slots = [ChunkingMode(self.chunking, context.slot_context(i), cadence,
                              SlotRefill(worker, i) if worker is not None else None)
                 for i in range(context.arena.slots)]
        return ChunkingFleet(self, context, slots, cadence, worker)


def fleet_form(mode: ModeSetup) -> ModeSetup:
    """``mode`` as a fleet takes it: the chunking mode with its fleet form, any other as it is."""
    return FleetChunking(mode) if isinstance(mode, Chunking) else mode


class ChunkingFleet(FleetMode):
    """The chunking mode of a batched fleet (see the module docstring)."""

    def __init__(self, setup: FleetChunking, context: FleetContext, slot_modes: Sequence[ChunkingMode],
                 cadence: ChunkCadence, worker: Optional[FleetRefill]):
        super().__init__(setup, context, slot_modes)
        self.schedule = setup.chunking.schedule
        self.cadence = cadence
        self.worker = worker
        views = context.arena.views
        reads = [name for name in cadence.reads if name != CHUNK_ACTIONS]
        self.planner = SlotPlan(context.policy, {slot.spec.name: slot.spec for slot in context.arena.layout},
                                {name: views[name] for name in reads}, views[CHUNK_ACTIONS],
                                CHUNK_ACTIONS if CHUNK_ACTIONS in cadence.reads else None)

    def programs(self) -> Dict[str, FleetProgram]:
        before, after = self._phases(takeovers=True)
        planner, masks, cursor = self.planner, self.context.masks, self.context.arena.views[CHUNK_CURSOR]

        def consume() -> None:
            before()
            after()

        def observe() -> None:
            before()
            planner.begin(masks.row(PLAN))

        def plan() -> None:
            cursor.index_fill_(0, planner.run(), 0)

        programs = {CONSUME_PROGRAM: FleetProgram(consume),
                    REFILL_OBSERVE: FleetProgram(observe, closes=False),
                    REFILL_PLAN: FleetProgram(plan, opens=False, closes=False),
                    REFILL_ACT: FleetProgram(after, opens=False)}
        if self.worker is not None:
            observe_only, act_only = self._phases(takeovers=False)

            def steady() -> None:
                observe_only()
                act_only()
            programs[CONSUME_STEADY] = FleetProgram(steady)
        return programs

    def _phases(self, takeovers: bool):
        """The batched phases before the plan (adopt, observe) and after it (request, act),
        each over every slot; the adoption and the request only where the refills are
        asynchronous and ``takeovers`` (``consume.steady`` leaves them out)."""
        policy, schedule, reads = self.context.policy, self.schedule, self.cadence.reads
        asynchronous, last_row = takeovers and schedule.timing == RefillTiming.ASYNC, schedule.end - 1
        masks, arena = self.context.masks, self.context.arena
        requests = [(arena.views[name], arena.views[REQUEST_PREFIX + name]) for name in reads] if asynchronous else []

        def copy_requests() -> None:
            """Each asking slot's copy of what the plan reads, over the S rows at once and in
            place (one pass each; vmap has no ``out=``)."""
            asking = masks.row(REQUEST)
            for live, copy in requests:
                torch.where(asking.view(-1, *(1,) * (live.dim() - 1)), live, copy, out=copy)

        def slot_before(state: State, scratch: State, adopt: torch.Tensor) -> None:
            if asynchronous:
                chunk, cursor, pending = state[CHUNK_ACTIONS], state[CHUNK_CURSOR], state[CHUNK_PENDING]
                chunk.copy_(torch.where(adopt, scratch[FRESH], chunk))
                cursor.copy_(torch.where(adopt, torch.full_like(cursor, schedule.delay), cursor))
                pending.copy_(torch.where(adopt, torch.zeros_like(pending), pending))
            policy.observe(state)

        def slot_after(state: State, scratch: State, request: torch.Tensor) -> None:
            chunk, cursor, pending = state[CHUNK_ACTIONS], state[CHUNK_CURSOR], state[CHUNK_PENDING]
            if asynchronous:
                pending.copy_(torch.where(request, torch.ones_like(pending), pending))
            upcoming = chunk.index_select(0, torch.clamp(cursor + scratch[ROWS], min=0, max=last_row))
            policy.emit(state, upcoming[0], upcoming)
            cursor.add_(1)

        off = torch.zeros_like(masks.row(PLAN))
        adopt, request = (masks.row(ADOPT), masks.row(REQUEST)) if asynchronous else (off, off)
        act = vmapped(slot_after, arena.views, arena.scratch_views, request)

        def after() -> None:
            if asynchronous:
                copy_requests()
            act()
        return vmapped(slot_before, arena.views, arena.scratch_views, adopt), after

    def program_for(self, chosen: Mapping[int, str]) -> Tuple[str, ...]:
        programs = {slot: ChunkProgram(program) for slot, program in chosen.items()}
        masks = self.context.masks
        planning = [slot for slot, p in programs.items() if p == ChunkProgram.REFILL]
        masks.set(PLAN, planning)
        takeovers = False
        if self.worker is not None:
            adopting = [slot for slot, p in programs.items() if p in (ChunkProgram.ADOPT, ChunkProgram.ADOPT_REQUEST)]
            asking = [slot for slot, p in programs.items() if p in (ChunkProgram.REQUEST, ChunkProgram.ADOPT_REQUEST)]
            masks.set(ADOPT, adopting)
            masks.set(REQUEST, asking)
            takeovers = bool(adopting or asking)
            self.worker.collect()
        if not planning:
            return (CONSUME_PROGRAM if takeovers or self.worker is None else CONSUME_STEADY,)
        return (REFILL_OBSERVE, *(REFILL_PLAN,) * len(planning), REFILL_ACT)

    def owned(self) -> Dict[str, torch.Tensor]:
        return self.planner.owned("refill")

    def after_fleet_step(self, chosen: Mapping[int, str], eager: bool = False) -> None:
        if self.worker is not None:
            self.worker.launch(eager)

    def prepare(self) -> None:
        if self.worker is not None:
            self.worker.prepare()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class FleetRefill:
    """The refill worker of a batched fleet: a submission (the requests of one fleet step)
    copies the asking slots' request copies into the worker's arena of S slots and plans
    each asking slot at batch 1 in turn (``SlotPlan``), landing its chunk in that slot's
    ``chunk.fresh`` only. Submissions run in order: a thread on a CPU; on a GPU a stream of
    its own, with the copy (every slot's request, the asking mask) and one slot's plan each
    captured as a CUDA graph, the plan replayed once per asking slot (the mask is a pinned
    host buffer the copy graph reads). ``inline``: at submission, on the caller's thread (a
    replica's). Its slots see it through ``SlotRefill``."""

    def __init__(self, policy: StatefulPolicy, live: FleetArena, cadence: ChunkCadence,
                 live_stream: Optional[torch.cuda.Stream], stream: Optional[torch.cuda.Stream], *,
                 inline: bool = False, use_graphs: bool = True):
        reads = {name: live.layout[name].spec for name in cadence.reads}
        self.arena = FleetArena(ArenaLayout(reads.values()), live.slots, live.device)
        self.live_fresh = live.scratch_views[FRESH]
        self.pairs = [(live.views[REQUEST_PREFIX + name], self.arena.views[name]) for name in reads]
        self.planner = SlotPlan(policy, reads, self.arena.views, self.live_fresh)
        cuda = live.device.type == "cuda"
        self.inline = inline
        self.live_stream = live_stream
        self.stream = live_stream if inline else stream      # inline: in the live stream's order
        self.use_graphs = use_graphs and cuda and not inline
        self.mask_host = torch.zeros(live.slots, dtype=torch.bool, pin_memory=cuda)
        self.mask = torch.zeros(live.slots, dtype=torch.bool, device=live.device) if cuda else self.mask_host
        self._collecting = False
        self._batch: Set[int] = set()
        self._done: Dict[int, object] = {}          # slot -> the Future (CPU) or Event (GPU) of its last plan
        self._copied: Optional[torch.cuda.Event] = None
        self._graphs: Tuple[torch.cuda.CUDAGraph, ...] = ()
        self._pool = None if cuda or inline else concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="capsule-fleet-refill")

    # -- phases -------------------------------------------------------------------------------
    def _copy(self, slots: Optional[Sequence[int]] = None) -> None:
        """The request copies of ``slots`` (every slot: a fixed shape to capture) into the
        worker's arena."""
        for source, target in self.pairs:
            if slots is None:
                target.copy_(source)
            else:
                for slot in slots:
                    target[slot].copy_(source[slot])

    def _begin(self) -> None:
        """The asking mask onto the device (captured with the copy on a GPU), as the plans' to-do."""
        if self.mask is not self.mask_host:
            self.mask.copy_(self.mask_host, non_blocking=True)
        self.planner.begin(self.mask)

    def _plan_slots(self, count: int, mask: Optional[torch.Tensor] = None) -> None:
        """``count`` batch-1 plans, the asking slots in turn (``mask``: their mask, on a CPU thread)."""
        with torch.inference_mode():
            if mask is not None:
                self.planner.begin(mask)
            for _ in range(count):
                self.planner.run()

    # -- the fleet mode's side ----------------------------------------------------------------
    def prepare(self) -> None:
        """Warm the copy and a slot's plan up and, on a GPU, capture them (the plan once: it
        serves every slot)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.live_fresh.device))
        with on_stream(self.stream), torch.inference_mode():
            saved = self.live_fresh.clone()             # the warm-up plans write a slot's chunk.fresh
            try:
                for _ in range(2):
                    self._copy()
                    self._begin()
                    self._plan_slots(1)
                if self.use_graphs and self.stream is not None:
                    copy, plan = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                    pool = torch.cuda.graph_pool_handle()
                    with torch.cuda.graph(copy, pool=pool, stream=self.stream):
                        self._copy()
                        self._begin()
                    with torch.cuda.graph(plan, pool=pool, stream=self.stream):
                        self.planner.run()
                    self._graphs = (copy, plan)
            finally:
                self.live_fresh.copy_(saved)
        if self.stream is not None:
            self.stream.synchronize()

    def collect(self) -> None:
        """A fleet step begins: its slots' requests form one submission (``launch``)."""
        self._collecting = True
        self._batch.clear()

    def request(self, slot: int, eager: bool = False) -> None:
        """``slot`` asks for a plan: with the fleet step's others, or at once outside one."""
        self._batch.add(slot)
        if not self._collecting:
            self.launch(eager)

    def launch(self, eager: bool = False) -> None:
        """Submit the collected requests: one batch-1 plan per asking slot, in slot order
        (nothing when there are none)."""
        self._collecting = False
        slots, self._batch = sorted(self._batch), set()
        if not slots:
            return
        if self._copied is not None:
            self._copied.synchronize()            # the previous copy read the host mask: done with it
        self.mask_host.zero_()
        self.mask_host[slots] = True
        if self._pool is not None:                 # a CPU thread: the requests copied here, planned there
            self._copy(slots)
            future = self._pool.submit(self._plan_slots, len(slots), self.mask_host.clone())
            self._done.update((slot, future) for slot in slots)
            return
        if self.stream is None:                    # inline on a CPU
            self._copy(slots)
            self._begin()
            self._plan_slots(len(slots))
            return
        assert self.live_stream is not None
        self.stream.wait_stream(self.live_stream)
        copied, done = torch.cuda.Event(), torch.cuda.Event()
        with on_stream(self.stream), torch.inference_mode():
            if self._graphs and not eager:
                self._graphs[0].replay()
                copied.record(self.stream)
                for _ in slots:
                    self._graphs[1].replay()
            else:
                self._copy()
                self._begin()
                copied.record(self.stream)
                self._plan_slots(len(slots))
            done.record(self.stream)
        self.live_stream.wait_event(copied)
        self._copied = copied
        self._done.update((slot, done) for slot in slots)

    def ready(self, slot: int) -> bool:
        done = self._done.get(slot)
        if done is None:
            return True
        return done.done() if isinstance(done, concurrent.futures.Future) else bool(done.query())  # type: ignore

    def before_adopt(self, slot: int, live_stream: Optional[torch.cuda.Stream]) -> None:
        done = self._done.get(slot)
        if isinstance(done, concurrent.futures.Future):
            done.result()
        elif done is not None and live_stream is not None:
            live_stream.wait_event(done)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.stream is not None:
            self.stream.synchronize()
        self._graphs = ()


class SlotRefill(RefillWorker):
    """A slot's view of its fleet's ``FleetRefill`` (the refill worker its ``ChunkingMode`` uses)."""

    def __init__(self, fleet: FleetRefill, slot: int):       # no arena of its own: the fleet's worker has it
        self._fleet = fleet
        self._slot = slot

    def submit(self, live_stream: Optional[torch.cuda.Stream], eager: bool = False) -> None:
        self._fleet.request(self._slot, eager)

    def ready(self) -> bool:
        return self._fleet.ready(self._slot)

    def before_adopt(self, live_stream: Optional[torch.cuda.Stream]) -> None:
        self._fleet.before_adopt(self._slot, live_stream)


__all__ = ["ChunkingFleet", "FleetChunking", "FleetRefill", "SlotPlan", "SlotRefill", "fleet_form"]
