"""Start the installed executables as child processes (demo, benchmarks, tests, replay).

Each runs in its own process group, logs to a file, and stops with SIGINT (then SIGKILL
of its group if it does not exit), which is how a user's terminal stops it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import yaml


def installed_executable(name: str) -> str:
    """``<prefix>/lib/capsule_ros/<name>`` of the installed package."""
    from ament_index_python.packages import get_package_prefix
    path = Path(get_package_prefix("capsule_ros")) / "lib" / "capsule_ros" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: build the package first (./setup.sh)")
    return str(path)


class ManagedProcess:
    """A child process in its own group, logging to ``log_path``."""

    def __init__(self, argv: List[str], log_path: Path, env: Optional[Dict[str, str]] = None):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")          # noqa: SIM115 - open for the process's life; stop() closes it
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env or os.environ.copy())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGINT and wait; SIGKILL the group if it does not exit. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


def start_executable(name: str, args: List[str], log_path: Path,
                     env: Optional[Dict[str, str]] = None) -> ManagedProcess:
    """An installed executable (``env``: its whole environment, default this process's)."""
    return ManagedProcess([installed_executable(name), *args], log_path, env)


def start_policy_node(workdir: Path, params: dict, *, namespace: str = "", params_file: Path,
                      tag: str = "", env: Optional[Dict[str, str]] = None) -> ManagedProcess:
    """``policy_node`` with ``params_file`` plus ``params`` as a second (overriding) file;
    its log and overlay files in ``workdir`` are named by ``tag`` (default: the namespace)."""
    tag = tag or namespace.strip("/").replace("/", "_") or "policy"
    overlay = Path(workdir) / f"{tag}-overrides.yaml"
    overlay.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    args = ["--ros-args", "--params-file", str(params_file), "--params-file", str(overlay)]
    if namespace:
        args += ["-r", f"__ns:={namespace}"]
    return start_executable("policy_node", args, Path(workdir) / f"{tag}.log", env)


def workdir(prefix: str = "capsule-ros-") -> Path:
    """A new private temporary directory (logs, parameter overlays, capsules)."""
    return Path(tempfile.mkdtemp(prefix=prefix))
