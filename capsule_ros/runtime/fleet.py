"""FleetRuntime: S robots served from one copy of the weights and ONE arena with a slot
axis (``capsule_ros.runtime.slots``): one runtime per slot, and a step of any set of slots.

Each slot is a robot's runtime (``runtime(i)``): a ``PolicyRuntime`` over its slot of the
arena, with the single robot's face (inputs, step, outputs, reset, prefill, undo, marks),
so a capsule of a robot is one copy of its slot's range, and a session serves it as it
serves a single runtime. ``step(slots)`` advances the given slots in one fleet step; every
other slot keeps its bytes exactly. Two batchings (``fleet.batching``; docs/fleet.md has
the measured cost of each):

- ``vmap`` (``BatchedFleet``): one program per execution-mode program over ALL S slots,
  the policy's single-robot step batched with ``torch.func.vmap`` (one captured CUDA graph
  each; eager on a CPU). A per-slot READY mask, which the host writes before the step,
  decides which rows advance (the stepping slots' inputs are copied in before it too):
  the program keeps a copy of every slot's state (the step guard's copy), runs the batched
  step over every slot, then merges byte for byte, so a slot that is not ready gets its
  state back exactly. (A mode may run a step as several
  programs in a row, ``capsule_ros.runtime.fleetmode``: a chunking fleet plans each
  refilling robot's chunk at batch 1 between its batched phases.) A slot's bits never depend on the
  other slots' values, but the batch size S is part of what computes them, so the
  fingerprint includes S (and the batching): a capsule or bag made under another S is
  refused with the reason.
- ``loop`` (``LoopFleet``): each slot runs the single-robot programs over its own slot
  (its own captured graphs), one slot after the other: batch-invariant (the bits and the
  fingerprint are a single runtime's, so capsules and bags move between a fleet and a
  ``policy_node``), at the cost of S steps' launches. Policies vmap cannot batch (one
  that runs outside torch, such as ONNX Runtime's) run this way.

The core owns no thread and no loop: which robots step together, and when, is decided
above it (``capsule_ros.fleet``). Not thread-safe: callers serialise.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from capsule_ros.errors import InvalidArgument
from capsule_ros.runtime.batching import READY, SlotMasks, keep_where
from capsule_ros.runtime.engine import CHECKED_OUTPUTS, PolicyRuntime
from capsule_ros.runtime.fingerprint import RuntimeIdentity
from capsule_ros.runtime.fleetmode import FleetMode, FleetProgram
from capsule_ros.runtime.graphs import ProgramGraphs
from capsule_ros.runtime.mode import STEP_PROGRAM, ModeSetup, Program, StepReport
from capsule_ros.runtime.schema import ALIGNMENT, STATE_KINDS, BufferKind
from capsule_ros.runtime.slots import FleetArena
from capsule_ros.runtime.streams import on_stream

BATCHINGS = ("auto", "vmap", "loop")
StepOutcome = Union[StepReport, Exception]     # a slot's step: its report, or what it raised


class FleetRuntime(abc.ABC):
    """S slots' runtimes over one arena (see the module docstring)."""

    batching: str

    def __init__(self, *, arena: FleetArena, identity: RuntimeIdentity, mode: ModeSetup,
                 stream: Optional[torch.cuda.Stream]):
        self.arena = arena
        self.identity = identity
        self.mode_setup = mode                   # the single-robot mode it was built in (replicas rebuild it)
        self.stream = stream
        self.runtimes: Tuple[PolicyRuntime, ...] = ()

    @property
    def slots(self) -> int:
        return self.arena.slots

    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint

    @property
    def device(self) -> torch.device:
        return self.arena.device

    def runtime(self, slot: int) -> PolicyRuntime:
        """Slot ``slot``'s runtime (the single robot's face over its slot)."""
        if not 0 <= slot < self.slots:
            raise InvalidArgument(f"slot {slot}: the fleet has slots 0..{self.slots - 1}")
        return self.runtimes[slot]

    @abc.abstractmethod
    def step(self, slots: Sequence[int], eager: bool = False) -> Dict[int, StepOutcome]:
        """One step of ``slots`` (each uploads first, through its runtime's ``load_inputs``);
        every other slot keeps its bytes. Each slot's outcome: its ``StepReport``, or the
        exception its step raised (its caller undoes it: its guard's copy is this step's).
        Asynchronous on CUDA: read each slot's outputs with its runtime's
        ``read_step_outputs``. ``eager``: the captured programs' Python."""

    def outputs_finite(self) -> Optional[np.ndarray]:
        """After ``step``: whether each slot's ``CHECKED_OUTPUTS`` are finite (bool ``[S]``),
        checked for every slot at once, waiting for the step; None where each slot's runtime
        checks its own (its session's ``GuardedStep``)."""
        return None

    @property
    @abc.abstractmethod
    def captured(self) -> bool:
        """Whether the programs run as captured CUDA graphs."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the arena, programs and host buffers; the fleet cannot step again."""


