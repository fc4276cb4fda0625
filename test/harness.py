"""Test helpers: start the installed executables as processes, and a client node that
talks to them over real topics and services."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
INSTALL_BIN = REPO / "install" / "capsule_ros" / "lib" / "capsule_ros"
DEFAULT_PARAMS = REPO / "config" / "policy.yaml"


def executable(name: str) -> Path:
    path = INSTALL_BIN / name
    if not path.exists():
        raise RuntimeError(f"{path} is missing: run ./setup.sh first (the tests use the installed package)")
    return path


def deep_merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class NodeProcess:
    """An installed executable running as its own process (its own process group)."""

    def __init__(self, name: str, args: list, log_path: Path, env: Optional[dict] = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([str(executable(name)), *args], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env or os.environ.copy(), start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGINT, wait; SIGKILL the group if it does not exit. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_policy_node(tmp_path: Path, params: Optional[Dict[str, Any]] = None, *, namespace: str = "",
                      params_file: Path = DEFAULT_PARAMS, tag: str = "policy") -> NodeProcess:
    """policy_node with config/policy.yaml plus overrides (a second params file)."""
    overrides = deep_merge({"capsules": {"directory": str(tmp_path / f"{tag}-capsules")}}, params or {})
    override_file = tmp_path / f"{tag}-overrides.yaml"
    override_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": overrides}}))
    args = ["--ros-args", "--params-file", str(params_file), "--params-file", str(override_file)]
    if namespace:
        args += ["-r", f"__ns:={namespace}"]
    return NodeProcess("policy_node", args, tmp_path / f"{tag}.log")


class ClientNode:
    """An rclpy node spun in a background thread, with helpers to publish, collect
    messages and call the policy node's services."""

    def __init__(self, rclpy_module, name: str = "capsule_test_client", node_path: str = "/capsule_policy"):
        from rclpy.executors import MultiThreadedExecutor
        from capsule_ros.ros.client import CapsuleClient
        self.rclpy = rclpy_module
        self.node = rclpy_module.create_node(name)
        self.executor = MultiThreadedExecutor(num_threads=2)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()
        self.capsules = CapsuleClient(self.node, node_path, server_wait_s=30.0, call_timeout_s=5.0)
        self._queues: Dict[str, "queue.Queue"] = {}

    def subscribe(self, msg_type, topic: str, qos=10) -> "queue.Queue":
        q: "queue.Queue" = queue.Queue()
        self.node.create_subscription(msg_type, topic, q.put, qos)
        self._queues[topic] = q
        return q

    def publisher(self, msg_type, topic: str, qos=10):
        return self.node.create_publisher(msg_type, topic, qos)

    def wait_for_subscribers(self, publisher, count: int = 1, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while publisher.get_subscription_count() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no subscriber on {publisher.topic_name} after {timeout} s")
            time.sleep(0.05)

    @staticmethod
    def drain(q: "queue.Queue") -> list:
        items = []
        while True:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
