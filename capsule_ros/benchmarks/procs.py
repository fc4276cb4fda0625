"""Processes and a client node for the ROS benchmarks (services, loop)."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import yaml


def installed_executable(name: str) -> str:
    """An executable of the installed package (install/capsule_ros/lib/capsule_ros/<name>)."""
    from ament_index_python.packages import get_package_prefix
    path = Path(get_package_prefix("capsule_ros")) / "lib" / "capsule_ros" / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: build the package first (./setup.sh)")
    return str(path)


class Process:
    """A child process in its own group, logging to a file, stopped with SIGINT."""

    def __init__(self, argv: List[str], log: Path, env: Optional[Dict[str, str]] = None):
        self.log = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env or os.environ.copy())

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def policy_node(workdir: Path, namespace: str, params: dict, params_file: Path) -> Process:
    """The installed policy_node under ``namespace`` with a params overlay."""
    overlay = workdir / f"{namespace.strip('/')}.yaml"
    overlay.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    argv = [installed_executable("policy_node"), "--ros-args", "--params-file", str(params_file),
            "--params-file", str(overlay), "-r", f"__ns:={namespace}"]
    return Process(argv, workdir / f"{namespace.strip('/')}.log")


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="capsule-ros-bench-"))


class SpunNode:
    """An rclpy node spun by a background executor (rclpy initialised by the caller)."""

    def __init__(self, rclpy_module, name: str):
        from rclpy.executors import MultiThreadedExecutor
        self.node = rclpy_module.create_node(name)
        self.executor = MultiThreadedExecutor(num_threads=2)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
