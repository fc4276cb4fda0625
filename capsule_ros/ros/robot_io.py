"""``RobotIO``: ``policy_node``'s interface of one robot on an rclpy node, shared by
``policy_node`` (one robot, on the lifecycle node itself) and ``fleet_node`` (a robot per
namespace, each on a node of its own; docs/fleet.md).

What one robot offers: ``~/action`` and the command outputs, ``~/capsule_events``,
``~/status`` and ``/diagnostics``, the recording (``~/record``, ``record.enabled``), the
capsule services and ``~/run_policy`` (through its ``NodeFacade``), and a subscription per
sensor port. Which session serves it, when it steps and the lifecycle are the owner's:
the owning node sets ``facade.session`` / ``config`` / ``active`` as its transitions run,
hands each sensor message to ``feed`` with the loop that takes it (a ``SessionLoop`` or a
fleet robot's ``RobotLoop``) and each action record to ``after_tick``.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.clock import Clock
from rclpy.node import Node

from capsule_ros.msg import CapsuleEvent, RuntimeStatus
from capsule_ros.ros.capsule_services import CapsuleServices
from capsule_ros.ros.facade import NodeFacade
from capsule_ros.ros.messages import event_message
from capsule_ros.ros.outputs import qos_profile
from capsule_ros.ros.publishing import ActionOutput, NodeRecording
from capsule_ros.ros.run_policy import RunPolicyServer
from capsule_ros.ros.spinning import Offload
from capsule_ros.ros.status import DiagnosticsBuilder, runtime_status
from capsule_ros.serving.config import ControlConfig, PortConfig, ServingConfig
from capsule_ros.serving.loop import Fed
from capsule_ros.serving.outputs import OutputAdapter
from capsule_ros.serving.ports import TEXT_TYPE
from capsule_ros.serving.records import ActionRecord, EventKind, EventRecord, clock_jump_delta

OnPortMessage = Callable[[str, str, Any], None]       # (port, message type, message)


def message_class(type_name: str) -> Any:
    package, _, name = type_name.split("/")
    return getattr(importlib.import_module(f"{package}.msg"), name)


def control_period(control: ControlConfig) -> Optional[float]:
    """Seconds between steps in timer mode; None in trigger mode."""
    return 1.0 / control.rate_hz if control.mode == "timer" else None


class RobotIO:
    """See the module docstring. ``clock``: the clock the robot's session lives on (its
    events' stamps, the recording's log times, the outputs' stamps); default the node's."""

    def __init__(self, node: Node, service_threads: Offload, service_group: Any, control_group: Any,
                 clock: Optional[Clock] = None):
        self.node = node
        self.clock = clock or node.get_clock()
        self.event_pub = node.create_publisher(CapsuleEvent, "~/capsule_events", 100)
        self.status_pub = node.create_publisher(RuntimeStatus, "~/status", 10)
        self.diag_pub = node.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.actions = ActionOutput(node, self.clock)
        self.recording = NodeRecording(node, self.actions.publisher.topic_name, self.event_pub.topic_name, self.clock)
        self.actions.recording = self.recording
        self.facade = NodeFacade(node.get_logger(), self.actions, self.recording)
        self.capsule_services: Optional[CapsuleServices] = None      # offer_servers()
        self.run_policy: Optional[RunPolicyServer] = None
        self.action_dim = 0                                          # the served runtime's (serve)
        self._service_threads = service_threads
        self._service_group = service_group
        self._control_group = control_group
        self._port_subscriptions: Dict[str, Any] = {}
        self._diagnostics = DiagnosticsBuilder(node.get_fully_qualified_name())

    def offer_servers(self) -> None:
        """The capsule services and ``~/run_policy`` (once; they answer WRONG_STATE unless active)."""
        if self.capsule_services is None:
            self.capsule_services = CapsuleServices(self.node, self.facade, self._service_threads,
                                                    self._service_group)
            self.run_policy = RunPolicyServer(self.node, self.facade, self._service_group)

    # -- the lifecycle (the owner's transitions) ---------------------------------------------------
    def serve(self, session: Any, config: ServingConfig, action_dim: int) -> None:
        """Activate, first time: the robot's session (a ``PolicySession``) and its outputs."""
        self.action_dim = action_dim
        self.actions.add_outputs([OutputAdapter(name, output, action_dim, control_period(config.control))
                                  for name, output in config.outputs.items()])
        self.facade.session, self.facade.config = session, config

    def deactivated(self, capsule: Any) -> None:
        """The owner's deactivate interrupted the episode with ``capsule``: a running goal ends."""
        self.facade.active, self.facade.lifecycle_state = False, "inactive"
        self.unsubscribe_ports()
        if self.run_policy is not None:
            self.run_policy.node_deactivated(capsule)

    def release(self) -> None:
        """Cleanup: no session, no outputs, no recording, no ports (and their last values)."""
        self.unsubscribe_ports()
        self.facade.active, self.facade.lifecycle_state = False, "unconfigured"
        if self.recording.active:
            self.recording.stop()
        self.recording.forget_inputs()
        self.actions.remove_outputs()
        self.facade.session, self.facade.config = None, None

    def close_servers(self) -> None:
        """Process exit (after the executor stopped, the service threads joined): the
        verbs are refused, a running goal ends (ABORTED) and its worker is joined."""
        self.facade.active = False
        if self.run_policy is not None:
            self.run_policy.close()

    def close_recording(self) -> None:
        """Process exit, once nothing publishes any more: the bag is closed."""
        if self.recording.active:
            self.recording.stop()

    # -- sensor ports -----------------------------------------------------------------------------
    def subscribe_ports(self, config: ServingConfig, on_message: OnPortMessage) -> None:
        """One subscription per port. The trigger port subscribes last: when a goal and a
        joint state wait at once, the executor takes them in subscription order, so the step
        sees the goal that came with it (clients wait for the goal's acknowledgement before
        the joint state)."""
        trigger = config.control.trigger_port if config.control.mode == "trigger" else ""
        ordered = sorted(config.ports.items(), key=lambda item: item[0] == trigger)
        self._port_subscriptions = {name: self._subscribe(name, port, on_message) for name, port in ordered}

    def _subscribe(self, name: str, port: PortConfig, on_message: OnPortMessage) -> Any:
        """A text port subscribes raw: its adapter decodes the bytes itself (``serving/ports.py``)."""
        def callback(msg: Any) -> None:
            on_message(name, port.type, msg)
        return self.node.create_subscription(message_class(port.type), port.topic, callback,
                                             qos_profile(port.qos, port.depth), callback_group=self._control_group,
                                             raw=port.type == TEXT_TYPE)

    def unsubscribe_ports(self) -> None:
        for subscription in self._port_subscriptions.values():
            self.node.destroy_subscription(subscription)
        self._port_subscriptions = {}

    def feed(self, loop: Any, name: str, msgtype: str, msg: Any, now_ns: int) -> Fed:
        """A sensor message: into the recording as it came, then to ``loop`` (the session's
        or the fleet robot's), which stages it (or drops and counts it) and, on the trigger
        port in trigger mode, steps or asks for a step."""
        topic = self._port_subscriptions[name].topic_name
        with loop.receiving():                      # a fleet robot's waiting step first: its action before the message
            now = loop.observe_clock(now_ns)        # a jump it finds goes first in a bag
            self.recording.received(topic, msgtype, msg)
            fed = loop.feed(name, msg, now)
        if fed.accepted:
            self.recording.accepted(name, topic, msgtype, msg)
        return fed

    # -- actions and events -----------------------------------------------------------------------
    def after_tick(self, record: Optional[ActionRecord]) -> None:
        """Publish what a tick handed out (the session decided whether that is the policy's
        action or the safe one) and tell a running goal."""
        if record is None:
            return
        if not record.published:
            self.publish_action(record)
        if self.run_policy is not None:
            self.run_policy.after_action(record)

    def publish_action(self, record: ActionRecord) -> None:
        """~/action, the outputs and the recording; any thread (control loop, watchdog,
        whichever thread interrupted)."""
        config = self.facade.config
        assert config is not None
        self.actions.publish(record, config.control.frame_id, self.action_dim)

    def on_event(self, event: EventRecord) -> None:
        """A capsule event (emitted under the session's boundary): published and recorded;
        an INTERRUPT also publishes the hold mode's safe action, whoever interrupted (a
        service, a RunPolicy run ending, deactivate); a CLOCK_JUMP moves the recording's
        log times on across the jump."""
        msg = event_message(event, self.clock.now().nanoseconds)
        if event.kind == EventKind.CLOCK_JUMP:
            self.recording.clock_jumped(clock_jump_delta(event.detail))   # its log time goes on across it
        self.event_pub.publish(msg)
        self.recording.published(self.event_pub.topic_name, msg)
        if event.kind == EventKind.INTERRUPT and event.action is not None:
            self.publish_action(event.action)

    # -- status -----------------------------------------------------------------------------------
    def publish_status(self) -> None:
        """``~/status`` and ``/diagnostics`` from the session's ``status()``."""
        session = self.facade.session
        if session is None:
            return
        stamp = self.clock.now().to_msg()
        status = runtime_status(session.status(), stamp)
        status.lifecycle_state = "active" if self.facade.active else "inactive"
        status.actions_published = self.actions.published
        self.status_pub.publish(status)
        self.diag_pub.publish(self._diagnostics.build(status, stamp))
