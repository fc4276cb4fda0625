"""Replaying a fleet robot's bag bit-identically, in-process, at the fleet's shape.

A fleet robot's bag carries, beside the serving config every robot shares, the robot's
place in its fleet (``RecordingMeta.fleet``, written by ``fleet_record``): its name and
slot, the fleet's slot count and batching, and the robot's seed. ``FleetRobotTarget``
replays it on a fleet of that shape with the robot alone in its slot (the other slots idle):
a robot's actions do not depend on the other slots, only on the batch shape, so its steps
compute the recorded bits (docs/fleet.md, the exactness contract). ``replay_fleet_bag`` is
``capsule_ros.bag.replay.replay_bag`` with this target; ``capsule-ros replay`` passes it.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from capsule_ros.bag.replay import ReplayOptions, replay_bag
from capsule_ros.bag.targets import InProcessTarget
from capsule_ros.bag.verdict import Verdict
from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.errors import ConfigError
from capsule_ros.fleet.config import FleetConfig, FleetRobot
from capsule_ros.fleet.session import FleetSession
from capsule_ros.runtime.schema import BufferKind
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.session import PolicySession

RECORD_KEYS = ("robot", "slot", "slots", "batching", "seed")


def fleet_record(fleet: FleetSession, robot: str) -> Dict[str, Any]:
    """What a bag of ``robot`` records of its fleet (``NodeRecorder.start(fleet=...)``)."""
    served = fleet.robot(robot)
    runtime = fleet.runtime.runtime(served.slot)
    return {"robot": robot, "slot": served.slot, "slots": fleet.runtime.slots, "batching": fleet.runtime.batching,
            "seed": runtime.config.seed}


class FleetRobotTarget(InProcessTarget):
    """``InProcessTarget`` over the robot's session in a fleet of the recorded shape (see
    the module docstring)."""

    kind = "in-process (fleet)"

    def __init__(self, config: ServingConfig, record: Mapping[str, Any], directory: Optional[CapsuleDirectory],
                 ablation: Sequence[BufferKind] = ()):
        missing = [key for key in RECORD_KEYS if key not in record]
        if missing:
            raise ConfigError(f"the bag's fleet record {dict(record)} lacks {missing}")
        self._record = dict(record)
        self._fleet: Optional[FleetSession] = None
        super().__init__(config, directory, ablation)
        self.kind = f"in-process (fleet of {record['slots']} slots, {record['batching']}, robot in slot " \
                    f"{record['slot']})"

    def _build(self, config: ServingConfig, directory: Optional[CapsuleDirectory],
               options: SessionOptions) -> PolicySession:
        from capsule_ros.fleet.factory import build_fleet
        record = self._record
        name = str(record["robot"])
        fleet = FleetConfig(robots=(name,), slots=int(record["slots"]), batching=str(record["batching"]))
        self._fleet = build_fleet(config, fleet, robots=[FleetRobot(name, slot=int(record["slot"]),
                                                                     seed=int(record["seed"]))],
                                  options=options, directory=directory)
        return self._fleet.robot(name).session

    def close(self) -> None:
        fleet, self._fleet = self._fleet, None
        if fleet is not None:
            fleet.release()


def replay_fleet_bag(bag, options: ReplayOptions = ReplayOptions(), node_target=None) -> Verdict:  # noqa: B008
    """``replay_bag`` that replays a fleet robot's bag on ``FleetRobotTarget`` (any other bag
    as ``replay_bag`` does)."""
    return replay_bag(bag, options, node_target, fleet_target=FleetRobotTarget)
