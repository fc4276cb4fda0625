"""The tests' one harness: start the installed executables as processes, a client node
that talks to them over real topics and services, drivers that feed a trigger-mode
policy node like a robot (``Driver``: the arm's joint states and goals; ``FixtureDriver``:
a LeRobot fixture's recorded inputs), parameters, and putting a shared node back as a
fresh one.

Every helper a test module needs is here or in a fixture module (``lerobot_fixtures``,
``onnx_models``, ``runtime_fixtures``: data and models, no ROS); no test module imports
from another (``test_layers.py`` checks it)."""
from __future__ import annotations

import importlib
import os
import queue
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import pytest
from lerobot_fixtures import PORTS, Fixture

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


def unique_ns(prefix: str) -> str:
    """A namespace no other node of this test session uses."""
    return f"/{prefix}{os.getpid() % 1000}{int(time.monotonic() * 1000) % 100000}"


def start_policy_node(tmp_path: Path, params: Optional[Dict[str, Any]] = None, *, namespace: str = "",
                      params_file: Path = DEFAULT_PARAMS, tag: str = "policy") -> ManagedProcess:
    """policy_node with config/policy.yaml plus overrides; capsules in a directory of the test."""
    overrides = deep_merge({"capsules": {"directory": str(tmp_path / f"{tag}-capsules")}}, params or {})
    return processes.start_policy_node(tmp_path, overrides, namespace=namespace, params_file=params_file, tag=tag)


LAUNCH_TOOLING_HINT = ("the ROS 2 launch and command-line tools are not installed: run ./setup.sh (or make test) "
                       "with CAPSULE_ROS_LAUNCH_WHEELS=<directory of the launch wheels>, e.g. "
                       "shared/ros-launch/wheels (see requirements/launch.txt; CI's .ci/run sets it)")


def require_launch_tooling(*modules: str) -> None:
    """The ROS 2 launch / CLI modules a test drives (``ros2launch``, ...): where
    CAPSULE_ROS_LAUNCH_WHEELS asks for them a missing one is an error, elsewhere the test
    skips with how to install them."""
    for module in modules:
        if os.environ.get("CAPSULE_ROS_LAUNCH_WHEELS"):
            importlib.import_module(module)
        else:
            pytest.importorskip(module, reason=LAUNCH_TOOLING_HINT)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """``capsule_ros.polling.wait_until`` with the tests' defaults."""
    return wait_until(predicate, timeout, what, interval)


def spin_until(executor, predicate, timeout: float = 30.0, what: str = "condition") -> None:
    """Spin ``executor`` (whose nodes nothing else spins: a client that takes its answers only
    now) until ``predicate()``; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} (not within {timeout:.0f} s)"
        executor.spin_once(timeout_sec=0.1)


def ctrl_c(proc: subprocess.Popen, log_path: Path, timeout: float = 30.0) -> int:
    """SIGINT to the process group ``proc`` leads (what a terminal's Ctrl-C does); its exit
    status. Fails the test, after SIGKILL to the group, when it has not exited within
    ``timeout`` (its log in the message)."""
    pgid = os.getpgid(proc.pid)
    os.killpg(pgid, signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{proc.args[0]} did not exit within {timeout:.0f} s of Ctrl-C:\n"
                    f"{log_path.read_text(errors='replace')[-4000:]}")


def observations(n: int, seed: int) -> np.ndarray:
    """``n`` joint-state rows (2 positions, 2 velocities), the same for the same seed."""
    return np.random.default_rng(seed).uniform(-1.0, 1.0, size=(n, 4))


def damage_state(path: Path) -> bytes:
    """Flip one bit of the state in a plain capsule file (in its last chunk: the state
    section comes last, after the recipe's, and a chunk's SHA-256 tag is its last 32 bytes);
    the file's bytes before."""
    blob = path.read_bytes()
    damaged = bytearray(blob)
    damaged[-64] ^= 0x10
    path.write_bytes(bytes(damaged))
    return blob


def state_bytes(path: Path, max_bytes: int = 1 << 30) -> bytes:
    """The verified state bytes of a capsule file."""
    from capsule_ros.capsules.fileformat import read_capsule
    return bytes(read_capsule(path, max_bytes=max_bytes)[1].numpy())


def action_bytes(actions: Sequence[Any]) -> List[tuple]:
    """The bits of a list of Action messages: values and chunk (what bit-identity compares)."""
    return [(np.asarray(a.values, np.float32).tobytes(), np.asarray(a.chunk, np.float32).tobytes()) for a in actions]


class ClientNode:
    """An rclpy node spun in a background thread, with helpers to publish, collect
    messages and call the policy node's services."""

    def __init__(self, rclpy_module, name: str = "capsule_test_client", node_path: str = "/capsule_policy",
                 context=None):
        """``context``: an rclpy context of its own (a DDS participant of its own), default the global one."""
        from capsule_ros.ros.client import CapsuleClient
        from capsule_ros.ros.spinning import SpinThread
        self.rclpy = rclpy_module
        self.node = rclpy_module.create_node(name, context=context)
        self.node_path = node_path
        self._spin = SpinThread(self.node, context=context)
        # a call's answer may wait on a node still starting (torch's import, the first bag's
        # writer) on a busy 2-core CI machine: no test measures a call's latency with it
        self.capsules = CapsuleClient(self.node, node_path, server_wait_s=30.0, call_timeout_s=30.0)
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


def set_params(client: ClientNode, node_path: Optional[str] = None, **values: Any) -> list:
    """Set parameters of a node (names with ``__`` for ``.``; the type from the value:
    float, int, bool, str); the SetParametersResult of each."""
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    def value_of(value: Any) -> ParameterValue:
        if isinstance(value, bool):
            return ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=value)
        if isinstance(value, float):
            return ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=value)
        if isinstance(value, int):
            return ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
        return ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=str(value))

    from capsule_ros.ros.client import QUERY_RESEND_S, call_service
    service = client.node.create_client(SetParameters, f"{node_path or client.node_path}/set_parameters")
    try:
        params = [Parameter(name=name.replace("__", "."), value=value_of(v)) for name, v in values.items()]
        # a new client the server may not know yet: setting the same values twice is harmless
        return list(call_service(service, SetParameters.Request(parameters=params), 30.0, 30.0,
                                 resend_s=QUERY_RESEND_S).results)
    finally:
        client.node.destroy_client(service)


