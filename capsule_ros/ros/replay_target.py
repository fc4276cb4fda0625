"""The ``policy_node`` replay target: ``capsule-ros replay --node`` drives an installed
policy_node process through ROS with a bag's messages and services, to check the whole
ROS path. It implements ``capsule_ros.bag.targets.ReplayTarget`` (where the in-process
target lives too); its verbs are calls of ``CapsuleClient``, built from the verb table."""
from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import rclpy
from rclpy.context import Context
from rclpy.qos import QoSProfile, ReliabilityPolicy

from capsule_ros.bag.errors import ReplaySetupError
from capsule_ros.bag.metadata import config_params, params_yaml
from capsule_ros.bag.verdict import Act
from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.errors import CapsuleRosError, NotFound
from capsule_ros.msg import Action, RuntimeStatus
from capsule_ros.ros.client import CapsuleClient, ServiceError
from capsule_ros.ros.processes import start_executable
from capsule_ros.ros.robot_io import message_class
from capsule_ros.ros.spinning import SpunNode, drain
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.records import HoldMode


class NodeTarget:
    """A ``policy_node`` process started with the recorded config, driven through ROS.

    Isolation: the node runs in its own namespace and its ports are renamed to
    ``<namespace>/replay_in/<port>``, so a replay never talks to a live robot's topics;
    ports use reliable QoS, the deadline is off (a late step on this machine would
    publish a safe action) and status comes at 50 Hz: after each message the target
    waits until the node counted it (``~/status`` port counters) or until its action
    arrives, so the node processes the bag's messages in the bag's order.
    """

    kind = "policy_node"
    reenacts_deadline_misses = False      # a live node decides lateness by its own clock
    stages_without_stepping = False       # in trigger mode it steps on every trigger message

    def __init__(self, config: ServingConfig, directory: Optional[CapsuleDirectory], workdir: Path,
                 timeout_s: float = 60.0):
        self.directory = directory
        self.timeout_s = timeout_s
        self.workdir = Path(workdir)
        self.capsule_dir = self.workdir / "capsules"
        self.namespace = f"/capsule_replay_{os.getpid()}_{os.urandom(2).hex()}"
        node_path = f"{self.namespace}/capsule_policy"
        params_file = self.workdir / "replay_params.yaml"
        params_file.write_text(params_yaml(self._params(config, self.capsule_dir)))
        self.log_path = self.workdir / "policy_node.log"
        try:
            self.proc = start_executable("policy_node", ["--ros-args", "--params-file", str(params_file),
                                                          "-r", f"__ns:={self.namespace}"], self.log_path)
        except FileNotFoundError as exc:
            raise ReplaySetupError(str(exc)) from None
        self._context = Context()
        rclpy.init(context=self._context)
        self._spun = SpunNode(rclpy, "capsule_replay_driver", namespace=self.namespace, context=self._context)
        self.node = self._spun.node
        reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        self._actions: queue.Queue[Any] = queue.Queue()
        self._status = threading.Condition()
        self._processed: Dict[str, int] = {}
        self._published = 0                          # the node's count of published actions (~/status)
        self._arrived = 0                            # actions that arrived here
        self._fingerprint = ""
        self._sent = dict.fromkeys(config.ports, 0)
        self.node.create_subscription(Action, f"{node_path}/action", self._on_action, reliable)
        self.node.create_subscription(RuntimeStatus, f"{node_path}/status", self._on_status, 10)
        self._publishers = {name: self.node.create_publisher(message_class(port.type),
                                                             f"{self.namespace}/replay_in/{name}", reliable)
                            for name, port in config.ports.items()}
        self.client = CapsuleClient(self.node, node_path, server_wait_s=timeout_s, call_timeout_s=10.0)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _params(config: ServingConfig, capsule_dir: Path) -> dict:
        params = config_params(config)
        params["capsules"]["directory"] = str(capsule_dir)
        for name in config.ports:
            params["ports"][name].update(topic=f"replay_in/{name}", qos="reliable", depth=100)
        params["control"].update(deadline_ms=1e6, status_rate_hz=50.0)
        params["record"]["enabled"] = False
        return params

    def __enter__(self) -> NodeTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------------
    def _on_status(self, msg) -> None:
        """The node builds ~/status on its control thread, after the callback that counted a
        message (and stepped on it) returned: a status that counts the message also counts
        the action that step published."""
        with self._status:
            self._fingerprint = msg.fingerprint
            self._published = int(msg.actions_published)
            for p in msg.ports:
                self._processed[p.name] = int(p.received + p.dropped_shape + p.dropped_type + p.dropped_nonfinite
                                              + p.dropped_out_of_order + p.dropped_future)
            self._status.notify_all()

    def _on_action(self, msg) -> None:
        self._actions.put(msg)
        with self._status:
            self._arrived += 1
            self._status.notify_all()

    def _wait_counted(self, port: str) -> None:
        """Until the node counted every message sent to ``port`` and every action it
        published by then has arrived here."""
        sent = self._sent[port]
        self._wait(lambda: self._processed.get(port, 0) >= sent, f"port {port} to count message {sent}")
        with self._status:
            published = self._published
        self._wait(lambda: self._arrived >= published, f"the node's {published} published action(s) to arrive")

    def _wait(self, predicate, what: str, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        with self._status:
            while not predicate():
                if not self.proc.alive():
                    raise ReplaySetupError(f"policy_node exited with {self.proc.proc.returncode} while waiting for "
                                           f"{what}: {self._log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReplaySetupError(f"policy_node: timed out waiting for {what}")
                self._status.wait(min(left, 0.2))

    def _wait_ready(self) -> None:
        self._wait(lambda: bool(self._fingerprint), "its first ~/status")
        self._wait(lambda: all(p.get_subscription_count() > 0 for p in self._publishers.values()),
                   "its port subscriptions")
        try:
            self._call("list")                      # the services are up
        except CapsuleRosError as exc:
            raise ReplaySetupError(f"policy_node services: {exc}") from None

    def _log_tail(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        return lines[-1][:300] if lines else "(empty log)"

    def _drain(self) -> List[Act]:
        return [Act.of_msg(msg) for msg in drain(self._actions)]

    def _wait_action(self, timeout: float) -> List[Act]:
        try:
            first = self._actions.get(timeout=timeout)
        except queue.Empty:
            return []
        return [Act.of_msg(first)] + self._drain()

    # -- verbs ----------------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def feed(self, port: str, raw: bytes, msg: Any, tick: bool, expect: bool = False,
             log_ns: Optional[int] = None, late: bool = False) -> List[Act]:
        """Publish the recorded bytes; wait for the action the recording says follows, or
        until the node counted the message. (The node checks stamps against its own clock.)"""
        self._publishers[port].publish(raw)
        self._sent[port] += 1
        if expect:
            return self._wait_action(self.timeout_s)
        self._wait_counted(port)
        return self._drain()

    def clock_jump(self, delta_ns: int, log_ns: Optional[int] = None) -> bool:
        """The node's clock is its own (the wall clock): a recorded jump cannot be re-enacted."""
        return False

    def missing_inputs(self) -> List[str]:
        """Ports the node has not counted a message on yet."""
        with self._status:
            return [name for name in self._sent if self._processed.get(name, 0) == 0]

    def step(self, stamp: Optional[int] = None, late: bool = False, log_ns: Optional[int] = None) -> List[Act]:
        raise ReplaySetupError("a policy_node steps on its own in timer mode: replay timer-mode bags in-process")

    def settle(self) -> List[Act]:
        """Every message counted and every action in: what arrived (to be discarded)."""
        for port in self._sent:
            self._wait_counted(port)
        return self._drain()

    def _call(self, verb: str, **fields: Any) -> Any:
        """A verb's service call; a refusal or timeout becomes a CapsuleRosError (the replay reports it)."""
        try:
            return getattr(self.client, verb)(**fields)
        except ServiceError as exc:
            raise CapsuleRosError(str(exc)) from None

    def commit(self, label: str) -> str:
        return self._call("commit", label=label).capsule.id

    def interrupt(self, hold_mode: HoldMode, commit: bool) -> Tuple[str, List[Act]]:
        response = self._call("interrupt", hold_mode=int(hold_mode), commit=commit)
        acts = self._wait_action(self.timeout_s) if hold_mode != HoldMode.HOLD_SILENT else []
        return (response.capsule.id if commit else ""), acts

    def reenter(self, capsule_id: str) -> Optional[int]:
        response = self._call("reenter", capsule_id=capsule_id)
        return int(response.capsule.episode_id) if response.capsule.id else None

    def reset(self, capsule_id: str) -> int:
        return int(self._call("reset", capsule_id=capsule_id).episode_id)

    def fork(self, capsule_id: str, label: str) -> str:
        return self._call("fork", capsule_id=capsule_id, label=label).capsule.id

    def drop(self, capsule_id: str) -> None:
        self._call("drop", capsule_id=capsule_id)

    def has(self, capsule_id: str) -> bool:
        return any(c.id == capsule_id and c.tier != c.TIER_DISK for c in self._call("list").capsules)

    def load(self, capsule_id: str) -> None:
        """Copy the capsule file into the node's own capsule directory and load it."""
        if self.directory is None or not self.directory.exists(capsule_id):
            raise NotFound(f"no capsule file {capsule_id}.capsule in "
                           f"{self.directory.root if self.directory else '(no capsule directory: use --capsule-dir)'}")
        source = self.directory.path_of(capsule_id)
        self.capsule_dir.mkdir(mode=0o700, exist_ok=True)
        target = self.capsule_dir / source.name
        shutil.copyfile(source, target)
        os.chmod(target, 0o600)
        self._call("load", capsule_id=capsule_id)

    def close(self) -> None:
        self.proc.stop(timeout=15)
        with contextlib.suppress(Exception):
            self._spun.close()
        with contextlib.suppress(Exception):
            self._context.try_shutdown()
