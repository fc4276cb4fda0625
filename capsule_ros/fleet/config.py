"""The fleet's own settings (the parameter group ``fleet``): which robots, how many batch
slots, the batching, the trigger gather's bounded wait and each robot's seed.

Everything else (ports, policy, runtime, capsules, control) is the serving configuration
every robot shares (``capsule_ros.serving.config.ServingConfig``): one policy, one graph,
one fingerprint. A robot's control section may differ from the others' in what does not
shape the graph (its step mode, deadline, staleness...): ``FleetRobot.control``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from capsule_ros.config import CONFIGURE, ConfigSection, setting
from capsule_ros.errors import ConfigError
from capsule_ros.runtime.fleet import BATCHINGS
from capsule_ros.runtime.slots import MAX_SLOTS
from capsule_ros.serving.config import ControlConfig

ROBOT_NAME = r"[A-Za-z][A-Za-z0-9_]{0,63}"    # a ROS namespace segment


@dataclass(frozen=True)
class FleetConfig(ConfigSection):
    """Many robots, one policy, one arena of batch slots (docs/fleet.md)."""

    SECTION = "fleet"

    robots: Tuple[str, ...] = setting(("robot1",), "the robots served, each a namespace with policy_node's "
                                      "interface (ports, ~/action, ~/status, the capsule services, RunPolicy)",
                                      read_only=True)
    slots: int = setting(0, "batch slots S of the arena and of every program (0 = one per robot); a batched "
                         "fleet's fingerprint includes S", low=0, high=MAX_SLOTS, read_only=True)
    batching: str = setting("auto", "vmap (one program over all slots, torch.func.vmap), loop (each slot runs "
                            "the single-robot programs: batch-invariant) or auto (vmap, loop for a policy that "
                            "runs outside torch)", choices=BATCHINGS, read_only=True)
    gather_ms: float = setting(2.0, "how long a trigger-mode robot's step request waits for the other "
                               "trigger-mode robots' before the fleet steps without them", low=0.0, high=1000.0,
                               applies=CONFIGURE)
    seeds: Tuple[int, ...] = setting((), "each robot's RNG seed at a reset, in the order of robots (empty: "
                                     "runtime.seed for all); never the slot's", low=0, high=2**31 - 1,
                                     read_only=True)

    def check(self) -> None:
        import re
        if not self.robots:
            raise ConfigError("fleet.robots = []: name at least one robot")
        bad = [name for name in self.robots if not re.fullmatch(ROBOT_NAME, name)]
        if bad:
            raise ConfigError(f"fleet.robots = {list(self.robots)}: {bad} must match {ROBOT_NAME} (a namespace)")
        if len(set(self.robots)) != len(self.robots):
            raise ConfigError(f"fleet.robots = {list(self.robots)}: each robot once")
        if self.slots and self.slots < len(self.robots):
            raise ConfigError(f"fleet.slots = {self.slots}: fewer than the {len(self.robots)} robots of fleet.robots")
        if self.seeds and len(self.seeds) != len(self.robots):
            raise ConfigError(f"fleet.seeds = {list(self.seeds)}: one per robot ({len(self.robots)}) or none")

    @property
    def slot_count(self) -> int:
        """S: ``slots``, or one per robot."""
        return self.slots or len(self.robots)


@dataclass(frozen=True)
class FleetRobot:
    """One robot of a fleet: its name, its slot (default: in the order of ``fleet.robots``),
    its RNG seed (default: ``fleet.seeds``, else ``runtime.seed``) and its control section
    (default: the shared one)."""

    name: str
    slot: Optional[int] = None
    seed: Optional[int] = None
    control: Optional[ControlConfig] = None


def robots_of(config: FleetConfig, robots: Sequence[FleetRobot] = ()) -> Tuple[FleetRobot, ...]:
    """Every robot of ``config`` with its slot and seed settled (``robots`` may place some
    in other slots, or give them their own seed or control section); ConfigError for a
    robot that is not in ``fleet.robots``, or two in one slot."""
    given = {robot.name: robot for robot in robots}
    unknown = sorted(set(given) - set(config.robots))
    if unknown:
        raise ConfigError(f"robots {unknown}: not in fleet.robots {list(config.robots)}")
    taken = {given[name].slot for name in config.robots if name in given and given[name].slot is not None}
    free = iter(slot for slot in range(config.slot_count) if slot not in taken)
    settled = []
    for index, name in enumerate(config.robots):
        robot = given.get(name, FleetRobot(name))
        slot = robot.slot if robot.slot is not None else next(free)
        if not 0 <= slot < config.slot_count:
            raise ConfigError(f"robot {name!r}: slot {slot} is not one of the fleet's {config.slot_count} slots")
        seed = robot.seed if robot.seed is not None else (config.seeds[index] if config.seeds else None)
        settled.append(FleetRobot(name, slot, seed, robot.control))
    slots = [robot.slot for robot in settled]
    if len(set(slots)) != len(slots):
        raise ConfigError(f"robots in slots {slots}: each slot serves one robot")
    return tuple(settled)