def set_params_ok(client: ClientNode, node_path: Optional[str] = None, **values: Any) -> None:
    """``set_params``; every one must be accepted."""
    results = set_params(client, node_path, **values)
    assert all(r.successful for r in results), results


def restore_node(client: ClientNode, params: Mapping[str, Any]) -> None:
    """Put a node shared by a module's tests back as a fresh one comes up on the same
    capsule directory, so each test starts from the same state whatever ran before it: no
    recording, the module's run-time parameters (``params``, names with ``__``), a new
    episode from the initial state, and no capsule in memory but that episode's root. The
    capsule files stay (a fresh node lists them too; the module's fixtures may need them),
    and so do the node's staged inputs and its counters."""
    from capsule_ros.errors import ErrorCode
    stopped = client.capsules.record(False, check=False)
    assert stopped.success or stopped.error_code == ErrorCode.WRONG_STATE, stopped.message
    if params:
        set_params_ok(client, None, **params)
    episode = client.capsules.reset().episode_id
    for capsule in client.capsules.list().capsules:
        if capsule.tier != capsule.TIER_DISK and capsule.label != f"episode {episode} start":
            client.capsules.drop(capsule.id)


class GoalRunner:
    """An ActionClient of a policy node's ~/run_policy with blocking helpers (the client node spins elsewhere)."""

    def __init__(self, client: ClientNode, node_path: str):
        from capsule_ros.action import RunPolicy
        from capsule_ros.ros.messages import action_services_qos
        from capsule_ros.ros.spinning import SpinSafeActionClient
        self.RunPolicy = RunPolicy
        self.action = SpinSafeActionClient(client.node, RunPolicy, f"{node_path}/run_policy", **action_services_qos())
        assert self.action.wait_for_server(timeout_sec=60)
        self.feedback: queue.Queue = queue.Queue()

    def send(self, goal_id: bytes = b"", **goal):
        """Send a goal; its ClientGoalHandle (``accepted`` says whether it was)."""
        from unique_identifier_msgs.msg import UUID
        kwargs = {"goal_uuid": UUID(uuid=list(goal_id))} if goal_id else {}
        future = self.action.send_goal_async(self.RunPolicy.Goal(**goal),
                                             feedback_callback=lambda m: self.feedback.put(m.feedback), **kwargs)
        wait_for(future.done, timeout=30, what="the goal response")
        return future.result()

    @staticmethod
    def result(handle, timeout=30.0):
        future = handle.get_result_async()
        wait_for(future.done, timeout=timeout, what="the result")
        return future.result()

    def collect_feedback(self, count: int, timeout: float = 30.0):
        """The next ``count`` feedback messages and when each arrived (monotonic seconds)."""
        messages, arrived = [], []
        deadline = time.monotonic() + timeout
        while len(messages) < count:
            messages.append(self.feedback.get(timeout=max(deadline - time.monotonic(), 0.01)))
            arrived.append(time.monotonic())
        return messages, arrived

    @staticmethod
    def cancel(handle):
        future = handle.cancel_goal_async()
        wait_for(future.done, timeout=30, what="the cancel response")
        return future.result()


