"""Test helpers: start the installed executables as processes, and a client node that
talks to them over real topics and services."""
from __future__ import annotations

import queue
from pathlib import Path
from typing import Any, Dict, Optional

from capsule_ros.polling import wait_until
from capsule_ros.ros import processes
from capsule_ros.ros.processes import ManagedProcess, start_executable  # noqa: F401 (used by tests)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PARAMS = REPO / "config" / "policy.yaml"


def deep_merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def start_policy_node(tmp_path: Path, params: Optional[Dict[str, Any]] = None, *, namespace: str = "",
                      params_file: Path = DEFAULT_PARAMS, tag: str = "policy") -> ManagedProcess:
    """policy_node with config/policy.yaml plus overrides; capsules in a directory of the test."""
    overrides = deep_merge({"capsules": {"directory": str(tmp_path / f"{tag}-capsules")}}, params or {})
    return processes.start_policy_node(tmp_path, overrides, namespace=namespace, params_file=params_file, tag=tag)


class ClientNode:
    """An rclpy node spun in a background thread, with helpers to publish, collect
    messages and call the policy node's services."""

    def __init__(self, rclpy_module, name: str = "capsule_test_client", node_path: str = "/capsule_policy"):
        from capsule_ros.ros.client import CapsuleClient
        from capsule_ros.ros.spinning import SpinThread
        self.rclpy = rclpy_module
        self.node = rclpy_module.create_node(name)
        self._spin = SpinThread(self.node)
        self.capsules = CapsuleClient(self.node, node_path, server_wait_s=30.0, call_timeout_s=5.0)
        self._queues: Dict[str, queue.Queue] = {}

    def subscribe(self, msg_type, topic: str, qos=10) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        self.node.create_subscription(msg_type, topic, q.put, qos)
        self._queues[topic] = q
        return q

    def publisher(self, msg_type, topic: str, qos=10):
        return self.node.create_publisher(msg_type, topic, qos)

    def wait_for_subscribers(self, publisher, count: int = 1, timeout: float = 20.0) -> None:
        wait_until(lambda: publisher.get_subscription_count() >= count, timeout,
                   f"{count} subscriber(s) on {publisher.topic_name}")

    @staticmethod
    def drain(q: queue.Queue) -> list:
        from capsule_ros.ros.spinning import drain
        return drain(q)

    def close(self) -> None:
        self._spin.shutdown()
        self.node.destroy_node()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """``capsule_ros.polling.wait_until`` with the tests' defaults."""
    return wait_until(predicate, timeout, what, interval)
