"""Execution modes over a batched fleet: which fleet program a step runs, given what each
slot's own mode chose.

A fleet slot keeps its own ``ExecutionMode`` (``capsule_ros.runtime.mode``) bound to its
slot of the arena: its host-side state (a chunking slot's cursor mirror), its marks, what
it admits, its reset and undo are the single robot's. What runs is the fleet's: one
program over all S slots (``programs``: batched with ``torch.func.vmap``, captured once
on a GPU), chosen for the slots that step together from the programs their modes chose
(``program_for``), which also writes the mode's per-slot masks. A slot whose program is
not the fleet program's main work (a chunking slot that consumes while another refills)
is kept from it by those masks, never by running a sub-batch: the batch shape is always S.

A fleet step may run several programs in a row (``FleetProgram``): the first one
``opens`` the step (the step guard's copy of every slot, the masks and staged inputs in),
the last one ``closes`` it (the merge of the slots that did not step, the outputs out),
and any in between do neither. The chunking mode runs its per-slot refill that way: one
robot's plan at batch 1, once per slot that plans, between the batched phases before and
after it.

The every-step fleet mode is ``FleetMode`` itself: every slot runs the policy's ``step``.
A mode above the core gives a fleet form by implementing ``FleetModeSetup``
(``capsule_ros.chunking.fleet`` for chunking policies); ``fleet_setup`` finds it (a mode
without one is served by the loop batching).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import BufferSpec
from capsule_ros.runtime.batching import SlotMasks, vmapped
from capsule_ros.runtime.mode import STEP_PROGRAM, EveryStep, ExecutionMode, ModeContext, ModeSetup, Program
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.runtime.slots import FleetArena
from capsule_ros.runtime.streams import StreamKeeper


@dataclass(frozen=True)
class FleetProgram:
    """A capturable call of a fleet mode and its place in a fleet step (see the module
    docstring): ``opens`` the step, ``closes`` it, or (neither) runs between two others."""

    run: Program
    opens: bool = True
    closes: bool = True


@dataclass(frozen=True)
class FleetContext:
    """What a fleet mode is bound to: the policy, the fleet's arena (scratch included), the
    slot masks (the mode's own among them), the stream the fleet steps on (None on a CPU),
    where other streams come from, and whether programs are captured as CUDA graphs."""

    policy: StatefulPolicy
    arena: FleetArena
    masks: SlotMasks
    stream: Optional[torch.cuda.Stream]
    streams: StreamKeeper
    use_graphs: bool

    def slot_context(self, index: int) -> ModeContext:
        """The single-robot context of slot ``index`` (its slot mode's)."""
        return ModeContext(self.policy, self.arena.slot(index), self.stream, self.streams, self.use_graphs)


class FleetMode:
    """A mode bound to a batched fleet (see the module docstring); this base class is the
    every-step mode. Not thread-safe: the fleet's caller serialises."""

    def __init__(self, setup: FleetModeSetup, context: FleetContext, slot_modes: Sequence[ExecutionMode]):
        self.setup = setup
        self.context = context
        self.slot_modes: Tuple[ExecutionMode, ...] = tuple(slot_modes)

    def programs(self) -> Dict[str, FleetProgram]:
        """name -> a capturable call over the fleet (a batched one runs over every slot)."""
        return {STEP_PROGRAM: FleetProgram(vmapped(self.context.policy.step, self.context.arena.views))}

    def program_for(self, chosen: Mapping[int, str]) -> Tuple[str, ...]:
        """The fleet programs a step of the slots in ``chosen`` (slot -> the program its own
        mode chose) runs, in order (the first opens the step, the last closes it), with the
        mode's masks written for them."""
        return (STEP_PROGRAM,)

    def owned(self) -> Dict[str, torch.Tensor]:
        """The mode's own device buffers its programs touch besides the arena (the graphs'
        address check): none here."""
        return {}

    def after_fleet_step(self, chosen: Mapping[int, str], eager: bool = False) -> None:
        """After the fleet program ran and every stepped slot's mode took its step: work
        the fleet mode starts for them together (a batched refill)."""

    def prepare(self) -> None:
        """Once, after the fleet's programs are captured."""

    def close(self) -> None:
        """The fleet is closing: stop what the mode runs."""


@runtime_checkable
class FleetModeSetup(Protocol):
    """A mode's fleet form, as the fleet's builder takes it (frozen)."""

    def scratch(self, policy: StatefulPolicy) -> List[BufferSpec]:
        """The single-robot scratch of each slot (laid out slot-major)."""
        ...

    def fleet_masks(self) -> Tuple[str, ...]:
        """The mode's own per-slot mask names (beside ``batching.CORE_MASKS``)."""
        ...

    def bind_fleet(self, context: FleetContext) -> FleetMode:
        ...


@dataclass(frozen=True)
class EveryStepFleet:
    """The every-step mode of a batched fleet."""

    def scratch(self, policy: StatefulPolicy) -> List[BufferSpec]:
        return []

    def fleet_masks(self) -> Tuple[str, ...]:
        return ()

    def bind_fleet(self, context: FleetContext) -> FleetMode:
        slots = [ExecutionMode(EveryStep(), context.slot_context(i)) for i in range(context.arena.slots)]
        return FleetMode(self, context, slots)


def fleet_setup(setup: ModeSetup) -> FleetModeSetup:
    """The fleet form of a mode: the every-step mode's, or the mode's own; ConfigError for
    a mode that has none."""
    if isinstance(setup, EveryStep):
        return EveryStepFleet()
    if isinstance(setup, FleetModeSetup):
        return setup
    raise ConfigError(f"the execution mode {type(setup).__name__} has no batched fleet form; set fleet.batching: "
                      "loop (each slot runs the single-robot programs)")
