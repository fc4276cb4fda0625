"""What the policy node sends out: actions (``~/action`` and the command outputs) and
its recording (``~/record``, ``record.enabled``).

``ActionOutput`` publishes a session's ``ActionRecord`` from whichever thread has one (the
control loop, the deadline watchdog, a service's interrupt); ``NodeRecording`` writes the
node's inputs, actions and capsule events into a rosbag2 while a recording runs. Both
are parts of ``PolicyNode`` (``capsule_ros.ros.node``); the facade its servers use
(``capsule_ros.ros.facade``) reaches them, never the node.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from rclpy.clock import Clock
from rclpy.node import Node
from rclpy.serialization import serialize_message

from capsule_ros.errors import WrongState
from capsule_ros.msg import Action
from capsule_ros.ros.messages import action_message
from capsule_ros.ros.outputs import OutputPublisher
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.outputs import OutputAdapter, OutputConfig
from capsule_ros.serving.records import ActionRecord, RecordResult


class NodeRecording:
    """The node's recording: a ``capsule_ros.bag.recorder.NodeRecorder`` while one runs,
    and the last accepted message of every port, which a new recording writes first (the
    inputs the next step will use).

    Log times are the node's clock, plus the jumps it made since the recording began
    (``clock_jumped``): a simulated clock that loops back 10 s would otherwise squeeze the
    next 10 s of messages into nanoseconds (log times must increase). A replay takes the
    jumps back out where the bag's CLOCK_JUMP events say, and sees the node's clock.

    A fleet robot's recording (``fleet``: ``capsule_ros.fleet.replay.fleet_record``) carries
    the robot's place in its fleet in the bag's metadata, and a new bag goes under
    ``<record.directory>/<robot>``: the robots of a fleet start theirs at once."""

    def __init__(self, node: Node, action_topic: str, event_topic: str, clock: Optional[Clock] = None):
        self._clock = clock or node.get_clock()
        self._logger = node.get_logger()
        self.action_topic, self.event_topic = action_topic, event_topic
        self.fleet: Dict[str, Any] = {}                               # a fleet robot's place (set by fleet_node)
        self.recorder: Any = None                                     # a NodeRecorder while recording
        self._last_inputs: Dict[str, Tuple[str, str, Any]] = {}       # port -> (topic, type, message)
        self._jumped_ns = 0                                           # minus the clock's jumps while recording

    @property
    def active(self) -> bool:
        return self.recorder is not None

    def start(self, config: ServingConfig, fingerprint: str, path: str = "", storage: str = "") -> Path:
        """A new bag (``path`` "" = a new one under ``record.directory``), stopping a
        running recording first; the last accepted message of every port goes in first."""
        from capsule_ros.bag.recorder import NodeRecorder
        if self.recorder is not None:
            self.stop()
        self._jumped_ns = 0
        directory = config.record.directory
        if self.fleet:
            directory = str(Path(directory).expanduser() / str(self.fleet["robot"]))
        self.recorder = NodeRecorder.start(path, directory, storage or config.record.storage, config,
                                           self.action_topic, self.event_topic, fingerprint=fingerprint,
                                           initial_inputs=len(self._last_inputs), serialize=serialize_message,
                                           fleet=self.fleet or None)
        for topic, msgtype, msg in self._last_inputs.values():
            self._write_input(topic, msgtype, msg)
        self._logger.info(f"recording to {self.recorder.path}")
        return Path(self.recorder.path)

    def stop(self) -> RecordResult:
        """Close the bag; WRONG_STATE when not recording."""
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            raise WrongState("not recording")
        count = recorder.close()
        return RecordResult(str(recorder.path), count)

    def received(self, topic: str, msgtype: str, msg: Any) -> None:
        """A sensor message as it came, before the session takes it (``topic``: resolved, remaps applied)."""
        if self.recorder is not None:
            self._write_input(topic, msgtype, msg)

    def accepted(self, port: str, topic: str, msgtype: str, msg: Any) -> None:
        """The session staged it: the latest value of ``port`` for the next recording's start."""
        self._last_inputs[port] = (topic, msgtype, msg)

    def published(self, topic: str, msg: Any) -> None:
        """A message the node published (an action, a capsule event)."""
        recorder = self.recorder
        if recorder is not None:
            recorder.write_message(topic, msg, self._log_time())

    def clock_jumped(self, delta_ns: int) -> None:
        """The node's clock jumped by ``delta_ns``: later log times go on from where they were."""
        self._jumped_ns -= delta_ns

    def forget_inputs(self) -> None:
        """Lifecycle cleanup: the ports go, and their last values with them."""
        self._last_inputs.clear()

    def _write_input(self, topic: str, msgtype: str, msg: Any) -> None:
        """CDR serialisation is deterministic, so these are the bytes as received."""
        self.recorder.write_raw(topic, msgtype, serialize_message(msg), self._log_time())


    def _log_time(self) -> int:
        return self._clock.now().nanoseconds + self._jumped_ns


class ActionOutput:
    """Actions out: ``~/action``, the command outputs beside it (``serving/outputs.py``) and
    the recording; from any thread (one lock orders them). It counts what it published
    (``~/status`` actions_published) and keeps the last message (RunPolicy feedback)."""

    def __init__(self, node: Node, clock: Optional[Clock] = None):
        self._node = node
        self._clock = clock or node.get_clock()
        self.recording: Optional[NodeRecording] = None      # set by the node
        self.publisher = node.create_publisher(Action, "~/action", 10)
        self.outputs: List[OutputPublisher] = []
        self.published = 0
        self.last: Optional[Action] = None
        self._lock = threading.Lock()

    def add_outputs(self, adapters: List[OutputAdapter]) -> None:
        """A publisher per configured output (activate)."""
        self.outputs = [OutputPublisher(self._node, adapter) for adapter in adapters]

    def remove_outputs(self) -> None:
        """Lifecycle cleanup: the outputs' publishers go."""
        for output in self.outputs:
            self._node.destroy_publisher(output.publisher)
        self.outputs = []

    def retune(self, configs: Mapping[str, OutputConfig], time_steps: Mapping[str, float]) -> None:
        """Run-time settings of the outputs and their point spacing, by output name (a
        parameter change; ``capsule_ros.serving.outputs.point_spacing`` checked them)."""
        with self._lock:
            for output in self.outputs:
                name = output.adapter.name
                output.adapter.retune(configs[name], time_steps[name])

    def publish(self, record: ActionRecord, frame_id: str, action_dim: int) -> None:
        """``record`` on ~/action and every output, and into the recording."""
        msg = action_message(record, frame_id, action_dim)
        with self._lock:
            self.publisher.publish(msg)
            self.published += 1
            self.last = msg
            if self.outputs:
                now_ns = self._clock.now().nanoseconds
                for output in self.outputs:
                    output.publish(record, now_ns)
        if self.recording is not None:
            self.recording.published(self.publisher.topic_name, msg)
