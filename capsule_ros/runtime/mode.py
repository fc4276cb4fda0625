"""Execution modes: which program each step of a runtime runs, and the host-side state
that goes with that choice.

The runtime core (``PolicyRuntime``) runs one named program per step over its arena: a
captured CUDA graph on a GPU, the same Python eagerly on a CPU (``ProgramGraphs``). Which
programs there are, and which one a step runs, is its execution mode's business. The
default mode runs the policy's ``step`` at every step (``EVERY_STEP``). A mode above the
core implements the same protocol in a package of its own (``capsule_ros.chunking`` runs a
chunking policy's network only when a chunk is due); whoever builds a runtime passes its
mode in (``capsule_ros.runtime.builder``), and the core imports none.

A mode comes in two parts: a ``ModeSetup``, a frozen value settled before the runtime is
built (for chunking: the schedule, an ``auto`` delay already measured), and the
``ExecutionMode`` it binds to one runtime's arena. The runtime calls the bound mode here:

=================== ============================================ ==========================
member              when                                          every step (the default)
=================== ============================================ ==========================
programs()          at build: name -> a capturable call           ``step``: policy.step
prepare()           at build, after the programs are captured     nothing
reset()             a new episode, after ``init_state``            nothing
reads_inputs()      before a step's upload                         True
before_step()       before a step: the program it runs             ``step``
after_step()        after it: a ``StepReport``                     ``step``, not late
undo()              the step guard put the state back              nothing
mark()              a snapshot: the mark its capsule carries       None
admit()             before a restore touches the live state        any mark
after_restore()     after a restore (its caller says so)           nothing
resync()            the arena's bytes were replaced wholesale      nothing
rehearse()          the start-up state check                       2 steps, from where it is
warm_up_position()  the node's warm-up (it puts the arena back)    from where it is
check_outputs()     each read of the outputs (debug checks)        nothing
close()             the runtime is closed                          nothing
=================== ============================================ ==========================

A mark (``capsule_ros.runtime.marks.ModeMark``) is opaque to everything but its mode: the
capsule store keeps it with a capsule and the file format writes it, neither reads it. A
restore starts no work by itself: the store copies a capsule's bytes once ``admit`` let
them in, and its caller then calls ``PolicyRuntime.after_restore`` with the capsule's mark.

Threads: the core owns none; a mode may (the chunking mode's refill worker on a CPU), and
then owns it until ``close``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence

import numpy as np
import torch

from capsule_ros.runtime.arena import BufferSpec, StateArena
from capsule_ros.runtime.marks import ModeMark
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.runtime.schema import BufferKind
from capsule_ros.runtime.streams import StreamKeeper

STEP_PROGRAM = "step"
REHEARSED_STEPS = 2       # steps the state check repeats from a snapshot, for a mode with one program

Program = Callable[[], None]
MarkBytes = Callable[[], torch.Tensor]    # a capsule's bytes, read only when asked (reading may wait for them)


class StepReport(NamedTuple):
    """What a step ran: the program, and whether it waited for work its mode had started
    off the control loop that was not done by then (a chunking mode's late refill: a
    deadline event, its state exact all the same). A named tuple: one is made per step."""

    program: str = STEP_PROGRAM
    late: bool = False


@dataclass(frozen=True)
class ModeContext:
    """What a mode is bound to: the runtime's policy and arena (with the scratch buffers
    the setup asked for), the stream its steps run on (None on a CPU), where other streams
    come from, and whether programs are captured as CUDA graphs (``runtime.cuda_graphs``)."""

    policy: StatefulPolicy
    arena: StateArena
    stream: Optional[torch.cuda.Stream]
    streams: StreamKeeper
    use_graphs: bool


class ExecutionMode:
    """A mode bound to one runtime (see the module docstring); this base class is the
    every-step mode. Not thread-safe: the runtime's caller serialises."""

    def __init__(self, setup: ModeSetup, context: ModeContext):
        self.setup = setup
        self.context = context

    def programs(self) -> Dict[str, Program]:
        policy, views = self.context.policy, self.context.arena.views
        return {STEP_PROGRAM: lambda: policy.step(views)}

    def prepare(self) -> None:
        """Once, after the runtime's programs are captured (and before any step)."""

    def reset(self) -> None:
        """A new episode: ``init_state`` has just run (on the runtime's stream)."""

    def plans(self) -> bool:
        """Whether the next step runs the policy's network (every step does in this mode)."""
        return True

    def reads_inputs(self) -> bool:
        """Whether the next step reads the input buffers (else they need no upload)."""
        return True

    def before_step(self) -> str:
        """The program the next step runs."""
        return STEP_PROGRAM

    def after_step(self, program: str, eager: bool = False) -> StepReport:
        """``program`` ran (``eager``: as the Python its graph was captured from)."""
        return StepReport(program)

    def undo(self) -> None:
        """The step guard put the arena back as it was before the last step."""

    def mark(self) -> Optional[ModeMark]:
        """The mark a capsule of the live state carries (None: nothing to carry)."""
        return None

    def admit(self, mark: Optional[ModeMark], data: MarkBytes, capsule_id: str) -> None:
        """Refuse, before anything changes, a capsule whose mark (and bytes ``data()``)
        this runtime cannot take: FingerprintMismatch or CorruptCapsule."""

    def after_restore(self, mark: Optional[ModeMark], kinds: Sequence[BufferKind] = ()) -> None:
        """The arena now holds a capsule's bytes (of ``kinds`` only, when given) with
        ``mark``: take up its host-side state and any work it had pending."""

    def resync(self) -> None:
        """The arena's bytes were replaced by bytes without a mark (``load_state``): read
        the host-side state back from them (may wait for the device)."""

    def rehearse(self) -> int:
        """For the state check: put the arena and the host-side state where steps run
        every program of the mode; the number of steps that takes."""
        return REHEARSED_STEPS

    def warm_up_position(self) -> None:
        """For the node's warm-up of its step path (``GuardedStep.rehearse``, which puts the
        arena back after): put the state where the next steps run the program most steps
        run."""

    def check_outputs(self, outputs: Mapping[str, np.ndarray]) -> None:
        """Debug checks: the host copies of a step's meta and outputs agree with the mode's
        host-side state (RuntimeError otherwise)."""

    def close(self) -> None:
        """The runtime is closing: stop what the mode runs (its threads, its streams' work)."""


class ModeSetup(Protocol):
    """A mode as it is passed to the runtime's builder (frozen; see the module docstring)."""

    def scratch(self, policy: StatefulPolicy) -> List[BufferSpec]:
        """Buffers the mode's programs read that are not state (no capsule holds them):
        allocated with the runtime's arena, so its programs read the arena's addresses
        only, and the graphs' address check covers them."""
        ...

    def bind(self, context: ModeContext) -> ExecutionMode:
        ...

    def for_replica(self) -> ModeSetup:
        """The same mode for a replica of the runtime (which replays; it does not race)."""
        ...


@dataclass(frozen=True)
class EveryStep:
    """The default mode: the policy's ``step``, at every step."""

    def scratch(self, policy: StatefulPolicy) -> List[BufferSpec]:
        return []

    def bind(self, context: ModeContext) -> ExecutionMode:
        return ExecutionMode(self, context)

    def for_replica(self) -> EveryStep:
        return self


EVERY_STEP = EveryStep()