class Driver:
    """Feeds a trigger-mode node one joint-state message at a time, like a robot, and
    collects what it publishes (actions, status, capsule events)."""

    def __init__(self, client: ClientNode, ns: str, depth: int = 2000):
        from geometry_msgs.msg import PointStamped
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import JointState

        from capsule_ros.msg import Action, CapsuleEvent, RuntimeStatus
        reliable = QoSProfile(depth=depth, reliability=ReliabilityPolicy.RELIABLE)
        self.client, self.ns, self.capsules = client, ns, client.capsules
        self.JointState, self.PointStamped = JointState, PointStamped
        self.actions = client.subscribe(Action, f"{ns}/capsule_policy/action", reliable)
        self.status = client.subscribe(RuntimeStatus, f"{ns}/capsule_policy/status")
        self.events = client.subscribe(CapsuleEvent, f"{ns}/capsule_policy/capsule_events", reliable)
        self.joints_pub = client.publisher(JointState, f"{ns}/arm/joint_states", reliable)
        self.goal_pub = client.publisher(PointStamped, f"{ns}/arm/goal", reliable)
        self.stamp = 1
        self.goals_sent = 0
        client.wait_for_subscribers(self.joints_pub)
        client.wait_for_subscribers(self.goal_pub)

    def latest_status(self, timeout: float = 10.0):
        """A status published after this call (the queue may hold older ones)."""
        ClientNode.drain(self.status)
        return self.status.get(timeout=timeout)

    def port(self, name: str, timeout: float = 10.0):
        """The latest status of port ``name``."""
        return next(p for p in self.latest_status(timeout).ports if p.name == name)

    def send_goal(self, x: float = 0.3, y: float = 0.4, *, wait: bool = True) -> None:
        """Publish a goal; with ``wait``, until the node took it (topics are not ordered
        between them, and a step needs every input)."""
        msg = self.PointStamped()
        msg.header.stamp.sec = self.stamp
        msg.point.x, msg.point.y = float(x), float(y)
        self.goal_pub.publish(msg)
        self.goals_sent += 1
        if wait:
            wait_for(lambda: self.port("goal").received >= self.goals_sent, timeout=60, what="the goal to be taken")

    def joint_msg(self, values, stamp: Optional[int] = None):
        msg = self.JointState()
        if stamp is None:
            self.stamp += 1
            stamp = self.stamp
        msg.header.stamp.sec = int(stamp)
        msg.name = ["shoulder", "elbow"]
        msg.position = [float(values[0]), float(values[1])]
        msg.velocity = [float(values[2]), float(values[3])]
        return msg

    def step(self, values, timeout: float = 30.0, expect_action: bool = True):
        """Publish one joint state; the action it triggered. ``expect_action=False``: the
        node counted the message and published nothing for it (returns None)."""
        ClientNode.drain(self.actions)
        if not expect_action:
            before = self.port("joints").received
            published = self.latest_status().actions_published
        self.joints_pub.publish(self.joint_msg(values))
        if expect_action:
            return self.actions.get(timeout=timeout)
        wait_for(lambda: self.port("joints").received > before, timeout=timeout, what="the joint state to be taken")
        assert self.latest_status().actions_published == published, "an action came of it"
        return None

    def run(self, observations, expect_action: bool = True) -> list:
        return [self.step(o, expect_action=expect_action) for o in observations]


