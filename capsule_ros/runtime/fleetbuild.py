"""Building a FleetRuntime, in the order its parts depend on each other.

``build_fleet_runtime`` resolves the batching (``resolve_batching``), then:

- ``loop``: the arena of S slots with the mode's scratch, and in each slot a runtime built
  by ``build_policy_runtime`` over that slot (its own programs, captured on a GPU), the
  identity a single runtime's; the start-up state check runs on the first slot only (the
  policy is the same).
- ``vmap``: the policy placed (uncompiled: vmap batches the eager kernels), the arena of S
  slots, the slot masks, the fleet form of the mode bound to it (``fleet_setup``), the host
  buffers, the batched programs composed (``compose_fleet_programs``), each slot's runtime
  over its slot, every slot's initial state, the programs warmed up with vmap's fallback
  off (a policy vmap cannot batch is refused here, naming the operation) and captured, the
  mode's own preparation, and the state check through slot 0.

The identity (``fleet_identity``) of a batched fleet adds S and the batching to the
policy's architecture, and for a chunking policy the batch its plans run at (1: each
refilling robot's chunk alone, ``capsule_ros.chunking.fleet``), as kernel keys
(``capsule-ros check`` names them "kernel").
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Mapping, Optional, Sequence

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import ArenaLayout, StateArena
from capsule_ros.runtime.batching import CORE_MASKS, SlotMasks, no_fallback, refuse_unbatchable
from capsule_ros.runtime.builder import build_policy_runtime, place_policy, runtime_identity
from capsule_ros.runtime.contract import check_state_contract
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig, StepGuard
from capsule_ros.runtime.fingerprint import RuntimeIdentity, weights_digest
from capsule_ros.runtime.fleet import (
    BATCHINGS,
    BatchedFleet,
    FleetHost,
    FleetRuntime,
    LoopFleet,
    SlotGraphs,
    SlotRuntime,
    compose_fleet_programs,
)
from capsule_ros.runtime.fleetmode import FleetContext, fleet_setup
from capsule_ros.runtime.graphs import ProgramGraphs
from capsule_ros.runtime.mode import EVERY_STEP, ModeSetup
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.runtime.slots import FleetArena
from capsule_ros.runtime.streams import StreamKeeper
from capsule_ros.runtime.transfer import HostTransfer

LOG = logging.getLogger("capsule_ros.runtime.fleet")


def resolve_batching(policy: StatefulPolicy, batching: str) -> str:
    """``auto``: vmap for a torch policy, loop for one whose step runs outside torch;
    ConfigError for vmap over such a policy, or an unknown name."""
    if batching not in BATCHINGS:
        raise ConfigError(f"fleet.batching = {batching!r}: must be one of {list(BATCHINGS)}")
    if batching == "auto":
        return "vmap" if policy.torch_graph_capture else "loop"
    if batching == "vmap" and not policy.torch_graph_capture:
        raise ConfigError(f"fleet.batching = vmap: {type(policy).__name__}'s step runs outside torch (ONNX Runtime's "
                          "kernels), which torch.func.vmap cannot batch; set fleet.batching: loop (each slot runs "
                          "the policy on its own, docs/fleet.md)")
    return batching


def fleet_identity(policy: StatefulPolicy, config: RuntimeConfig, inputs: Optional[Mapping[str, object]],
                   slots: int, batching: str) -> RuntimeIdentity:
    """The identity a fleet of ``policy`` will have (without building it): a single
    runtime's for the loop batching (batch-invariant), else with the slot count and the
    batching among the architecture's kernel keys."""
    batching = resolve_batching(policy, batching)
    if batching == "loop":
        return runtime_identity(policy, config, inputs)
    architecture = {**policy.architecture(), "fleet_slots": slots, "fleet_batching": batching}
    if policy.cadence() is not None:          # a chunking fleet plans each robot's chunk at batch 1
        architecture["fleet_plan_batch"] = 1
    return RuntimeIdentity.of(architecture, ArenaLayout(policy.state_spec()), weights_digest(policy),
                              config.kernel_kind(), dict(inputs or {}))


def build_fleet_runtime(policy: StatefulPolicy, config: RuntimeConfig = RuntimeConfig(), *,  # noqa: B008 - frozen
                        slots: int, batching: str = "auto", mode: ModeSetup = EVERY_STEP,
                        inputs: Optional[Mapping[str, object]] = None, identity: Optional[RuntimeIdentity] = None,
                        seeds: Optional[Sequence[int]] = None, streams: Optional[StreamKeeper] = None,
                        stream_role: str = "step", policy_checked: bool = False) -> FleetRuntime:
    """A fleet of ``slots`` slots of ``policy`` in ``mode`` (see the module docstring).
    ``seeds``: each slot's RNG seed at a reset (default ``runtime.seed`` for all): a robot's
    random stream is keyed by its own seed and step, never by its slot. The other arguments
    are ``build_policy_runtime``'s. Raises ConfigError (PolicyStepError, PolicyStateError)
    as it does, and for a policy or mode the batching cannot take."""
    batching = resolve_batching(policy, batching)
    seeds = tuple(seeds) if seeds is not None else (config.seed,) * slots
    if len(seeds) != slots:
        raise ConfigError(f"{len(seeds)} seeds for {slots} fleet slots")
    identity = identity or fleet_identity(policy, config, inputs, slots, batching)
    streams = streams or StreamKeeper()
    if batching == "loop":
        return _loop_fleet(policy, config, slots, mode, inputs, identity, seeds, streams, stream_role, policy_checked)
    return _batched_fleet(policy, config, slots, mode, inputs, identity, seeds, streams, stream_role, policy_checked)


