"""Output adapters: each step's action as commands a robot's controllers take.

Beside ``~/action`` (the full record: values, chunk, lineage, source), the node can
publish the same action on command topics that ros2_control controllers consume:

- ``trajectory_msgs/msg/JointTrajectory`` (joint_trajectory_controller): the action chunk
  as future points; row ``i`` of the chunk (row 0 = this step's action) is due at
  ``time_from_start = (i + 1) * time_step`` after the header stamp, which is the step's
  input time, so the controller can blend a new chunk into the one it is running;
- ``std_msgs/msg/Float64MultiArray`` (forward_command_controller and its position /
  velocity / effort variants): this step's action;
- ``sensor_msgs/msg/JointState``: this step's action as named joint commands.

Safe actions (an interrupt, or a step that missed its deadline, raised or produced
non-finite values; ``Action.source`` HOLD or ZERO) become *stop where you are* on every
output, whatever ``control.deadline_action`` says about ``~/action``:

- a position output holds the last position it commanded (nothing is published if it has
  never commanded one: the controller still holds its own);
- a velocity or effort output commands zeros.

This module is ROS-free: it turns an ActionRecord into a :class:`Command` (rows of
joint values); ``capsule_ros.ros.outputs`` turns a Command into the message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from capsule_ros.config import ConfigSection, normalize_message_type, setting
from capsule_ros.errors import ConfigError
from capsule_ros.serving.records import ActionRecord, ActionSource

TRAJECTORY = "trajectory_msgs/msg/JointTrajectory"
MULTI_ARRAY = "std_msgs/msg/Float64MultiArray"
JOINT_STATE = "sensor_msgs/msg/JointState"
OUTPUT_TYPES = (TRAJECTORY, MULTI_ARRAY, JOINT_STATE)
INTERFACES = ("position", "velocity", "effort")


@dataclass(frozen=True)
class OutputConfig(ConfigSection):
    """One command topic beside ~/action, for a robot's controllers (serving/outputs.py)."""

    SECTION = "outputs.<name>"

    topic: str = setting("", "command topic (e.g. /arm_controller/joint_trajectory)", read_only=True)
    type: str = setting(TRAJECTORY, "message type", choices=OUTPUT_TYPES, read_only=True)
    interface: str = setting("position", "what the action values command; safe actions hold the last position "
                             "(position) or command zeros (velocity, effort)", choices=INTERFACES, read_only=True)
    joints: Tuple[str, ...] = setting((), "joint names, one per value sent (required for JointTrajectory and "
                                      "JointState)", read_only=True)
    indices: Tuple[int, ...] = setting((), "action elements sent, in joint order (empty = all of them)",
                                       low=0, high=1 << 20, read_only=True)
    time_step_ms: float = setting(0.0, "JointTrajectory: time between chunk rows (0 = the control period; "
                                  "must be set in trigger mode)", low=0.0, high=1e6)
    points: int = setting(0, "JointTrajectory: chunk rows sent as points (0 = the whole chunk)", low=0, high=1 << 20)
    qos: str = setting("reliable", "QoS profile", choices=("sensor_data", "reliable", "system_default"),
                       read_only=True)
    depth: int = setting(10, "QoS history depth", low=1, high=10000, read_only=True)

    @classmethod
    def normalize(cls, values: dict) -> dict:
        if isinstance(values.get("type"), str):
            values = {**values, "type": normalize_message_type(values["type"])}
        return values

    def check(self) -> None:
        if not self.topic:
            raise ConfigError(f"{self.SECTION}.topic: must be set")
        if self.type in (TRAJECTORY, JOINT_STATE) and not self.joints:
            raise ConfigError(f"{self.SECTION}.joints: a {self.type.rsplit('/', 1)[-1]} output needs joint names")
        if self.joints and self.indices and len(self.joints) != len(self.indices):
            raise ConfigError(f"{self.SECTION}: {len(self.joints)} joints but {len(self.indices)} indices")
        if len(set(self.joints)) != len(self.joints):
            raise ConfigError(f"{self.SECTION}.joints = {list(self.joints)}: names repeat")


def point_spacing(name: str, config: OutputConfig, control_period_s: Optional[float]) -> float:
    """Seconds between the trajectory points of output ``name``: ``time_step_ms``, else the
    control period (None in trigger mode, where a JointTrajectory output must set time_step_ms)."""
    if config.time_step_ms > 0:
        return config.time_step_ms / 1e3
    if control_period_s is None and config.type == TRAJECTORY:
        raise ConfigError(f"outputs.{name}.time_step_ms: must be set when control.mode is 'trigger' "
                          "(there is no control period to space the points)")
    return float(control_period_s or 0.0)


@dataclass(frozen=True)
class Command:
    """What one output sends for one action: ``rows`` [K, n] float64 joint values (K = 1
    except a JointTrajectory of a policy chunk), when row i is due (``time_step_s``), and
    whether it is a safe action (stamped now, not at the step's input time)."""

    rows: np.ndarray
    time_step_s: float
    stamp_ns: int
    safe: bool


class OutputAdapter:
    """Maps ActionRecords to Commands for one configured output (see the module docstring).

    Called from whichever thread publishes the action (control loop, deadline watchdog,
    interrupt service); the caller serialises the calls (the node's publish lock)."""

    def __init__(self, name: str, config: OutputConfig, action_dim: int, control_period_s: Optional[float]):
        where = f"outputs.{name}"
        self.name, self.config = name, config
        indices = config.indices or tuple(range(action_dim))
        bad = [i for i in indices if i >= action_dim]
        if bad:
            raise ConfigError(f"{where}.indices = {list(config.indices)}: {bad} out of range for the policy's "
                              f"action_dim {action_dim}")
        if config.joints and len(config.joints) != len(indices):
            raise ConfigError(f"{where}.joints: {len(config.joints)} names for {len(indices)} action values "
                              f"(set {where}.indices to pick which)")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.time_step_s = point_spacing(name, config, control_period_s)
        self._last_position: Optional[np.ndarray] = None

    def retune(self, config: OutputConfig, time_step_s: float) -> None:
        """Run-time settings (``time_step_ms``, ``points``: what the node's parameters may
        change) and the point spacing they give (``point_spacing``); the caller serialises
        it with ``command``."""
        self.config, self.time_step_s = config, time_step_s

    @property
    def size(self) -> int:
        return int(self.indices.shape[0])

    def command(self, record: ActionRecord, now_ns: int) -> Optional[Command]:
        """The command for ``record``; None when there is nothing to send (a safe action on a
        position output that has not commanded a position yet)."""
        if record.source == ActionSource.POLICY:
            rows = record.values[None]
            if self.config.type == TRAJECTORY and record.chunk is not None:
                rows = record.chunk[: self.config.points or None]
            selected = np.asarray(rows, dtype=np.float64)[:, self.indices]
            if self.config.interface == "position":
                self._last_position = selected[0].copy()
            return Command(selected, self.time_step_s, record.stamp_ns, safe=False)
        if self.config.interface != "position":
            return Command(np.zeros((1, self.size)), self.time_step_s, now_ns, safe=True)
        if self._last_position is None:
            return None
        return Command(self._last_position[None].copy(), self.time_step_s, now_ns, safe=True)
