"""The start-up check that a policy keeps its whole state in its declared buffers.

A capsule restores the arena and nothing else. A policy that carries anything from one
step to the next outside its buffers (a Python counter, a tensor attribute it updates,
a queue in a list) would not behave the same after a restore, and capsules would
silently lie. ``check_state_contract`` finds such a policy at start-up, through the
programs the node will run (the CUDA graphs on a GPU): from the initial state, with seeded
random inputs, it runs one step, snapshots the arena, runs two more steps, restores the
snapshot and runs the same two steps again; the outputs after each step and the whole
arena at the end must be the same bits both times. A captured graph replays what
capture froze (a Python counter is a constant there), so with a graph the repeated steps
are run a third time eagerly, through the same Python the graph was captured from, and
must match. The repeated steps run every program of the runtime's execution mode, each
checked the same way: the mode puts the state where they do (``ExecutionMode.rehearse``;
the chunking mode's rehearsal is in ``capsule_ros.chunking.mode``). Then the arena gets
back its bytes from before the check, so the live state is untouched. The runtime's
builder runs the check (``capsule_ros.runtime.builder``). A check running beside serving
(``capsule_ros.serving.statecheck``) can be stopped between two of its steps (``stop``): its
owner is closing, and a node's Ctrl-C should not wait for seconds of plans nobody needs.

Cost: five steps (seven with a graph; a chunking policy repeats two in sync mode, the
execution horizon plus the delay plus one in async mode; the step before the snapshot
starts where they do, so a sync chunking policy plans twice) and three copies of the
arena, once per start (``runtime.state_check``;
docs/benchmarks.md, "Start-up state check"). What it cannot see: hidden state
that changes nothing within two steps (a counter acting every hundred steps), and
randomness outside the arena that happens to repeat. It runs only with
``runtime.deterministic`` on: without it bit-identity is not promised.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import BufferKind
from capsule_ros.runtime.graphs import PolicyStepError, step_failure
from capsule_ros.runtime.mode import STEP_PROGRAM

if TYPE_CHECKING:
    from capsule_ros.runtime.engine import PolicyRuntime

LOG = logging.getLogger(__name__)

BEFORE_SNAPSHOT = 1    # steps from the initial state before the snapshot (the state is then not the initial one)


class PolicyStateError(ConfigError):
    """The policy keeps state outside its declared buffers (found at start-up)."""


class StateCheckStopped(Exception):
    """The check was stopped (its ``stop`` event set) before its verdict."""


def _random_inputs(runtime: PolicyRuntime, steps: int, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """Seeded inputs for each step, on the runtime's device: normals for floating-point
    buffers, any byte for uint8 (images), 0 or 1 for other integers (indices stay valid)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(steps):
        row = {}
        for slot in runtime.layout:
            spec = slot.spec
            if spec.kind != BufferKind.INPUT:
                continue
            if spec.dtype.is_floating_point:
                value = torch.randn(spec.shape, generator=generator).to(spec.dtype)
            else:
                value = torch.randint(0, 256 if spec.dtype == torch.uint8 else 2, spec.shape, generator=generator,
                                      dtype=spec.dtype)
            row[spec.name] = value.to(runtime.device)
        rows.append(row)
    return rows


def _policy_name(runtime: PolicyRuntime) -> str:
    name = runtime.policy.architecture().get("policy")
    return str(name) if name else type(runtime.policy).__name__


def _differing(runtime: PolicyRuntime, now: torch.Tensor, before: torch.Tensor, start: int, *kinds: BufferKind):
    """Names of the buffers (of these kinds) whose bytes differ between two copies of the
    arena range that begins at byte ``start``."""
    return [slot.spec.name for slot in runtime.layout if not kinds or slot.spec.kind in kinds
            if not torch.equal(now[slot.offset - start:slot.end - start], before[slot.offset - start:slot.end - start])]