class FixtureDriver:
    """Publishes one step of a fixture's inputs at a time: the non-trigger ports first,
    each acknowledged in ~/status (topics are not ordered between them), then the joint
    state that triggers the step; returns the action it triggered."""

    def __init__(self, client: ClientNode, ns: str, fixture: Fixture):
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import Float32MultiArray

        from capsule_ros.msg import Action, RuntimeStatus
        reliable = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
        self.client, self.capsules, self.fixture = client, client.capsules, fixture
        self.actions = client.subscribe(Action, f"{ns}/capsule_policy/action", reliable)
        self.status = client.subscribe(RuntimeStatus, f"{ns}/capsule_policy/status")
        types = {"sensor_msgs/msg/Image": Image, "sensor_msgs/msg/JointState": JointState,
                 "std_msgs/msg/Float32MultiArray": Float32MultiArray}
        params = fixture.node_params()["ports"]
        self.publishers = {PORTS[key]: client.publisher(types[params[PORTS[key]]["type"]],
                                                        f"{ns}/{params[PORTS[key]]['topic']}", reliable)
                           for key in fixture.features}
        for publisher in self.publishers.values():
            client.wait_for_subscribers(publisher)
        self.sent = dict.fromkeys(self.publishers, 0)
        self.stamp = 0

    def message(self, port: str, value: np.ndarray):
        self.stamp += 1
        msg = self.publishers[port].msg_type()
        if port == "front_camera":
            msg.header.stamp.sec = self.stamp
            msg.height, msg.width = int(value.shape[0]), int(value.shape[1])
            msg.encoding, msg.step = "rgb8", int(value.shape[1]) * 3
            msg.data = value.tobytes()
        elif port == "joints":
            msg.header.stamp.sec = self.stamp
            msg.name = [f"j{i}" for i in range(value.shape[0])]
            msg.position = [float(v) for v in value]
        else:
            msg.data = [float(v) for v in value]
        return msg

    def _acknowledged(self, port: str) -> bool:
        return any(p.name == port and p.received >= self.sent[port]
                   for s in self.client.drain(self.status) for p in s.ports)

    def step(self, episode: int, t: int):
        for key, values in self.fixture.features.items():
            port = PORTS[key]
            if port == "joints":
                continue
            self.publishers[port].publish(self.message(port, values[episode, t]))
            self.sent[port] += 1
            wait_for(lambda port=port: self._acknowledged(port), timeout=30, what=f"the node to take {port}")
        self.client.drain(self.actions)
        state = self.fixture.features["observation.state"][episode, t]
        self.publishers["joints"].publish(self.message("joints", state))
        self.sent["joints"] += 1
        return self.actions.get(timeout=60)

    def run(self, steps: range, episode: int = 0) -> list:
        return [self.step(episode, t) for t in steps]


def timeline_repeats(log: Sequence[tuple]) -> int:
    """How many policy actions of a run's ``log`` (("step", (t, Action)) entries among the
    capsule verbs') came at a step index reached before, each asserted to equal the first
    action at that index bit for bit (safe actions are timing events, not the timeline)."""
    first: Dict[int, bytes] = {}
    repeated = 0
    for kind, entry in log:
        if kind != "step":
            continue
        t, action = entry
        if action.source != action.SOURCE_POLICY:
            continue
        values = np.asarray(action.values, np.float32).tobytes()
        if t in first:
            assert values == first[t], t
            repeated += 1
        else:
            first[t] = values
    return repeated


def write_sensor_bag(path: Path, messages: Sequence[tuple], storage: str = "mcap") -> Path:
    """A rosbag2 bag of sensor messages, ``(topic, message type, rclpy message, log time
    ns)`` each (times increasing), as a robot or simulator would have recorded them."""
    from rclpy.serialization import serialize_message

    from capsule_ros.bag.recorder import BagWriter
    from capsule_ros.bag.typestore import build_typestore
    with BagWriter(path, storage, build_typestore()) as writer:
        for topic, msgtype, msg, log_time in messages:
            writer.write(topic, msgtype, serialize_message(msg), log_time)
    return path