def _loop_fleet(policy: StatefulPolicy, config: RuntimeConfig, slots: int, mode: ModeSetup,
                inputs: Optional[Mapping[str, object]], identity: RuntimeIdentity, seeds: Sequence[int],
                streams: StreamKeeper, stream_role: str, policy_checked: bool) -> FleetRuntime:
    placed = place_policy(policy, config)
    arena = FleetArena(ArenaLayout(placed.policy.state_spec()), slots, placed.device,
                       scratch=mode.scratch(placed.policy))
    fleet = LoopFleet(arena=arena, identity=identity, mode=mode, stream=streams.get(placed.device, stream_role))
    fleet.runtimes = tuple(
        build_policy_runtime(placed.policy, dataclasses.replace(config, seed=seeds[i]), mode=mode, inputs=inputs,
                             identity=identity, streams=streams, stream_role=stream_role,
                             policy_checked=policy_checked or i > 0, arena=arena.slot(i))
        for i in range(slots))
    _log(fleet, len(arena.layout))
    return fleet


def _batched_fleet(policy: StatefulPolicy, config: RuntimeConfig, slots: int, mode: ModeSetup,
                   inputs: Optional[Mapping[str, object]], identity: RuntimeIdentity, seeds: Sequence[int],
                   streams: StreamKeeper, stream_role: str, policy_checked: bool) -> FleetRuntime:
    config = dataclasses.replace(config, compile="off")
    placed = place_policy(policy, config)
    placed.policy.compile_kernels(False)
    stream = streams.get(placed.device, stream_role)
    setup = fleet_setup(mode)
    arena = FleetArena(ArenaLayout(placed.policy.state_spec()), slots, placed.device,
                       scratch=setup.scratch(placed.policy))
    masks = SlotMasks(CORE_MASKS + setup.fleet_masks(), slots, placed.device)
    fleet_mode = setup.bind_fleet(FleetContext(placed.policy, arena, masks, stream, streams, config.cuda_graphs))
    host = FleetHost.of(arena)
    owned: Dict[str, torch.Tensor] = {**host.owned(), **masks.owned(), **fleet_mode.owned()}
    graphs = ProgramGraphs(placed.policy, arena, compose_fleet_programs(fleet_mode.programs(), arena, host, masks),
                           use_graphs=config.cuda_graphs, stream=stream, debug_checks=config.debug_checks,
                           eager_fallback=config.graph_fallback == "eager", owned=owned)
    fleet = BatchedFleet(arena=arena, identity=identity, mode=mode, stream=stream, fleet_mode=fleet_mode, masks=masks,
                         host=host, graphs=graphs)
    fleet.runtimes = tuple(_slot_runtime(fleet, i, placed.policy, dataclasses.replace(config, seed=seeds[i]),
                                         placed.numerics, inputs, streams) for i in range(slots))
    for runtime in fleet.runtimes:
        runtime.reset(episode=0)
    try:
        with no_fallback():
            graphs.prepare()
    except Exception as exc:
        refuse_unbatchable(exc, f"{type(placed.policy).__name__}'s step")
        raise
    fleet_mode.prepare()
    if config.runs_state_check and not policy_checked:
        check_state_contract(fleet.runtime(0))
    _log(fleet, len(arena.layout))
    return fleet


def _slot_runtime(fleet: BatchedFleet, slot: int, policy: StatefulPolicy, config: RuntimeConfig, numerics: str,
                  inputs: Optional[Mapping[str, object]], streams: StreamKeeper) -> SlotRuntime:
    """Slot ``slot``'s runtime: its arena, mode, host rows and guard copy are the fleet's."""
    arena: StateArena = fleet.arena.slot(slot)
    transfer = HostTransfer(arena, pinned=False, staging=fleet.host.staging_row(slot),
                            outputs=fleet.host.outputs_row(slot))
    guard = StepGuard(arena, copy=fleet.host.keep[slot]) if config.guard_steps else None
    runtime = SlotRuntime(fleet, slot, config=config, device=fleet.device, numerics_level=numerics, policy=policy,
                          arena=arena, mode=fleet.fleet_mode.slot_modes[slot], graphs=SlotGraphs(fleet, slot),
                          transfer=transfer, guard=guard, fold_outputs=True, identity=fleet.identity,
                          inputs=dict(inputs or {}), stream=fleet.stream, streams=streams)
    runtime.make_replica = lambda role: _replica_slot(fleet, config, inputs, streams, role)
    return runtime


def _replica_slot(fleet: BatchedFleet, config: RuntimeConfig, inputs: Optional[Mapping[str, object]],
                  streams: StreamKeeper, role: str) -> PolicyRuntime:
    """A replica of a fleet slot: slot 0 of a new fleet of the same shape over the same
    weights (a batched step's bits depend on S), in the replica form of its mode; closing
    it closes that fleet."""
    policy = fleet.runtime(0).policy
    replica = build_fleet_runtime(policy, config, slots=fleet.slots, batching=fleet.batching,
                                  mode=fleet.mode_setup.for_replica(), inputs=inputs, identity=fleet.identity,
                                  seeds=(config.seed,) * fleet.slots, streams=streams, stream_role=role,
                                  policy_checked=True)
    runtime = replica.runtime(0)
    assert isinstance(runtime, SlotRuntime)
    runtime.owns_fleet = True
    return runtime


def _log(fleet: FleetRuntime, buffers: int) -> None:
    LOG.info("fleet on %s: %d slots of %d bytes in %d buffers (%s), graphs=%s, fingerprint %s", fleet.device,
             fleet.slots, fleet.arena.stride, buffers, fleet.batching, fleet.captured, fleet.fingerprint[:12])


__all__ = ["build_fleet_runtime", "fleet_identity", "resolve_batching"]