class LoopFleet(FleetRuntime):
    """``fleet.batching: loop``: each slot a plain runtime over its slot (see the module docstring)."""

    batching = "loop"

    def step(self, slots: Sequence[int], eager: bool = False) -> Dict[int, StepOutcome]:
        outcomes: Dict[int, StepOutcome] = {}
        for slot in _distinct(slots):
            try:
                outcomes[slot] = self.runtime(slot).step(eager=eager)
            except Exception as exc:  # noqa: BLE001 - that slot's outcome: the others step on
                outcomes[slot] = exc
        return outcomes

    @property
    def captured(self) -> bool:
        return any(runtime.graphs.captured for runtime in self.runtimes)

    def close(self) -> None:
        for runtime in self.runtimes:
            runtime.close()
        self.runtimes = ()


@dataclass
class FleetHost:
    """A batched fleet's buffers beside the arena. Every slot's input staging and outputs
    on the host (pinned on CUDA), each slot's row starting at a multiple of ``ALIGNMENT``
    (its buffers of every dtype are viewed in place; a slot's runtime gets its row), and
    their device twins (the host buffers themselves on a CPU): host and device buffers are
    whole contiguous allocations, so that the outputs go out with one memory copy, which a
    CUDA graph captures (a copy between a strided host view and the device would go through
    a temporary host buffer that a graph cannot keep), and the staged inputs of consecutive
    slots go up with one copy and into their arena rows with one more (``upload``, before
    the step's programs: only the rows of the slots whose step reads them, so a step that
    reads no inputs, a chunking fleet's consume, moves no camera frame and runs no copy).
    ``keep``: the copy of every slot's state the programs take first (the merge's source,
    each slot's guard copy)."""

    staging: torch.Tensor          # [S, input row] host (whole)
    staging_device: torch.Tensor   # [S, input row] device
    outputs: torch.Tensor          # [S, output row] host (whole)
    outputs_device: torch.Tensor   # [S, output row] device
    input_bytes: int               # of a row, the rest is padding
    output_bytes: int
    keep: torch.Tensor             # [S, state + output bytes] device
    kept: int = 0                  # programs run eagerly that took their copy (a failed one puts it back)

    @classmethod
    def of(cls, arena: FleetArena) -> FleetHost:
        cuda = arena.device.type == "cuda"
        inputs, outputs = arena.rows_of(BufferKind.INPUT), arena.rows_of(BufferKind.META, BufferKind.OUTPUT)
        staging, outputs_host = _rows(inputs, torch.device("cpu"), cuda), _rows(outputs, torch.device("cpu"), cuda)
        return cls(staging, _rows(inputs, arena.device, False) if cuda else staging,
                   outputs_host, _rows(outputs, arena.device, False) if cuda else outputs_host,
                   inputs.shape[1], outputs.shape[1], torch.zeros_like(arena.rows_of(*STATE_KINDS, BufferKind.OUTPUT)))

    def upload(self, slots: Iterable[int], inputs: torch.Tensor, stream: Optional[torch.cuda.Stream]) -> None:
        """The staged rows of ``slots`` into their rows of ``inputs`` (the arena's ``[S,
        input bytes]``), on ``stream``: per run of consecutive slots, one copy onto the
        device (non-blocking, from whole pinned rows; none on a CPU, where staging is one
        buffer) and one into the arena's strided rows. Eager, before the step's programs,
        so a step whose slots upload nothing (a chunking fleet's consume) copies nothing: a
        masked merge inside the captured programs would pass over every slot's inputs in
        every step (docs/benchmarks.md, "Fleet", GPU)."""
        with on_stream(stream):
            for start, end in _runs(sorted(slots)):
                if self.staging_device is not self.staging:
                    self.staging_device[start:end].copy_(self.staging[start:end], non_blocking=True)
                inputs[start:end].copy_(self.staging_device[start:end, :self.input_bytes])

    def float_views(self, slot_outputs: Mapping[str, np.ndarray], names: Sequence[str]) -> Tuple[np.ndarray, ...]:
        """``[S, n]`` views of every slot's host outputs ``names``, from slot 0's own views
        (``slot_outputs``, ``HostTransfer.outputs``: each at the same offset in every row)."""
        base = self.outputs[0].data_ptr()
        out = []
        for name in names:
            one = slot_outputs[name]
            start = one.__array_interface__["data"][0] - base
            rows = self.outputs[:, start:start + one.nbytes].numpy()
            out.append(rows.view(one.dtype))
        return tuple(out)

    def staging_row(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s input staging (host), without the padding."""
        return self.staging[slot, :self.input_bytes]

    def outputs_row(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s meta + outputs on the host, without the padding."""
        return self.outputs[slot, :self.output_bytes]

    def owned(self) -> Dict[str, torch.Tensor]:
        return {"fleet staging (host)": self.staging, "fleet staging (device)": self.staging_device,
                "fleet outputs (host)": self.outputs, "fleet outputs (device)": self.outputs_device,
                "fleet state copy": self.keep}


def _rows(like: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    """uint8 ``[S, row]`` on ``device``, one allocation: ``like``'s ``[S, n]`` with each row
    padded to a multiple of ``ALIGNMENT``."""
    slots, nbytes = like.shape
    row = -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
    return torch.zeros(slots, row, dtype=torch.uint8, device=device, pin_memory=pinned)


def compose_fleet_programs(programs: Mapping[str, FleetProgram], arena: FleetArena, host: FleetHost,
                           masks: SlotMasks) -> Dict[str, Program]:
    """Each fleet program as one graph. One that opens a step first keeps every slot's
    state and brings the masks in (the uploading slots' inputs are in the arena already:
    ``FleetHost.upload``); one that closes it then merges back the state of every slot
    that is not ``ready`` (byte for byte, from the copy) and copies every slot's meta +
    outputs to the host. A program that does neither runs as it is, between two that do."""
    state = arena.rows_of(*STATE_KINDS, BufferKind.OUTPUT)
    outputs = arena.rows_of(BufferKind.META, BufferKind.OUTPUT)
    ready = masks.column(READY)
    outputs_out = host.outputs_device[:, :host.output_bytes]

    def wrapped(program: FleetProgram) -> Program:
        def run() -> None:
            if program.opens:
                host.keep.copy_(state)
                host.kept += 1             # Python: counts eager runs only (a graph replay runs none of it)
                masks.upload()
            program.run()
            if program.closes:
                keep_where(ready, state, host.keep)
                outputs_out.copy_(outputs)
                if host.outputs is not host.outputs_device:
                    host.outputs.copy_(host.outputs_device, non_blocking=True)
        return run
    return {name: wrapped(program) for name, program in programs.items()}


class BatchedFleet(FleetRuntime):
    """``fleet.batching: vmap``: every program over all S slots at once (see the module docstring)."""

    batching = "vmap"

    def __init__(self, *, arena: FleetArena, identity: RuntimeIdentity, mode: ModeSetup,
                 stream: Optional[torch.cuda.Stream], fleet_mode: FleetMode, masks: SlotMasks, host: FleetHost,
                 graphs: ProgramGraphs):
        super().__init__(arena=arena, identity=identity, mode=mode, stream=stream)
        self.fleet_mode = fleet_mode
        self.masks = masks
        self.host = host
        self.graphs = graphs
        self._inputs = arena.rows_of(BufferKind.INPUT)          # every slot's inputs: the uploads' target
        self._uploads: Set[int] = set()
        self._launched: Optional[torch.cuda.Event] = None
        self._float_outputs: Optional[Tuple[np.ndarray, ...]] = None      # made at the first check

    @property
    def captured(self) -> bool:
        return self.graphs.captured

    def upload_next(self, slot: int) -> None:
        """The next fleet step moves ``slot``'s staged inputs into the arena (its runtime's
        ``load_inputs``)."""
        self._uploads.add(slot)

    def step(self, slots: Sequence[int], eager: bool = False) -> Dict[int, StepOutcome]:
        """See ``FleetRuntime.step``. A slot whose mode cannot choose its program (a refill
        that failed) is left out of the step with that error; when the fleet program itself
        raises, every slot's state is put back from the copy the program kept first, and
        each stepping slot's outcome is the error."""
        outcomes: Dict[int, StepOutcome] = {}
        chosen: Dict[int, str] = {}
        for slot in _distinct(slots):
            try:
                chosen[slot] = self.runtime(slot).mode.before_step()
            except Exception as exc:  # noqa: BLE001 - that slot's outcome: the others step on
                outcomes[slot] = exc
        if not chosen:
            return outcomes
        try:
            self.launch(chosen, eager)
        except Exception as exc:  # noqa: BLE001 - every stepping slot's outcome (each undoes its step)
            return {**outcomes, **dict.fromkeys(chosen, exc)}
        outcomes.update((slot, _slot(self.runtime(slot)).stepped(program, eager)) for slot, program in chosen.items())
        self.fleet_mode.after_fleet_step(chosen, eager)
        return outcomes

    def outputs_finite(self) -> np.ndarray:
        """See ``FleetRuntime.outputs_finite``: over the host rows every slot's outputs come
        back in (one check for all robots, where a check per robot cost each robot about as
        much as the rest of its output handling)."""
        self.wait_for_step()
        if self._float_outputs is None:
            self._float_outputs = self.host.float_views(self.runtimes[0].transfer.outputs, CHECKED_OUTPUTS)
        finite = np.ones(self.slots, dtype=bool)
        for view in self._float_outputs:
            finite &= np.isfinite(view).all(axis=1)
        return finite

    def wait_for_step(self) -> None:
        """Block until the last launched step is done. Once per step: its robots read their
        outputs one after the other, and only the first has anything to wait for (a stream
        synchronisation per robot cost 16 of them per tick for 16 robots, docs/benchmarks.md,
        "Fleet", GPU)."""
        if self._launched is not None:
            self._launched.synchronize()
            self._launched = None

    def launch(self, chosen: Mapping[int, str], eager: bool = False) -> None:
        """Run the fleet programs for the slots in ``chosen`` (slot -> its mode's program),
        in the order the fleet mode gives: the masks written on the host once the previous
        step no longer reads them, the uploading slots' staged rows sent up first. When a
        program raises after the step's copy of the state (eagerly run Python), every slot
        gets its state back from that copy before the error goes on: a slot that did not
        step keeps its bytes even then."""
        self.wait_for_step()
        self.masks.set(READY, chosen)
        uploads = self._uploads & set(chosen)
        self._uploads.clear()
        kept = self.host.kept
        try:
            sequence = self.fleet_mode.program_for(chosen)
            self.host.upload(uploads, self._inputs, self.stream)
            for program in sequence:
                self.graphs.step(program, eager=eager)
        except BaseException:
            if self.host.kept != kept:
                with on_stream(self.stream):
                    self.arena.rows_of(*STATE_KINDS, BufferKind.OUTPUT).copy_(self.host.keep)
            raise
        if self.stream is not None:
            self._launched = torch.cuda.Event()
            self._launched.record(self.stream)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.fleet_mode.close()
        self.graphs.close()
        self.runtimes = ()


class SlotRuntime(PolicyRuntime):
    """One robot's runtime in a ``BatchedFleet``: a ``PolicyRuntime`` over its slot, whose
    steps are its fleet's (its inputs go in with the fleet step, its outputs come from the
    fleet's host rows, its undo puts its slot back from the fleet's copy). Its replicas are
    slots of fleets of the same shape (``make_replica``), so a rebuild computes the same bits."""

    def __init__(self, fleet: BatchedFleet, slot: int, owns_fleet: bool = False, **parts):
        super().__init__(**parts)
        self.fleet = fleet
        self.slot = slot
        self.owns_fleet = owns_fleet             # a replica's slot: closing it closes its fleet

    def load_inputs(self, row: Optional[torch.Tensor] = None) -> bool:
        """The slot's staging (or ``row``, the same bytes from elsewhere) goes into its inputs
        with the next fleet step: False (nothing moves) when its next step reads none. As a
        single runtime's, a step whose network runs first lets the policy prepare its inputs
        on the host (``StatefulPolicy.prepare_inputs``); a ``row`` already holds them."""
        if not self.mode.reads_inputs():
            return False
        if row is not None:
            self.transfer.input_staging.copy_(row)
        elif self.mode.plans():
            self.policy.prepare_inputs(self.transfer.staging, self.texts)
        self.fleet.upload_next(self.slot)
        return True

    def step(self, *, eager: bool = False) -> StepReport:
        """A fleet step of this slot alone (the other slots keep their bytes); raises what
        its step raised."""
        outcome = self.fleet.step([self.slot], eager)[self.slot]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def wait_for_step(self) -> None:
        """The fleet step's end, waited for once whichever of its robots reads first."""
        self.fleet.wait_for_step()

    def stepped(self, program: str, eager: bool) -> StepReport:
        """The fleet stepped this slot with ``program``: its outputs are on the host rows."""
        self._outputs_in_host = True
        return self.mode.after_step(program, eager)

    def close(self) -> None:
        """Nothing of its own to release (the fleet owns the memory), unless it is a
        replica's slot, whose fleet goes with it."""
        if self.owns_fleet:
            self.fleet.close()


class SlotGraphs:
    """A slot's share of its fleet's programs (``StepPrograms``): a step is a fleet step of
    the slot alone; a prefill runs eagerly over the slot's views (an initial state is
    written once, eagerly, like ``init_state``)."""

    def __init__(self, fleet: BatchedFleet, slot: int):
        self._fleet = fleet
        self._slot = slot

    @property
    def captured(self) -> bool:
        return self._fleet.captured

    def step(self, program: str = STEP_PROGRAM, eager: bool = False) -> None:
        self._fleet.launch({self._slot: program}, eager)

    def prefill(self, tokens: torch.Tensor) -> None:
        runtime = self._fleet.runtime(self._slot)
        with torch.inference_mode(), on_stream(self._fleet.stream):
            runtime.policy.prefill(runtime.arena.views, tokens.to(device=self._fleet.device, dtype=torch.int64))

    def close(self) -> None:
        pass


def _slot(runtime: PolicyRuntime) -> SlotRuntime:
    assert isinstance(runtime, SlotRuntime)
    return runtime


def _runs(slots: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted ``slots`` as ``[start, end)`` runs of consecutive slots."""
    runs: List[Tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs


def _distinct(slots: Sequence[int]) -> Tuple[int, ...]:
    """``slots`` in order, each once; InvalidArgument for a repeated one."""
    out = tuple(dict.fromkeys(slots))
    if len(out) != len(slots):
        raise InvalidArgument(f"slots {list(slots)}: each slot steps at most once per fleet step")
    return out
