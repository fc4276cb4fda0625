"""Give a vision-language-action policy a new task instruction from a behaviour tree.

:class:`SetTask` publishes the instruction on the policy's task topic (a
``std_msgs/msg/String`` port, docs/vla.md) and succeeds once the node has taken it: its
``~/status`` shows the task port's ``received`` count past what it was when the leaf started.
The new task takes effect at the policy's next chunk, as in LeRobot. A message the node
drops (bytes that are not UTF-8) or no acknowledgement within ``timeout_s`` fails the leaf,
with the reason in ``feedback_message``. A tick never blocks; something must spin the node
(``spin_in_background``), as for the capsule service leaves::

    tree = py_trees.composites.Sequence("NextTask", memory=True, children=[
        SetTask(text="put the cube in the bowl", topic="/task"),
        RunPolicy(...),
    ])

The text comes from ``text`` or, when it is None, from the blackboard key ``text_key``.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import py_trees
from py_trees.common import Access, Status

from capsule_ros.bt.behaviours import DEFAULT_NODE

DEFAULT_TIMEOUT_S = 5.0


class SetTask(py_trees.behaviour.Behaviour):
    """Publish a task instruction and succeed when the policy node has taken it (module docstring)."""

    def __init__(self, name: str = "SetTask", *, text: Optional[str] = None, text_key: str = "/capsule/task",
                 topic: str = "/task", node_path: str = DEFAULT_NODE, port: str = "task",
                 timeout_s: float = DEFAULT_TIMEOUT_S, node: Any = None):
        super().__init__(name)
        self.text, self.text_key, self.topic = text, text_key, topic
        self.node_path, self.port, self.timeout_s = node_path.rstrip("/"), port, timeout_s
        self.node = node
        self._publisher: Any = None
        self._received: Optional[int] = None        # the port's counts in the latest ~/status
        self._dropped: Optional[int] = None
        self._baseline: Optional[tuple] = None
        self._sent = False
        self._started = 0.0
        if text is None:
            self.blackboard = self.attach_blackboard_client(name)
            self.blackboard.register_key(key=text_key, access=Access.READ)

    def setup(self, **kwargs: Any) -> None:
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from std_msgs.msg import String

        from capsule_ros.msg import RuntimeStatus
        node = kwargs.get("node") or self.node
        if node is None:
            raise ValueError(f"{self.name}: pass the rclpy node to the constructor or to setup(node=...)")
        self.node = node
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self._publisher = node.create_publisher(String, self.topic, reliable)
        node.create_subscription(RuntimeStatus, f"{self.node_path}/status", self._on_status, 10)

    def _on_status(self, status: Any) -> None:
        for port in status.ports:
            if port.name == self.port:
                self._received = int(port.received)
                self._dropped = int(port.dropped_type) + int(port.dropped_shape)

    def initialise(self) -> None:
        self._baseline, self._sent, self._started = None, False, time.monotonic()
        self.feedback_message = ""

    def update(self) -> Status:
        if time.monotonic() - self._started > self.timeout_s:
            self.feedback_message = (f"no acknowledgement of the task on port {self.port!r} of {self.node_path} "
                                     f"within {self.timeout_s:g} s")
            return Status.FAILURE
        if not self._sent:
            if self._received is None or self._dropped is None:
                return Status.RUNNING                     # no ~/status yet: nothing to compare with
            from std_msgs.msg import String
            text = self.text if self.text is not None else str(self.blackboard.get(self.text_key))
            self._baseline = (self._received, self._dropped)
            self._publisher.publish(String(data=text))
            self._sent = True
            return Status.RUNNING
        assert self._baseline is not None and self._received is not None and self._dropped is not None
        if self._dropped > self._baseline[1]:
            self.feedback_message = f"the node dropped the task message on port {self.port!r}"
            return Status.FAILURE
        if self._received > self._baseline[0]:
            self.feedback_message = f"task taken by {self.node_path} (port {self.port!r})"
            return Status.SUCCESS
        return Status.RUNNING
