"""What a replay drives: a ``PolicySession`` in this process, or a ``policy_node`` process.

Both offer the same verbs to the replay engine (``capsule_ros.bag.replay``): feed a
sensor message (and step when it is a trigger), step, and the capsule services. Sensor
messages reach the policy through the same ``PortAdapter`` code as in the node: in
process it is called directly; a node receives the recorded bytes on its topics.

Replays never write to a capsule directory: capsules the bag does not commit itself
(``--from-capsule``, a re-entry of a capsule saved before the recording) are read from
their files by ``CapsuleFiles``, which neither creates nor recovers anything there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from capsule_ros.bag.errors import ReplaySetupError
from capsule_ros.bag.metadata import config_params, params_yaml
from capsule_ros.bag.verdict import Act
from capsule_ros.capsules.fileformat import load_kek, read_capsule
from capsule_ros.capsules.store import Capsule
from capsule_ros.errors import CapsuleRosError, NotFound
from capsule_ros.bag.ablation import complement_runs
from capsule_ros.runtime.schema import BufferKind
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.ports import PortDrop, stamp_ns
from capsule_ros.serving.records import HoldMode

class CapsuleFiles:
    """Read-only access to capsule files (``<directory>/<id>.capsule``)."""

    def __init__(self, directory: Optional[Path], key_file: str = "", max_file_bytes: int = 1 << 36):
        self.directory = Path(directory).expanduser() if directory else None
        self.key_file = key_file
        self.max_file_bytes = max_file_bytes

    def path(self, capsule_id: str) -> Optional[Path]:
        """The capsule's file, if there is one (ids are plain file names: checked by the caller)."""
        if self.directory is None or "/" in capsule_id or capsule_id.startswith("."):
            return None
        path = self.directory / f"{capsule_id}.capsule"
        return path if path.is_file() else None

    def read(self, capsule_id: str, fingerprint: str, schema) -> Tuple[Capsule, Any]:
        """The capsule and its verified bytes (typed capsule errors otherwise)."""
        path = self.path(capsule_id)
        if path is None:
            raise NotFound(f"no capsule file {capsule_id}.capsule in "
                           f"{self.directory if self.directory else '(no capsule directory: use --capsule-dir)'}")
        kek = load_kek(Path(self.key_file).expanduser()) if self.key_file else None
        header, data = read_capsule(path, kek=kek, max_bytes=self.max_file_bytes, expected_fingerprint=fingerprint,
                                    expected_schema=schema)
        return Capsule(header.capsule_id, header.label, header.parent_id, header.episode_id, header.step,
                       header.nbytes, header.fingerprint, header.stamp_ns, path=str(path)), data