class ClockedBagPlayer:
    """Plays a rosbag2 bag as ``ros2 bag play --clock --loop`` does (``ros2 bag`` is not in
    the ROS 2 wheels): every message at its log time, as recorded (raw CDR) on its topic,
    with ``/clock`` set to that log time just before it, at the recorded pace, loop after
    loop, so that the simulated clock jumps back to the bag's start at every new loop."""

    def __init__(self, client: ClientNode, bag: Path, topic_prefix: str = ""):
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from rosbags.rosbag2 import Reader
        from rosgraph_msgs.msg import Clock

        from capsule_ros.ros.robot_io import message_class
        self.client, self.Clock = client, Clock
        with Reader(bag) as reader:
            self.entries = [(conn.topic, time, bytes(data)) for conn, time, data in reader.messages()]
            types = {conn.topic: conn.msgtype for conn in reader.connections}
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.publishers = {topic: client.publisher(message_class(msgtype), topic_prefix + topic, reliable)
                           for topic, msgtype in types.items()}
        self.clock = client.publisher(Clock, "/clock", reliable)
        self.start_ns, self.end_ns = self.entries[0][1], self.entries[-1][1]

    def wait_for_node(self, status_queue: queue.Queue, timeout: float = 60.0) -> None:
        """Until the node's clock shows the bag's start: ``/clock`` at the start, again and
        again, until a ``~/status`` (stamped with the node's clock) says so."""
        for publisher in [self.clock, *self.publishers.values()]:
            self.client.wait_for_subscribers(publisher)

        def node_at_start() -> bool:
            self.publish_clock(self.start_ns)
            return any(_stamp_ns(s.header.stamp) >= self.start_ns for s in ClientNode.drain(status_queue))
        wait_for(node_at_start, timeout=timeout, interval=0.1, what="the node's clock at the bag's start")

    def publish_clock(self, time_ns: int) -> None:
        msg = self.Clock()
        msg.clock.sec, msg.clock.nanosec = divmod(int(time_ns), 1_000_000_000)
        self.clock.publish(msg)

    def play(self, loops: int, topics_after_first_loop: Optional[Sequence[str]] = None) -> None:
        """``loops`` times through the bag; from the second loop on only ``topics_after_first_loop``
        (None: all of them), as if the other sensors had stopped."""
        for loop in range(loops):
            began = time.monotonic()
            for topic, time_ns, data in self.entries:
                if loop and topics_after_first_loop is not None and topic not in topics_after_first_loop:
                    continue
                pause = began + (time_ns - self.start_ns) / 1e9 - time.monotonic()
                if pause > 0:
                    time.sleep(pause)                   # the bag's own pace, not a wait for anything
                self.publish_clock(time_ns)
                self.publishers[topic].publish(data)


def _stamp_ns(stamp: Any) -> int:
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def retag(path: Path, edit_header=None, recipe: Optional[bytes] = None) -> None:
    """Rewrite a plain capsule file as anyone can (its tags carry no secret): the header
    object changed by ``edit_header`` (a function of the dict), the recipe section's
    bytes replaced by ``recipe``, then the header digest and every chunk tag computed
    again. Written from the byte table of docs/capsule-format.md, not with the package's
    writer (which refuses what it would not write)."""
    import hashlib
    import json
    import struct
    blob = path.read_bytes()
    magic, version, flags, json_len = struct.unpack_from("<8sHHI", blob)
    assert flags == 0 and version == 2, "retag rewrites plain version 2 files"
    header = json.loads(blob[16:16 + json_len])
    chunk = header["chunk_bytes"]
    offset = 16 + json_len + 32

    def section(nbytes: int) -> bytes:
        nonlocal offset
        out = bytearray()
        while len(out) < nbytes:
            n = min(chunk, nbytes - len(out))
            out += blob[offset:offset + n]
            offset += n + 32
        return bytes(out)
    recipe_info = header.get("recipe")
    old_recipe = section(recipe_info["nbytes"] if recipe_info else 0)
    state = section(header["nbytes"])
    if edit_header is not None:
        edit_header(header)
    body = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    prefix = struct.pack("<8sHHI", magic, version, flags, len(body)) + body
    digest = hashlib.sha256(prefix).digest()
    out = bytearray(prefix + digest)
    for number, data in ((1, old_recipe if recipe is None else recipe), (0, state)):
        count = -(-len(data) // chunk)
        for index in range(count):
            piece = data[index * chunk:(index + 1) * chunk]
            aad = digest + struct.pack("<BQB", number, index, 1 if index == count - 1 else 0)
            out += piece + hashlib.sha256(aad + piece).digest()
    path.write_bytes(bytes(out))


def recipe_section(path: Path) -> bytes:
    """The recipe section's bytes of a plain capsule file (its tags stripped)."""
    import json
    import struct
    blob = path.read_bytes()
    json_len = struct.unpack_from("<8sHHI", blob)[3]
    header = json.loads(blob[16:16 + json_len])
    nbytes, chunk, offset, out = header["recipe"]["nbytes"], header["chunk_bytes"], 16 + json_len + 32, bytearray()
    while len(out) < nbytes:
        n = min(chunk, nbytes - len(out))
        out += blob[offset:offset + n]
        offset += n + 32
    return bytes(out)
