"""The process sides of `capsule-ros bench fleet` (``capsule_ros/benchmarks/fleet.py``): N
``policy_node`` processes (one per robot) and one ``fleet_node`` process serving N robots,
each driven over real topics in trigger mode from this process.

The driver is one rclpy node spun by its own executor in a background thread. A control
period publishes every active robot's inputs (its other ports first, its trigger port
last, as a robot's drivers would) and waits for each robot's ``~/action`` message; each
robot-step's round trip (trigger published to action received) and the period's wall
time are recorded. Both sides lay their robots out alike: robot ``r<i>`` is namespace
``/<ns>/r<i>`` with ``policy_node``'s interface (``/<ns>/r<i>/capsule_policy/action``, ports
relative to ``/<ns>/r<i>``), so one driver serves both.

- ``nodes``: max N ``policy_node`` processes start once (in parallel), the first N are driven;
- ``fleet_node``: one ``fleet_node`` of S slots with N robots, started for each N (a robot
  that never asks would hold every gathered step for ``fleet.gather_ms``).

Importing this module imports rclpy: the command line adds these sides only where it
does (``capsule_ros.cli.main``).
"""
from __future__ import annotations

import array
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import rclpy
import yaml
from rclpy.qos import QoSProfile, ReliabilityPolicy

from capsule_ros.benchmarks.common import pct
from capsule_ros.benchmarks.fleet import Case, Side
from capsule_ros.ros.processes import ManagedProcess, start_executable, workdir
from capsule_ros.ros.robot_io import message_class
from capsule_ros.ros.spinning import SpunNode

START_TIMEOUT_S = 300.0      # torch import, warm-up and DDS discovery of 16 processes on a busy 2-core machine
STEP_TIMEOUT_S = 30.0
WARMUP_PERIODS = 10
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)   # meets best-effort and reliable ports


def _assign(msg: Any, path: str, values: np.ndarray) -> None:
    """``values`` into the field ``path`` (dotted) of ``msg``: a scalar field takes one value."""
    *parents, leaf = path.split(".")
    for part in parents:
        msg = getattr(msg, part)
    if isinstance(getattr(msg, leaf), (float, int)):
        setattr(msg, leaf, float(values[0]))
    else:
        setattr(msg, leaf, values.astype(np.float32).tolist())


def _fill(msg: Any, port: Dict[str, Any], row: np.ndarray) -> None:
    """One input row into ``msg``: an image (``sensor_msgs/Image``: height x width x
    channels bytes, the port's first encoding) whole, other types field by field in the
    port's ``fields`` order (and a JointState's joint names, where the port binds them)."""
    if hasattr(msg, "encoding"):
        height, width, channels = row.shape
        msg.height, msg.width, msg.step = height, width, width * channels
        msg.encoding = (port.get("encodings") or ["rgb8"])[0]
        msg.data = array.array("B", np.ascontiguousarray(row, np.uint8).tobytes())   # no per-byte check
        return
    if port.get("names") and hasattr(msg, "name"):                # a JointState port binds joints by name
        msg.name = list(port["names"])
    fields = list(port["fields"])
    for field, part in zip(fields, np.array_split(np.asarray(row).ravel(), len(fields)), strict=True):
        _assign(msg, field, part)


class RobotEndpoint:
    """One robot as the driver sees it: a publisher per port, its action subscription."""

    def __init__(self, node: Any, namespace: str, case: Case, params: Dict[str, Any]):
        ports = params["ports"]
        self.trigger = params["control"]["trigger_port"]
        order = sorted(ports["names"], key=lambda name: name == self.trigger)
        self.ports: List[Tuple[str, Any, Any, Dict[str, Any]]] = []
        for name in order:
            port = ports[name]
            cls = message_class(port["type"])
            self.ports.append((name, cls, node.create_publisher(cls, f"{namespace}/{port['topic']}", RELIABLE), port))
        self.frames = case.frames
        self.arrived = threading.Event()
        self.sent = 0.0
        self.roundtrips: List[float] = []
        self._stamp = 0
        node.create_subscription(message_class("capsule_ros/msg/Action"),
                                 f"{namespace}/capsule_policy/action", self._on_action, RELIABLE)

    def _on_action(self, _msg: Any) -> None:
        self.roundtrips.append(time.perf_counter() - self.sent)
        self.arrived.set()

    def ready(self) -> bool:
        return all(publisher.get_subscription_count() > 0 for _, _, publisher, _ in self.ports)

    def publish(self, t: int) -> None:
        """The robot's inputs of period ``t``; the trigger port's message last (it steps)."""
        self._stamp += 1
        self.arrived.clear()
        for name, cls, publisher, port in self.ports:
            msg = cls()
            if hasattr(msg, "header"):
                msg.header.stamp.sec = self._stamp                 # increasing: never out of order
            rows = self.frames[name]
            _fill(msg, port, rows[t % len(rows)])
            if name == self.trigger:
                self.sent = time.perf_counter()
            publisher.publish(msg)

    def wait(self, timeout: float = STEP_TIMEOUT_S) -> None:
        if not self.arrived.wait(timeout):
            raise TimeoutError(f"no action within {timeout} s")

    def prime(self, timeout: float = START_TIMEOUT_S) -> None:
        """Publish until an action comes back (the node serves and discovery is done)."""
        deadline = time.monotonic() + timeout
        while True:
            self.publish(0)
            try:
                self.wait(1.0)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise


def _drive(robots: Sequence[RobotEndpoint], ticks: int) -> Dict[str, Any]:
    """``ticks`` control periods of ``robots`` after a warm-up: robot-steps/s, the period's
    and each robot-step's round trip (p50 / p99 ms)."""
    periods: List[float] = []
    for t in range(WARMUP_PERIODS + ticks):
        if t == WARMUP_PERIODS:
            for robot in robots:
                robot.roundtrips.clear()
        start = time.perf_counter()
        for robot in robots:
            robot.publish(t)
        for robot in robots:
            robot.wait()
        if t >= WARMUP_PERIODS:
            periods.append(time.perf_counter() - start)
    seconds = np.asarray(periods)
    roundtrips = [s for robot in robots for s in robot.roundtrips]
    return {"robot_steps_per_s": float(len(robots) * len(seconds) / seconds.sum()),
            "period_ms": pct(seconds, 1e3), "roundtrip_ms": pct(roundtrips, 1e3)}


def _overlay(directory: Path, tag: str, params: Dict[str, Any]) -> Path:
    path = directory / f"{tag}.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    return path


class _Driver:
    """rclpy, the driver node and the processes of one side and case; ``close`` stops all."""

    def __init__(self, side: str):
        self.tmp = workdir(f"capsule-bench-{side}-")
        self.prefix = f"/bench_fleet_{os.getpid()}_{side}"
        rclpy.init()
        self.client = SpunNode(rclpy, f"bench_fleet_{side}_driver")
        self.processes: List[ManagedProcess] = []

    def start(self, executable: str, params: Dict[str, Any], namespace: str, tag: str) -> None:
        overlay = _overlay(self.tmp, tag, params)
        self.processes.append(start_executable(executable, ["--ros-args", "--params-file", str(overlay),
                                                            "-r", f"__ns:={namespace}"], self.tmp / f"{tag}.log"))

    def robots(self, case: Case, params: Dict[str, Any], namespace: str, count: int) -> List[RobotEndpoint]:
        robots = [RobotEndpoint(self.client.node, f"{namespace}/r{i}", case, params) for i in range(count)]
        deadline = time.monotonic() + START_TIMEOUT_S
        for robot in robots:
            self.check_alive()
            robot.prime(max(1.0, deadline - time.monotonic()))
        return robots

    def check_alive(self) -> None:
        for process in self.processes:
            if not process.alive():
                raise RuntimeError(f"{process.log_path.name} exited: {process.log()[-2000:]}")

    def stop_processes(self) -> List[int]:
        codes = [process.stop() for process in self.processes]
        self.processes = []
        return [code for code in codes if code is not None]

    def close(self) -> List[int]:
        self.client.close()
        rclpy.try_shutdown()
        return self.stop_processes()


def nodes_side(case: Case, slots: int, ns: Sequence[int], ticks: int) -> Dict[str, Any]:
    """max(ns) policy_node processes, one per robot; for each N, the first N driven."""
    params = case.node_params()
    driver = _Driver("nodes")
    out: Dict[str, Any] = {"by_n": {}, "processes": max(ns)}
    try:
        for i in range(max(ns)):
            driver.start("policy_node", params, f"{driver.prefix}/r{i}", f"r{i}")
        robots = driver.robots(case, params, driver.prefix, max(ns))
        for n in ns:
            out["by_n"][n] = _drive(robots[:n], ticks)
    finally:
        out["exit_codes"] = driver.close()
    return out


def fleet_node_side(case: Case, slots: int, ns: Sequence[int], ticks: int) -> Dict[str, Any]:
    """For each N, one fleet_node of ``slots`` slots serving N robots."""
    base = case.node_params()
    driver = _Driver("fleet_node")
    out: Dict[str, Any] = {"by_n": {}, "batching": case.node_batching, "exit_codes": []}
    try:
        for n in ns:
            params = {**base, "fleet": {"robots": [f"r{i}" for i in range(n)], "slots": slots,
                                        "batching": case.node_batching}}
            namespace = f"{driver.prefix}_{n}"
            driver.start("fleet_node", params, namespace, f"fleet{n}")
            out["by_n"][n] = _drive(driver.robots(case, params, namespace, n), ticks)
            out["exit_codes"] += driver.stop_processes()
    finally:
        out["exit_codes"] += driver.close()
    return out


PROCESS_SIDES = (Side("nodes", nodes_side), Side("fleet_node", fleet_node_side))

__all__ = ["PROCESS_SIDES", "fleet_node_side", "nodes_side"]