class InProcessTarget:
    """A PolicySession built from the recorded config, in this process."""

    kind = "in-process"
    reenacts_deadline_misses = True       # tick(late=True): the session hands out its safe action
    stages_without_stepping = True        # feed(tick=False) stages a trigger message without a step

    def __init__(self, config: ServingConfig, files: CapsuleFiles, ablation: Sequence[BufferKind] = ()):
        from capsule_ros.serving.factory import build_session
        # no capsule directory: the replay reads capsule files itself and never writes one
        config = dataclasses.replace(config, capsules=dataclasses.replace(config.capsules, directory=""))
        self.session = build_session(config)
        self.session.enforce_deadline = False      # verify the function, not this machine's timing
        self.files = files
        self.ablation = tuple(ablation)

    def __enter__(self) -> "InProcessTarget":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def fingerprint(self) -> str:
        return self.session.runtime.fingerprint

    def feed(self, port: str, raw: bytes, msg: Any, tick: bool, expect: bool = False,
             log_ns: Optional[int] = None, late: bool = False) -> List[Act]:
        """A sensor message through the session's port, checked against the clock of the
        recording (its log time: when the node received it); a step if ``tick`` and it
        was accepted (``late``: the recording says that step missed its deadline)."""
        if msg is None:                            # undecodable: the node counts it and drops it
            self.session.ports[port].counters.dropped["type"] += 1
            return []
        try:
            self.session.receive(port, msg, log_ns)
        except PortDrop:
            return []
        return self.step(stamp_ns(msg), late=late) if tick else []

    def step(self, stamp: Optional[int] = None, late: bool = False) -> List[Act]:
        record = self.session.tick(stamp or 0, late=late)
        return [Act.of_record(record)] if record is not None else []

    def settle(self) -> List[Act]:
        return []

    def missing_inputs(self) -> List[str]:
        """Ports that have not received a value yet (a step waits for all of them)."""
        return self.session.inputs.missing()

    # -- capsule verbs: each returns what the replay maps to the recording ------------------------
    def commit(self, label: str) -> str:
        return self.session.commit(label).id

    def interrupt(self, mode: HoldMode, commit: bool) -> Tuple[str, List[Act]]:
        """Interrupt, and the safe action the node publishes with it."""
        capsule = self.session.interrupt(mode, commit)
        record = self.session.safe_record(self.session.hold_mode)
        return (capsule.id if capsule else ""), ([Act.of_record(record)] if record is not None else [])

    def reenter(self, capsule_id: str) -> Optional[int]:
        if self.ablation and capsule_id:
            self._reenter_ablated(capsule_id)
        else:
            self.session.reenter(capsule_id)
        return self.session.episode_id

    def reset(self, capsule_id: str) -> int:
        return self.session.reset(capsule_id)[0]

    def fork(self, capsule_id: str, label: str) -> str:
        return self.session.fork(capsule_id, label).id

    def drop(self, capsule_id: str) -> None:
        self.session.drop(capsule_id)

    def has(self, capsule_id: str) -> bool:
        return capsule_id in self.session.store

    def adopt(self, capsule_id: str) -> None:
        """Load a capsule file into memory (verified, same fingerprint and schema)."""
        session = self.session
        capsule, data = self.files.read(capsule_id, session.store.fingerprint, session.runtime.layout.schema())
        with session.at_boundary():
            session.store.adopt(capsule, data)

    def close(self) -> None:
        pass

    def _reenter_ablated(self, capsule_id: str) -> None:
        """Re-enter, then put back every buffer kind but the ablated ones from the state
        before: only the ablated kinds end up restored."""
        session, store, runtime = self.session, self.session.store, self.session.runtime
        with session.at_boundary():
            live = store.snapshot(runtime, label="ablation: live state", episode_id=session.episode_id,
                                  step=session.step, held=True)
        try:
            session.reenter(capsule_id)
            with session.at_boundary():
                for kinds in complement_runs(self.ablation):
                    store.restore(live.id, runtime, kinds=kinds)
        finally:
            with session.at_boundary():
                store.drop(live.id)


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

    def __init__(self, config: ServingConfig, files: CapsuleFiles, workdir: Path, timeout_s: float = 60.0):
        try:
            import rclpy
            from rclpy.context import Context
            from rclpy.executors import SingleThreadedExecutor
            from rclpy.qos import QoSProfile, ReliabilityPolicy
            from capsule_ros.msg import Action, RuntimeStatus
            from capsule_ros.ros.client import CapsuleClient
            from capsule_ros.ros.node import message_class
            from capsule_ros.ros.processes import start_executable
        except ImportError as exc:
            raise ReplaySetupError(f"--node needs ROS 2 and the built package ({exc})") from None
        self.files = files
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
        self.node = rclpy.create_node("capsule_replay_driver", namespace=self.namespace, context=self._context)
        self._executor = SingleThreadedExecutor(context=self._context)
        self._executor.add_node(self.node)
        self._spin = threading.Thread(target=self._executor.spin, daemon=True, name="capsule_replay_spin")
        self._spin.start()
        reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        self._actions: "queue.Queue[Any]" = queue.Queue()
        self._status = threading.Condition()
        self._processed: Dict[str, int] = {}
        self._published = 0                          # the node's count of published actions (~/status)
        self._arrived = 0                            # actions that arrived here
        self._fingerprint = ""
        self._sent = {name: 0 for name in config.ports}
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

    def __enter__(self) -> "NodeTarget":
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
            self._call("list_capsules")             # the services are up
        except CapsuleRosError as exc:
            raise ReplaySetupError(f"policy_node services: {exc}") from None

    def _log_tail(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        return lines[-1][:300] if lines else "(empty log)"

    def _drain(self) -> List[Act]:
        out = []
        while True:
            try:
                out.append(Act.of_msg(self._actions.get_nowait()))
            except queue.Empty:
                return out

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

    def missing_inputs(self) -> List[str]:
        """Ports the node has not counted a message on yet."""
        with self._status:
            return [name for name in self._sent if self._processed.get(name, 0) == 0]

    def step(self, stamp: Optional[int] = None, late: bool = False) -> List[Act]:
        raise ReplaySetupError("a policy_node steps on its own in timer mode: replay timer-mode bags in-process")

    def settle(self) -> List[Act]:
        """Every message counted and every action in: what arrived (to be discarded)."""
        for port in self._sent:
            self._wait_counted(port)
        return self._drain()

    def _call(self, service: str, **kwargs) -> Any:
        """A service call; a refusal or timeout becomes a CapsuleRosError (the replay reports it)."""
        from capsule_ros.ros.client import ServiceError
        try:
            return getattr(self.client, service)(**kwargs)
        except ServiceError as exc:
            raise CapsuleRosError(str(exc)) from None

    def commit(self, label: str) -> str:
        return self._call("commit", label=label).capsule.id

    def interrupt(self, mode: HoldMode, commit: bool) -> Tuple[str, List[Act]]:
        response = self._call("interrupt", hold_mode=int(mode), commit=commit)
        acts = self._wait_action(self.timeout_s) if mode != HoldMode.HOLD_SILENT else []
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
        return any(c.id == capsule_id and c.tier != c.TIER_DISK for c in self._call("list_capsules").capsules)

    def adopt(self, capsule_id: str) -> None:
        """Copy the capsule file into the node's own capsule directory and load it."""
        source = self.files.path(capsule_id)
        if source is None:
            raise NotFound(f"no capsule file {capsule_id}.capsule in {self.files.directory}")
        self.capsule_dir.mkdir(mode=0o700, exist_ok=True)
        target = self.capsule_dir / source.name
        shutil.copyfile(source, target)
        os.chmod(target, 0o600)
        self._call("load", capsule_id=capsule_id)

    def close(self) -> None:
        self.proc.stop(timeout=15)
        with contextlib.suppress(Exception):
            self._executor.shutdown(timeout_sec=2.0)
        self._spin.join(timeout=2.0)
        with contextlib.suppress(Exception):
            self.node.destroy_node()
        with contextlib.suppress(Exception):
            self._context.try_shutdown()
