"""Build a fleet from a ServingConfig (what every robot shares) and a FleetConfig.

In the order of a node's lifecycle, as ``capsule_ros.serving.factory`` does for one
robot: ``prepare_fleet`` (configure: the policy on the CPU, every check that needs no
device, the fleet's identity, the capsule directory), ``start_fleet`` (activate: the
execution mode settled, the fleet runtime on its device, the shared capsule store, a
session per robot sharing one boundary); ``build_fleet`` does both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.store import CapsuleStore
from capsule_ros.chunking.fleet import fleet_form
from capsule_ros.errors import ConfigError
from capsule_ros.fleet.config import FleetConfig, FleetRobot, robots_of
from capsule_ros.fleet.robot import RobotSession
from capsule_ros.fleet.session import FleetSession, OnAction
from capsule_ros.runtime.builder import runtime_identity
from capsule_ros.runtime.fleetbuild import build_fleet_runtime, fleet_identity, resolve_batching
from capsule_ros.runtime.policy import StatefulPolicy
from capsule_ros.runtime.streams import StreamKeeper
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import PreparedServing, port_bindings, prepare_serving, settle_mode
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.session import PolicySession

# each robot's SessionOptions: one value for all, a mapping by robot, or a function of its name
RobotOptions = Union[SessionOptions, Mapping[str, SessionOptions], Callable[[str], SessionOptions]]


@dataclass(frozen=True)
class PreparedFleet:
    """What a fleet's ``configure`` knows: the serving stack prepared as for one robot (the
    policy with its weights on the CPU, the capsule directory) with the fleet's identity
    (a batched fleet's fingerprint includes S), the fleet's settings and its robots."""

    serving: PreparedServing
    fleet: FleetConfig
    robots: Sequence[FleetRobot]

    @property
    def config(self) -> ServingConfig:
        return self.serving.config

    @property
    def fingerprint(self) -> str:
        return self.serving.fingerprint


def prepare_fleet(config: ServingConfig, fleet: FleetConfig, *, robots: Sequence[FleetRobot] = (),
                  weights: Optional[str] = None, node_name: str = "capsule_fleet",
                  directory: Optional[CapsuleDirectory] = None,
                  policy: Optional[StatefulPolicy] = None) -> PreparedFleet:
    """``prepare_serving`` for a fleet (one capsule directory for every robot: ``{node}`` is
    the fleet node's name). ``robots``: robots placed in other slots, or with a seed or a
    control section of their own (``FleetRobot``). ``policy``: one the caller built for the
    configured ports instead of ``policy.kind``'s (benchmarks). Raises ConfigError before
    any device memory is used."""
    settled = robots_of(fleet, robots)
    if policy is None:
        serving = prepare_serving(config, weights=weights, node_name=node_name, directory=directory)
    else:
        serving = PreparedServing(config, policy, runtime_identity(policy, config.runtime, port_bindings(config)),
                                  directory)
    batching = resolve_batching(serving.policy, fleet.batching)
    control = config.control
    if batching == "vmap" and serving.policy.cadence() is not None and control.chunking == "async" \
            and control.inference_delay_steps == "auto":
        raise ConfigError("control.inference_delay_steps = auto with fleet.batching vmap: auto measures one robot's "
                          "refill, and in a fleet the robots that ask on one step are planned one after the other; "
                          "set the delay in steps, for the most robots that may ask together")
    identity = fleet_identity(serving.policy, config.runtime, port_bindings(config), fleet.slot_count, batching)
    return PreparedFleet(dataclasses.replace(serving, identity=identity), fleet, settled)


def start_fleet(prepared: PreparedFleet, *, options: Optional[RobotOptions] = None,
                on_action: Optional[OnAction] = None, streams: Optional[StreamKeeper] = None) -> FleetSession:
    """The fleet runtime on its device in the settled mode, the shared store, and a session
    per robot over its slot (sharing one boundary); each robot's episode 1 starts when its
    ``control.autostart``. ``options``: each robot's ``SessionOptions`` (its clock, event
    observer, safe-action callback); ``on_action``: told every action record of every fleet
    step, with the robot's name."""
    streams = streams or StreamKeeper()
    serving = settle_mode(prepared.serving, streams=streams)
    config, fleet_config = serving.config, prepared.fleet
    assert serving.mode is not None
    seeds = [config.runtime.seed] * fleet_config.slot_count
    for robot in prepared.robots:
        if robot.seed is not None and robot.slot is not None:
            seeds[robot.slot] = robot.seed
    runtime = build_fleet_runtime(serving.policy, config.runtime, slots=fleet_config.slot_count,
                                  batching=fleet_config.batching, mode=fleet_form(serving.mode),
                                  inputs=port_bindings(config),
                                  identity=serving.identity, seeds=seeds, streams=streams)
    store = CapsuleStore(runtime.arena.stride, runtime.fingerprint, runtime.device, config.capsules)
    fleet = FleetSession(runtime, store, fleet_config.gather_ms / 1e3, on_action)
    first: Optional[PolicySession] = None
    for robot in prepared.robots:
        assert robot.slot is not None
        robot_options = _options_of(options, robot.name)
        session = PolicySession(runtime.runtime(robot.slot), store, robot.control or config.control,
                                directory=serving.directory, ports=config.ports, prefix=config.policy.prefix,
                                options=robot_options, together_with=first)
        first = first or session
        fleet.add(RobotSession(robot.name, robot.slot, session, fleet), robot_options.on_event)
    store.on_evict = fleet.evicted
    for served in fleet.robots.values():
        if served.loop.control.autostart:
            served.verbs.reset()
        served.session.warm_up()
    return fleet


def build_fleet(config: ServingConfig, fleet: FleetConfig, *, robots: Sequence[FleetRobot] = (),
                weights: Optional[str] = None, options: Optional[RobotOptions] = None,
                on_action: Optional[OnAction] = None, node_name: str = "capsule_fleet",
                directory: Optional[CapsuleDirectory] = None, policy: Optional[StatefulPolicy] = None) -> FleetSession:
    """Configure and start in one call (tests, benchmarks, replays)."""
    return start_fleet(prepare_fleet(config, fleet, robots=robots, weights=weights, node_name=node_name,
                                     directory=directory, policy=policy), options=options, on_action=on_action)


def _options_of(options: Optional[RobotOptions], name: str) -> SessionOptions:
    if options is None:
        return SessionOptions()
    if isinstance(options, SessionOptions):
        return options
    if callable(options):
        return options(name)
    return options.get(name, SessionOptions())
