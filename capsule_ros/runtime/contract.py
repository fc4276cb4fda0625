"""The start-up check that a policy keeps its whole state in its declared buffers.

A capsule restores the arena and nothing else. A policy that carries anything from one
step to the next outside its buffers (a Python counter, a tensor attribute it updates,
a queue in a list) would not behave the same after a restore, and capsules would
silently lie. ``check_state_contract`` finds such a policy at start-up, through the
plan the node will run (the CUDA graph on a GPU): from the initial state, with seeded
random inputs, it runs one step, snapshots the arena, runs two more steps, restores the
snapshot and runs the same two steps again; the outputs after each step and the whole
arena at the end must be the same bits both times. A captured graph replays what
capture froze (a Python counter is a constant there), so with a graph the first repeated
step is also run eagerly, through the policy's own ``step``, and must match. Then the arena gets back its bytes
from before the check, so the live state is untouched.

Cost: five steps and three copies of the arena, once per start (``runtime.state_check``;
docs/benchmarks.md, "Start-up state check"). What it cannot see: hidden state
that changes nothing within two steps (a counter acting every hundred steps), and
randomness outside the arena that happens to repeat. It runs only with
``runtime.deterministic`` on: without it bit-identity is not promised.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Dict, List

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import BufferKind
from capsule_ros.runtime.plan import PolicyStepError

if TYPE_CHECKING:
    from capsule_ros.runtime.engine import PolicyRuntime

LOG = logging.getLogger(__name__)

BEFORE_SNAPSHOT = 1    # steps from the initial state before the snapshot (the state is then not the initial one)
REPEATED = 2           # steps run after the snapshot, then again from it


class PolicyStateError(ConfigError):
    """The policy keeps state outside its declared buffers (found at start-up)."""


def _random_inputs(runtime: PolicyRuntime, steps: int) -> List[Dict[str, torch.Tensor]]:
    """Seeded inputs for each step, on the runtime's device: normals for floating-point
    buffers, any byte for uint8 (images), 0 or 1 for other integers (indices stay valid)."""
    generator = torch.Generator().manual_seed(0)
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


def check_state_contract(runtime: PolicyRuntime) -> None:
    """Raise PolicyStateError when steps repeated from a snapshot differ (see the module
    docstring); the arena keeps its bytes either way."""
    arena, plan = runtime.arena, runtime.plan
    rows = _random_inputs(runtime, BEFORE_SNAPSHOT + REPEATED)
    outputs = arena.region(BufferKind.META, BufferKind.OUTPUT)
    outputs_start = runtime.layout.byte_range(BufferKind.META, BufferKind.OUTPUT)[0]
    stream = torch.cuda.stream(runtime.stream) if runtime.stream is not None else contextlib.nullcontext()
    started = time.perf_counter()
    differs: List[str] = []
    with stream:
        saved = arena.storage.clone()
        try:
            def run(step: int) -> None:
                for name, value in rows[step].items():
                    arena[name].copy_(value)
                plan.step()

            try:
                for step in range(BEFORE_SNAPSHOT):
                    run(step)
                snapshot = arena.storage.clone()
                first = []
                for step in range(BEFORE_SNAPSHOT, len(rows)):
                    run(step)
                    first.append(outputs.clone())
                end = arena.storage.clone()
                arena.storage.copy_(snapshot)
                for i, step in enumerate(range(BEFORE_SNAPSHOT, len(rows))):
                    run(step)
                    if not differs and not torch.equal(outputs, first[i]):
                        names = _differing(runtime, outputs, first[i], outputs_start, BufferKind.META,
                                           BufferKind.OUTPUT)
                        differs.append(f"{names} after repeated step {i + 1}")
                buffers = _differing(runtime, arena.storage, end, 0)
                if plan.captured and not differs:
                    # a graph replays what capture froze: a Python counter looks constant there,
                    # so compare the graph's step with the policy's own (eager) step
                    arena.storage.copy_(snapshot)
                    for name, value in rows[BEFORE_SNAPSHOT].items():
                        arena[name].copy_(value)
                    with torch.inference_mode():
                        runtime.policy.step(arena.views)
                    if not torch.equal(outputs, first[0]):
                        names = _differing(runtime, outputs, first[0], outputs_start, BufferKind.META,
                                           BufferKind.OUTPUT)
                        differs.append(f"{names} after repeated step 1 run eagerly, against the captured graph "
                                       "(capture froze what the step keeps outside its buffers)")
            except PolicyStepError:
                raise
            except Exception as exc:
                raise PolicyStepError(f"the policy's step fails during the start-up state check (seeded random "
                                      f"inputs): {type(exc).__name__}: {exc}; fix the step or set "
                                      "runtime.state_check: false") from exc
            if buffers:
                differs.append(f"{buffers} at the end")
        finally:
            arena.storage.copy_(saved)
            runtime.synchronize()
    LOG.info("state check: %d steps in %.1f ms", BEFORE_SNAPSHOT + 2 * REPEATED,
             (time.perf_counter() - started) * 1e3)
    if differs:
        raise PolicyStateError(
            f"policy {_policy_name(runtime)} keeps state outside its declared buffers: restored to a snapshot taken "
            f"after step {BEFORE_SNAPSHOT} and given the same inputs, its next {REPEATED} steps wrote other values to "
            f"{' and '.join(differs)}; everything a step carries to the next (queues, histories, counters, "
            "RNG state) must live in its state_spec() buffers (docs/bring-your-own-policy.md), or set "
            "runtime.state_check: false to serve it anyway (capsules will not restore that state)")
