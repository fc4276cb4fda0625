"""Processes and a client node for the ROS benchmarks (services, loop)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from capsule_ros.ros.processes import ManagedProcess, start_policy_node


def policy_node(workdir: Path, namespace: str, params: dict, params_file: Path) -> ManagedProcess:
    """The installed policy_node under ``namespace`` with a params overlay."""
    return start_policy_node(workdir, params, namespace=namespace, params_file=params_file,
                             tag=namespace.strip("/") or "policy")


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="capsule-ros-bench-"))


class SpunNode:
    """An rclpy node spun by a background executor (rclpy initialised by the caller)."""

    def __init__(self, rclpy_module, name: str):
        from capsule_ros.ros.spinning import SpinThread
        self.node = rclpy_module.create_node(name)
        self._spin = SpinThread(self.node)

    def close(self) -> None:
        self._spin.shutdown()
        self.node.destroy_node()


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
