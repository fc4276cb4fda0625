"""The chunking mode over a batched fleet: each robot's chunk schedule is its own, its
refills fall on its own steps, and every program still runs over all S slots.

Each slot keeps the single robot's ``ChunkingMode`` (``capsule_ros.chunking.mode``) over its
slot: its cursor mirror, its marks, what it admits, its resets and undos. What runs is the
fleet's: two programs over every slot, built from the same phases as the single robot's
(``observe``, ``plan``, ``emit``; the request's copy; the takeover's adoption), each one
batched with ``torch.func.vmap``, the per-slot choice made by masks:

========== ============================================================================
program    phases, in order (each phase of a slot applies only where its mask is on)
========== ============================================================================
refill     adopt [adopt], observe, plan [plan], request [request], act
consume    adopt [adopt], observe, request [request], act
========== ============================================================================

``refill`` runs when any stepping slot's own mode chose its refill program: the network
runs over all S slots (a fixed shape: never a sub-batch of those that plan, whose size
would change the bits), and only the ``plan`` slots take its chunk. Otherwise ``consume``:
no network. A slot's choices are its own mode's (refill, consume, request, adopt,
adopt+request), so its cursor, the rows it executes and its takeovers are a single robot's.

Asynchronous refills: the requests of one fleet step go to the fleet's refill worker as
one batched plan over all S slots (``FleetRefill``: a thread on a CPU, a stream with its
captured graph on a GPU), whose chunk lands in the scratch ``chunk.fresh`` of the slots
that asked only; a slot's takeover waits for the plan that holds its request. A request
made outside a fleet step (a restore re-issuing a pending one) is planned at once.
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
from capsule_ros.runtime.arena import ArenaLayout, BufferSpec
from capsule_ros.runtime.batching import no_fallback, refuse_unbatchable, vmapped
from capsule_ros.runtime.fleetmode import FleetContext, FleetMode
from capsule_ros.runtime.mode import ExecutionMode, ModeContext, ModeSetup, Program
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
REFILL_PROGRAM, CONSUME_PROGRAM = ChunkProgram.REFILL.value, ChunkProgram.CONSUME.value


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

    def programs(self) -> Dict[str, Program]:
        return {REFILL_PROGRAM: self._program(plans=True), CONSUME_PROGRAM: self._program(plans=False)}

    def _program(self, plans: bool) -> Program:
        """The fleet program with (``plans``) or without the network (see the module docstring)."""
        policy, schedule, reads = self.context.policy, self.schedule, self.cadence.reads
        asynchronous, last_row = schedule.timing == RefillTiming.ASYNC, schedule.end - 1
        masks = self.context.masks

        def slot_step(state: State, scratch: State, plan: torch.Tensor, adopt: torch.Tensor,
                      request: torch.Tensor) -> None:
            chunk, cursor, pending = state[CHUNK_ACTIONS], state[CHUNK_CURSOR], state[CHUNK_PENDING]
            if asynchronous:
                chunk.copy_(torch.where(adopt, scratch[FRESH], chunk))
                cursor.copy_(torch.where(adopt, torch.full_like(cursor, schedule.delay), cursor))
                pending.copy_(torch.where(adopt, torch.zeros_like(pending), pending))
            policy.observe(state)
            if plans:
                fresh = chunk.clone()                      # a plan may read the chunk it replaces
                policy.plan(state, fresh)
                chunk.copy_(torch.where(plan, fresh, chunk))
                cursor.copy_(torch.where(plan, torch.zeros_like(cursor), cursor))
            if asynchronous:
                for name in reads:
                    copy = state[REQUEST_PREFIX + name]
                    copy.copy_(torch.where(request, state[name], copy))
                pending.copy_(torch.where(request, torch.ones_like(pending), pending))
            upcoming = chunk.index_select(0, torch.clamp(cursor + scratch[ROWS], min=0, max=last_row))
            policy.emit(state, upcoming[0], upcoming)
            cursor.add_(1)

        off = torch.zeros_like(masks.row(PLAN))
        row = masks.row
        return vmapped(slot_step, self.context.arena.views, self.context.arena.scratch_views, row(PLAN),
                       row(ADOPT) if asynchronous else off, row(REQUEST) if asynchronous else off)

    def program_for(self, chosen: Mapping[int, str]) -> str:
        programs = {slot: ChunkProgram(program) for slot, program in chosen.items()}
        masks = self.context.masks
        masks.set(PLAN, [slot for slot, p in programs.items() if p == ChunkProgram.REFILL])
        if self.worker is not None:
            adopting = (ChunkProgram.ADOPT, ChunkProgram.ADOPT_REQUEST)
            masks.set(ADOPT, [slot for slot, p in programs.items() if p in adopting])
            masks.set(REQUEST, [slot for slot, p in programs.items()
                                if p in (ChunkProgram.REQUEST, ChunkProgram.ADOPT_REQUEST)])
            self.worker.collect()
        return REFILL_PROGRAM if ChunkProgram.REFILL in programs.values() else CONSUME_PROGRAM

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
    """The refill worker of a batched fleet: each submission plans ALL S slots' request
    copies in one batched plan (a fixed shape) and lands the chunk of the slots that asked
    in their ``chunk.fresh``. Submissions run in order: a thread on a CPU; on a GPU a
    stream of its own, the request copy and the plan each captured as a CUDA graph (the
    landing mask is a pinned host buffer the copy graph reads). ``inline``: at submission,
    on the caller's thread (a replica's). Its slots see it through ``SlotRefill``."""

    def __init__(self, policy: StatefulPolicy, live: FleetArena, cadence: ChunkCadence,
                 live_stream: Optional[torch.cuda.Stream], stream: Optional[torch.cuda.Stream], *,
                 inline: bool = False, use_graphs: bool = True):
        reads = [live.layout[name].spec for name in cadence.reads]
        self.arena = FleetArena(ArenaLayout(reads), live.slots, live.device)
        self.live_fresh = live.scratch_views[FRESH]
        self.fresh = torch.zeros_like(self.live_fresh)
        self.pairs = [(live.views[REQUEST_PREFIX + spec.name], self.arena.views[spec.name]) for spec in reads]
        cuda = live.device.type == "cuda"
        self.inline = inline
        self.live_stream = live_stream
        self.stream = live_stream if inline else stream      # inline: in the live stream's order
        self.use_graphs = use_graphs and cuda and not inline
        self.mask_host = torch.zeros(live.slots, dtype=torch.bool, pin_memory=cuda)
        self.mask = torch.zeros(live.slots, dtype=torch.bool, device=live.device) if cuda else self.mask_host
        self._plan = vmapped(lambda state, chunk: policy.plan(state, chunk), self.arena.views, self.fresh)
        self._collecting = False
        self._batch: Set[int] = set()
        self._done: Dict[int, object] = {}          # slot -> the Future (CPU) or Event (GPU) of its last plan
        self._copied: Optional[torch.cuda.Event] = None
        self._graphs: Tuple[torch.cuda.CUDAGraph, ...] = ()
        self._pool = None if cuda or inline else concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="capsule-fleet-refill")

    # -- phases -------------------------------------------------------------------------------
    def _copy(self) -> None:
        """Every slot's request copy into the worker's arena, and the landing mask in."""
        for source, target in self.pairs:
            target.copy_(source)
        if self.mask is not self.mask_host:
            self.mask.copy_(self.mask_host, non_blocking=True)

    def _plan_and_land(self, mask: torch.Tensor) -> None:
        with torch.inference_mode():
            self.fresh.copy_(self.live_fresh)
            self._plan()
            self.live_fresh.copy_(torch.where(mask.view(-1, 1, 1), self.fresh, self.live_fresh))

    # -- the fleet mode's side ----------------------------------------------------------------
    def prepare(self) -> None:
        """Warm the batched plan up (vmap's fallback off: refused naming an unbatchable
        operation) and, on a GPU, capture the copy and the plan."""
        saved = self.live_fresh.clone()
        try:
            with no_fallback(), on_stream(self.stream), torch.inference_mode():
                for _ in range(2):
                    self._copy()
                    self._plan_and_land(torch.zeros_like(self.mask))
                if self.use_graphs and self.stream is not None:
                    copy, plan = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                    pool = torch.cuda.graph_pool_handle()
                    with torch.cuda.graph(copy, pool=pool, stream=self.stream):
                        self._copy()
                    with torch.cuda.graph(plan, pool=pool, stream=self.stream):
                        self._plan_and_land(self.mask)
                    self._graphs = (copy, plan)
        except Exception as exc:
            refuse_unbatchable(exc, "the policy's plan")
            raise
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
        """Submit the collected requests as one batched plan (nothing when there are none)."""
        self._collecting = False
        slots, self._batch = sorted(self._batch), set()
        if not slots:
            return
        if self._copied is not None:
            self._copied.synchronize()            # the previous copy read the host mask: done with it
        self.mask_host.zero_()
        self.mask_host[slots] = True
        if self._pool is not None:                 # a CPU thread: the request copied here, planned there
            self._copy()
            future = self._pool.submit(self._plan_and_land, self.mask_host.clone())
            self._done.update((slot, future) for slot in slots)
            return
        if self.stream is None:                    # inline on a CPU
            self._copy()
            self._plan_and_land(self.mask)
            return
        assert self.live_stream is not None
        self.stream.wait_stream(self.live_stream)
        copied, done = torch.cuda.Event(), torch.cuda.Event()
        with on_stream(self.stream), torch.inference_mode():
            if self._graphs and not eager:
                self._graphs[0].replay()
                copied.record(self.stream)
                self._graphs[1].replay()
            else:
                self._copy()
                copied.record(self.stream)
                self._plan_and_land(self.mask)
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


__all__ = ["ChunkingFleet", "FleetChunking", "FleetRefill", "SlotRefill", "fleet_form"]
