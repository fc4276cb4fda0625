"""A bag recorded for one robot of a fleet verifies bit-identically with the in-process
replay at the fleet's shape (``capsule_ros.fleet.replay``), and a replay that could not run
at that shape is refused with the reason.

The bag is recorded here as ``fleet_node`` records one: the robot's sensor messages as
received (CDR), its ``~/action`` and ``~/capsule_events`` as published, the serving config
and the robot's place in its fleet in the metadata, while three robots of a batched fleet
step together (trigger mode, gathered), the others on their own inputs, with verbs on the
recorded robot and its neighbours in between. It needs the ROS 2 message types to write
real CDR messages (the replay itself runs without ROS).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np
import pytest
from runtime_fixtures import default_config

rclpy_serialization = pytest.importorskip("rclpy.serialization", reason="writing the bag's CDR messages needs the "
                                          "ROS 2 message types (the replay itself needs none)")

from capsule_ros.bag.errors import ReplaySetupError  # noqa: E402 - after the ROS check
from capsule_ros.bag.recorder import NodeRecorder  # noqa: E402
from capsule_ros.bag.replay import ReplayOptions, replay_bag  # noqa: E402
from capsule_ros.fleet import FleetConfig, build_fleet  # noqa: E402
from capsule_ros.fleet.replay import fleet_record, replay_fleet_bag  # noqa: E402
from capsule_ros.serving.options import SessionOptions  # noqa: E402
from capsule_ros.serving.records import ActionRecord, EventRecord  # noqa: E402

ROBOTS = ("a", "b", "c")
STEP_NS = 50_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000_000_000

    def __call__(self) -> int:
        return self.now


def record_fleet_robot(tmp_path: Path, robot: str = "b") -> Path:
    from geometry_msgs.msg import PointStamped
    from sensor_msgs.msg import JointState

    from capsule_ros.ros.messages import action_message, event_message
    clock = Clock()
    recorder: Dict[str, NodeRecorder] = {}
    node = f"/{robot}/capsule_policy"

    def on_action(name: str, record: ActionRecord) -> None:
        if name == robot:
            recorder["bag"].write_message(f"{node}/action", action_message(record, "arm_base", 2), clock.now)

    def options(name: str) -> SessionOptions:
        def on_event(event: EventRecord) -> None:
            if name == robot:
                recorder["bag"].write_message(f"{node}/capsule_events", event_message(event, clock.now), clock.now)
        return SessionOptions(clock_ns=clock, on_event=on_event)

    config = default_config(tmp_path)
    fleet = build_fleet(config, FleetConfig(robots=ROBOTS, slots=4, batching="vmap"), options=options,
                        on_action=on_action)
    recorder["bag"] = NodeRecorder.start(str(tmp_path / "bag"), "", "mcap", config, f"{node}/action",
                                         f"{node}/capsule_events", fingerprint=fleet.runtime.fingerprint,
                                         serialize=rclpy_serialization.serialize_message,
                                         fleet=fleet_record(fleet, robot))
    rng = np.random.default_rng(0)

    def send(name: str, port: str, msg) -> None:
        if name == robot:
            topic = {"joints": "arm/joint_states", "goal": "arm/goal"}[port]
            recorder["bag"].write_raw(topic, type(msg).__module__.split(".")[0] + "/msg/" + type(msg).__name__,
                                      rclpy_serialization.serialize_message(msg), clock.now)
        fleet.robot(name).loop.feed(port, msg)

    for t in range(40):
        clock.now += STEP_NS
        sec, nanosec = divmod(clock.now, 1_000_000_000)
        for name in ROBOTS:
            if t % 10 == 0:
                goal = PointStamped()
                goal.header.stamp.sec, goal.header.stamp.nanosec = sec, nanosec
                goal.point.x, goal.point.y = (float(v) for v in rng.normal(size=2))
                send(name, "goal", goal)
            joints = JointState()
            joints.header.stamp.sec, joints.header.stamp.nanosec = sec, nanosec
            joints.position = [float(v) for v in rng.normal(size=2)]
            joints.velocity = [float(v) for v in rng.normal(size=2)]
            send(name, "joints", joints)
        if t == 8:
            fleet.robot(robot).verbs.commit("checkpoint")
            fleet.robot("a").verbs.interrupt()
        if t == 20:
            checkpoint = [c for c in fleet.robot(robot).verbs.list() if c.label == "checkpoint"][0]
            fleet.robot(robot).verbs.reenter(checkpoint.id)            # a rollback while the others step
            fleet.robot("a").verbs.reenter()
        if t == 30:
            fleet.robot(robot).verbs.reset()
    recorder["bag"].close()
    assert fleet.status().fleet_steps >= 40
    fleet.release()
    return tmp_path / "bag"


def test_a_fleet_robots_bag_verifies_bit_identically_in_process_at_the_fleets_shape(tmp_path):
    bag = record_fleet_robot(tmp_path)
    verdict = replay_fleet_bag(bag, ReplayOptions())
    assert verdict.identical, verdict.first_divergence
    assert verdict.steps_compared >= 40 and verdict.steps_matched == verdict.steps_compared
    assert verdict.fingerprint_recorded == verdict.fingerprint_replay
    assert "fleet of 4 slots" in verdict.target
    assert sum(verdict.events_replayed.values()) >= 3


def test_a_fleet_robots_bag_is_not_replayed_at_another_shape(tmp_path):
    bag = record_fleet_robot(tmp_path)
    with pytest.raises(ReplaySetupError, match="robot 'b' of a fleet of 4 slots"):
        replay_bag(bag, ReplayOptions())
