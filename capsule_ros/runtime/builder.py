"""Building a PolicyRuntime, in named phases, in the order they depend on each other.

``build_policy_runtime`` reads as the list of phases; each returns what the next needs,
and the runtime's constructor only keeps what they made:

1. ``place_policy``: the process-wide torch settings the determinism contract needs, the
   policy on its device, frozen, with its compiled kernels where enabled;
2. the arena: every buffer of the policy's state spec in one allocation, and beside it
   the scratch buffers the execution mode asks for (``ModeSetup.scratch``);
3. the mode bound to that arena (``ModeSetup.bind``; ``EVERY_STEP`` by default);
4. the host side of a step (``HostTransfer``) and the step guard's copy (``StepGuard``);
5. ``compose_programs``: the mode's programs, each with the guard's copy first and, on a
   GPU, the outputs' copy to the host last, inside its graph;
6. the identity (``runtime_identity``), unless the caller brings it;
7. the initial state of episode 0, then the programs warmed up (and captured on a GPU),
   then the mode's own preparation (a refill worker's capture);
8. the start-up state check (``capsule_ros.runtime.contract``), unless switched off.

The mode is settled before the build: whoever builds passes it in (the serving factory
resolves the chunk schedule, measuring an ``auto`` delay, before it calls this).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch

from capsule_ros.runtime.arena import ArenaLayout, StateArena
from capsule_ros.runtime.contract import check_state_contract
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig, StepGuard, configure_torch
from capsule_ros.runtime.fingerprint import RuntimeIdentity, weights_digest
from capsule_ros.runtime.graphs import ProgramGraphs
from capsule_ros.runtime.mode import EVERY_STEP, ModeContext, ModeSetup, Program
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.runtime.streams import StreamKeeper
from capsule_ros.runtime.transfer import HostTransfer

# The runtime's own logger: its start-up line ("runtime on ...") reads as the runtime's, as it
# always did (/rosout shows "[runtime.engine]"), whichever module assembles it.
LOG = logging.getLogger("capsule_ros.runtime.engine")


@dataclass(frozen=True)
class Placement:
    """A policy on its device (``place_policy``), and the CPU numerics level its capsules
    record (``numerics.recorded_level``)."""

    policy: StatefulPolicy
    device: torch.device
    numerics: str


def place_policy(policy: StatefulPolicy, config: RuntimeConfig) -> Placement:
    """Phase 1: torch's process-wide settings, then the policy on ``runtime.device``, in
    eval mode without gradients, with compiled kernels where ``runtime.compile`` says so.
    Safe to repeat (the serving factory places the policy before it measures a refill)."""
    device = config.resolve_device()
    level = configure_torch(config, device)
    policy = policy.to(device).eval()
    for p in policy.parameters():
        p.requires_grad_(False)
    if config.compile_enabled(device):
        policy.compile_kernels(True)
    return Placement(policy, device, level)


def runtime_identity(policy: StatefulPolicy, config: RuntimeConfig,
                     inputs: Optional[Mapping[str, object]] = None) -> RuntimeIdentity:
    """The identity a runtime of ``policy`` will have, computed without building it (no
    arena, no device memory: the node's ``configure`` knows it before ``activate``), from
    one pass over the weights."""
    return RuntimeIdentity.of(policy.architecture(), ArenaLayout(policy.state_spec()), weights_digest(policy),
                              config.kernel_kind(), dict(inputs or {}))


def compose_programs(programs: Mapping[str, Program], guard: Optional[StepGuard], transfer: HostTransfer,
                     fold_outputs: bool) -> Dict[str, Program]:
    """Phase 5: each program begins by keeping the state it may change (the step guard)
    and, with ``fold_outputs`` (a GPU), ends by copying meta + outputs to the pinned host
    buffer ``read_step_outputs`` reads: both copies inside the program's graph, two
    launches fewer per step."""
    if guard is None and not fold_outputs:
        return dict(programs)

    def wrapped(program: Program) -> Program:
        def run() -> None:
            if guard is not None:
                guard.keep()
            program()
            if fold_outputs:
                transfer.fold()
        return run
    return {name: wrapped(program) for name, program in programs.items()}


def build_policy_runtime(policy: StatefulPolicy, config: RuntimeConfig = RuntimeConfig(), *,  # noqa: B008 - frozen
                         mode: ModeSetup = EVERY_STEP, inputs: Optional[Mapping[str, object]] = None,
                         identity: Optional[RuntimeIdentity] = None, streams: Optional[StreamKeeper] = None,
                         stream_role: str = "step", policy_checked: bool = False,
                         checked_elsewhere: bool = False, arena: Optional[StateArena] = None,
                         stop_check: Optional[threading.Event] = None) -> PolicyRuntime:
    """A runtime of ``policy`` run in ``mode`` (see the module docstring for the phases).

    ``inputs``: input buffer name -> what fills it (part of the fingerprint; the node
    passes each port's binding). ``identity``: the fingerprint and parts, when the caller
    computed them already (``runtime_identity``). ``streams``: where the CUDA streams come
    from (``StreamKeeper``; ``stream_role`` names the step's). Raises PolicyStepError (a
    ConfigError) when the policy's step cannot run on its declared inputs or cannot be
    captured, and PolicyStateError when it keeps state outside its buffers
    (``runtime.state_check``; skipped with ``policy_checked``, for a replica whose policy
    passed it with the original). ``checked_elsewhere``: the state check runs on another
    runtime of a copy of the policy (``capsule_ros.serving.statecheck``), which also runs
    each program first: this one runs neither. ``arena``: the arena to build in, with the
    mode's scratch (a slot of a fleet's arena, ``capsule_ros.runtime.slots``); default a new
    one. ``stop_check``: set, it stops the state check before its next step
    (StateCheckStopped; the check beside serving, when its session closes)."""
    placed = place_policy(policy, config)
    streams = streams or StreamKeeper()
    stream = streams.get(placed.device, stream_role)
    if arena is None:
        arena = StateArena(ArenaLayout(placed.policy.state_spec()), placed.device,
                           scratch=mode.scratch(placed.policy))
    bound = mode.bind(ModeContext(placed.policy, arena, stream, streams, config.cuda_graphs))
    transfer = HostTransfer(arena, pinned=placed.device.type == "cuda")
    guard = StepGuard(arena) if config.guard_steps else None
    fold_outputs = placed.device.type == "cuda" and config.cuda_graphs and placed.policy.torch_graph_capture
    owned: Dict[str, torch.Tensor] = {"outputs on the host": transfer.output_host}
    if guard is not None:
        owned["step guard copy"] = guard.copy
    graphs = ProgramGraphs(placed.policy, arena, compose_programs(bound.programs(), guard, transfer, fold_outputs),
                           use_graphs=config.cuda_graphs, stream=stream, debug_checks=config.debug_checks,
                           eager_fallback=config.graph_fallback == "eager", owned=owned)
    runtime = PolicyRuntime(config=config, device=placed.device, numerics_level=placed.numerics,
                            policy=placed.policy, arena=arena, mode=bound, graphs=graphs, transfer=transfer,
                            guard=guard, fold_outputs=fold_outputs,
                            identity=identity or runtime_identity(placed.policy, config, inputs),
                            inputs=dict(inputs or {}), stream=stream, streams=streams)
    runtime.reset(episode=0)
    checks_state = config.runs_state_check and not (policy_checked or checked_elsewhere)
    graphs.prepare(check_runs=not (checks_state or checked_elsewhere))   # the state check runs every program
    bound.prepare()
    if checks_state:
        try:
            check_state_contract(runtime, stop=stop_check)
        except BaseException:
            runtime.close()         # its mode's worker and its graphs: a refused runtime leaves nothing running
            raise
    LOG.info("runtime on %s: arena %d bytes in %d buffers, graphs=%s, fingerprint %s",
             runtime.device, runtime.layout.nbytes, len(runtime.layout), graphs.captured, runtime.fingerprint[:12])
    return runtime


def replica_of(runtime: PolicyRuntime, role: str = "replica") -> PolicyRuntime:
    """A second live runtime over the same weights with its own arena and graphs (and, on
    CUDA, the stream of ``role``), in the replica form of its mode (a chunking mode plans
    inline: a replica replays, it does not race).

    Both share the fingerprint, so capsules move freely between them; they never share
    state, so the two branches cannot affect each other. A runtime that says how its
    replicas are made (``PolicyRuntime.make_replica``: a fleet slot) gets one made so.
    """
    if runtime.make_replica is not None:
        return runtime.make_replica(role)
    return build_policy_runtime(runtime.policy, runtime.config, mode=runtime.mode.setup.for_replica(),
                                inputs=runtime.inputs, identity=runtime.identity, streams=runtime.streams,
                                stream_role=role, policy_checked=True)


__all__ = ["Placement", "build_policy_runtime", "compose_programs", "place_policy", "replica_of", "runtime_identity"]