def check_state_contract(runtime: PolicyRuntime, stop: Optional[threading.Event] = None) -> List[str]:
    """Raise PolicyStateError when steps repeated from a snapshot differ (see the module
    docstring); the arena keeps its bytes either way. Returns the programs the repeated
    steps ran, in order (``step`` in the every-step mode). ``stop`` set: StateCheckStopped
    before the next step."""
    arena, graphs = runtime.arena, runtime.graphs
    outputs = arena.region(BufferKind.META, BufferKind.OUTPUT)
    outputs_start = runtime.layout.byte_range(BufferKind.META, BufferKind.OUTPUT)[0]
    stream = torch.cuda.stream(runtime.stream) if runtime.stream is not None else contextlib.nullcontext()
    started = time.perf_counter()
    differs: List[str] = []
    programs: List[str] = []
    with stream:
        saved = arena.storage.clone()
        try:
            try:
                # the step before the snapshot starts where the repeated ones do: for a sync
                # chunking policy a consume, not one more plan
                runtime.mode.rehearse()
                rows = _random_inputs(runtime, BEFORE_SNAPSHOT)
                for row in rows:
                    _run(runtime, row, outputs, stop=stop)
                repeated = runtime.mode.rehearse()
                rows = _random_inputs(runtime, repeated, seed=1)
                snapshot = arena.storage.clone()
                first = [_run(runtime, row, outputs, programs=programs, stop=stop) for row in rows]
                end = arena.storage.clone()
                passes = [("", False)] + ([(" run eagerly, against the captured graph (capture froze what the step "
                                            "keeps outside its buffers)", True)] if graphs.captured else [])
                buffers: List[str] = []
                for what, eager in passes:
                    runtime.load_state(snapshot)
                    for i, row in enumerate(rows):
                        again = _run(runtime, row, outputs, eager=eager, stop=stop)
                        if not torch.equal(again, first[i]):
                            names = _differing(runtime, again, first[i], outputs_start, BufferKind.META,
                                               BufferKind.OUTPUT)
                            differs.append(f"{names} after repeated step {i + 1}{what}")
                            break
                    if differs:
                        break
                    buffers = _differing(runtime, arena.storage, end, 0)
                    if buffers:
                        break
            except (PolicyStepError, StateCheckStopped):
                raise
            except Exception as exc:
                raise step_failure(runtime.layout, STEP_PROGRAM, exc, " during the start-up state check (seeded "
                                   "random inputs; runtime.state_check: false skips it)") from exc
            if buffers:
                differs.append(f"{buffers} at the end")
        finally:
            runtime.load_state(saved)
    LOG.info("state check: %d steps (repeated: %s) in %.1f ms", BEFORE_SNAPSHOT + (len(passes) + 1) * repeated,
             ", ".join(programs), (time.perf_counter() - started) * 1e3)
    if differs:
        raise PolicyStateError(
            f"policy {_policy_name(runtime)} keeps state outside its declared buffers: restored to a snapshot taken "
            f"after step {BEFORE_SNAPSHOT} and given the same inputs, its next {repeated} steps wrote other values to "
            f"{' and '.join(differs)}; everything a step carries to the next (queues, histories, counters, "
            "RNG state) must live in its state_spec() buffers (docs/bring-your-own-policy.md), or set "
            "runtime.state_check: false to serve it anyway (capsules will not restore that state)")
    return programs


def _run(runtime: PolicyRuntime, row: Dict[str, torch.Tensor], outputs: torch.Tensor,
         eager: bool = False, programs: Optional[List[str]] = None,
         stop: Optional[threading.Event] = None) -> torch.Tensor:
    """One step on ``row`` (written straight into the arena's inputs) through the runtime's
    mode; a copy of ``outputs`` (meta + outputs) after it. ``programs`` collects which
    program the step ran; StateCheckStopped instead of the step once ``stop`` is set."""
    if stop is not None and stop.is_set():
        raise StateCheckStopped("the state check was stopped before its verdict")
    for name, value in row.items():
        runtime.arena[name].copy_(value)
    report = runtime.step(eager=eager)
    runtime.synchronize()
    if programs is not None:
        programs.append(report.program)
    return outputs.clone()
