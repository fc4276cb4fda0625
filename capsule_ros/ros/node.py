"""PolicyNode: the ROS 2 face of a PolicySession (a thin layer: topics, services and an
action in, session verbs out), managed by the standard ROS 2 lifecycle.

Lifecycle (``~/change_state``, ``~/get_state``; ``lifecycle.autostart`` runs configure and
activate at start-up so one command serves):

- configure: parameters validated, the policy built on the CPU with its weights, the
  layout and fingerprint computed, the capsule directory opened. No device memory yet; a
  bad configuration fails the transition with its reason (logged).
- activate: the runtime on its device (arena, capture, warm-up: the first active step is
  not a cold one), capsule pools, then subscriptions and stepping. After a deactivate it
  resumes the interrupted episode from the capsule the deactivate committed.
- deactivate: stepping stops at a boundary; a running episode is interrupted (safe action
  published, boundary capsule committed); the state is kept.
- cleanup: the runtime and the capsule pools are released (on CUDA the memory goes back
  to the driver); capsule files stay.
- shutdown: deactivate and cleanup as needed.

Capsule services and ``~/run_policy`` answer WRONG_STATE (a REJECTED result) unless active.

Threads and callback groups. Sensor subscriptions, the trigger and the control timer
share one mutually exclusive *control* group, run by the executor's thread: steps never
overlap and a sensor message reaches the policy with no thread hand-off. Services have
their own group and are coroutines that hand the work to a small pool of service
threads and await it, so a service (a slow save, a recompute) never holds up the control
loop, several services run side by side, and each reaches the session between steps
through its boundary lock (it waits behind at most one step). A RunPolicy goal runs on
its own worker thread. Status has a third group. Lifecycle transitions run on the
executor's thread, so no step is in progress while one runs.

Why not rclpy's MultiThreadedExecutor: it hands every callback to a thread pool and
spins while a group is busy; measured on the 2-core CI machine (`capsule-ros bench
loop`) it added ~3.8 ms at p50 and ~140 ms at p99 to the sensor-to-action path of the
default policy. ``policy_node`` spins this node on a SingleThreadedExecutor; the service
threads give the concurrency the services need.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.serialization import serialize_message

from capsule_ros.config import flatten, unflatten
from capsule_ros.errors import CapsuleRosError, ConfigError, WrongState
from capsule_ros.msg import Action, CapsuleEvent, RuntimeStatus
from capsule_ros.ros.capsule_services import CapsuleServices
from capsule_ros.ros.log_bridge import RosLogBridge
from capsule_ros.ros.messages import action_message, event_message
from capsule_ros.ros.outputs import OutputPublisher, qos_profile
from capsule_ros.ros.params import declare_parameters, parameter_values
from capsule_ros.ros.run_policy import RunPolicyServer
from capsule_ros.ros.spinning import Offload
from capsule_ros.ros.status import DiagnosticsBuilder, runtime_status
from capsule_ros.runtime.engine import StreamKeeper, release_device_memory
from capsule_ros.serving.config import ControlConfig, PortConfig, ServingConfig
from capsule_ros.serving.factory import PreparedServing, prepare_serving, start_session
from capsule_ros.serving.outputs import OutputAdapter
from capsule_ros.serving.ports import PortDrop, stamp_ns
from capsule_ros.serving.process import settle_after_start, unsettle
from capsule_ros.serving.records import ActionRecord, ActionSource, EpisodeState, EventRecord, HoldMode
from capsule_ros.serving.session import PolicySession

LOG = logging.getLogger(__name__)
WARN_PERIOD_S = 5.0
TRANSITION_BOUNDARY_S = 5.0     # how long deactivate / cleanup wait for a service to leave the session


def message_class(type_name: str):
    package, _, name = type_name.split("/")
    return getattr(importlib.import_module(f"{package}.msg"), name)


def control_period(control: ControlConfig) -> Optional[float]:
    """Seconds between steps in timer mode; None in trigger mode."""
    return 1.0 / control.rate_hz if control.mode == "timer" else None


class PolicyNode(LifecycleNode):
    """See the module docstring."""

    def __init__(self, node_name: str = "capsule_policy", **kwargs: Any):
        super().__init__(node_name, **kwargs)
        declare_parameters(self)
        self.config: Optional[ServingConfig] = None
        self.session: Optional[PolicySession] = None
        self.recorder = None
        self.last_action: Optional[Action] = None
        self.transition_error: Optional[BaseException] = None     # why the last transition failed
        self._prepared: Optional[PreparedServing] = None
        self._active = False
        self._resume_on_activate = False
        self._settled = False
        self._streams = StreamKeeper()             # one CUDA stream across activations (StreamKeeper says why)
        self._raise_transition_errors = False
        self._control_group = MutuallyExclusiveCallbackGroup()
        # services may run side by side (a slow save must not hold up a commit); the session's
        # boundary lock orders what touches the state
        self._service_group = ReentrantCallbackGroup()
        self._status_group = MutuallyExclusiveCallbackGroup()
        self._service_threads = Offload(self, 4, "capsule-service")
        self.action_pub = self.create_publisher(Action, "~/action", 10)
        self.event_pub = self.create_publisher(CapsuleEvent, "~/capsule_events", 100)
        self.status_pub = self.create_publisher(RuntimeStatus, "~/status", 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._published_lock = threading.Lock()
        self._actions_published = 0
        self._outputs: List[OutputPublisher] = []
        self._port_subscriptions: Dict[str, Any] = {}
        self._last_port_messages: Dict[str, Any] = {}     # written first into a new recording
        self._control_timer = None
        self._status_timer = None
        self._last_warn: Dict[str, float] = {}
        self._diagnostics = DiagnosticsBuilder(self.get_fully_qualified_name())
        self._log_bridge = RosLogBridge.install(self.get_logger())
        self.capsule_services = CapsuleServices(self, self._service_threads, self._service_group)
        self.run_policy = RunPolicyServer(self, self._service_group)
        self.add_on_set_parameters_callback(self._on_set_parameters)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """``lifecycle.autostart``: configure and activate now. A failure raises the
        transition's error (``policy_node`` exits 2 with it); otherwise the node waits
        unconfigured for a lifecycle manager."""
        if not self.get_parameter("lifecycle.autostart").value:
            self.get_logger().info("unconfigured: waiting for configure and activate (~/change_state)")
            return
        self._raise_transition_errors = True           # the caller reports them (one line, exit 2)
        try:
            for trigger in (self.trigger_configure, self.trigger_activate):
                if trigger() != TransitionCallbackReturn.SUCCESS:
                    raise self.transition_error or CapsuleRosError(f"{trigger.__name__} failed")
        finally:
            self._raise_transition_errors = False

    @property
    def active(self) -> bool:
        return self._active

    def active_session(self) -> PolicySession:
        """The session, when the node is active; else WRONG_STATE."""
        session = self.session
        if not self._active or session is None:
            raise WrongState(f"the node is {self._state_machine.current_state[1]}, not active: capsule services "
                             "and goals are answered once it is activated (lifecycle ~/change_state)")
        return session

    def _transition(self, name: str, work: Callable[[], None]) -> TransitionCallbackReturn:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - a failed transition reports why, the node keeps running
            self.transition_error = exc
            if not self._raise_transition_errors:
                self.get_logger().error(f"{name} failed: {type(exc).__name__}: {exc}")
            return TransitionCallbackReturn.FAILURE
        self.transition_error = None
        return TransitionCallbackReturn.SUCCESS

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition("configure", self._configure)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition("activate", self._activate)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition("deactivate", self._deactivate)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition("cleanup", self._cleanup)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        def shutdown() -> None:
            if self._active:
                self._deactivate()
            self._cleanup()
        return self._transition("shutdown", shutdown)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition("error recovery", self._cleanup)     # back to unconfigured

    def _configure(self) -> None:
        config = ServingConfig.from_params(parameter_values(self), source="ROS parameters")
        prepared = prepare_serving(config, node_name=self.get_fully_qualified_name())
        if prepared.directory is not None and prepared.directory.recovered:
            self.get_logger().warning(f"moved {len(prepared.directory.recovered)} unfinished capsule save(s) "
                                      f"aside: {[str(p) for p in prepared.directory.recovered]}")
        self.config, self._prepared = config, prepared
        self.get_logger().info(f"configured: policy {config.policy.kind}, ports {list(config.ports)}, "
                               f"fingerprint {prepared.fingerprint[:12]}")

    def _activate(self) -> None:
        config = self.config
        assert config is not None
        if self.session is None:
            assert self._prepared is not None
            session = start_session(self._prepared, on_event=self._on_event, streams=self._streams)
            # an auto inference delay is fixed now: the recorded and reported config carries the number
            config = self.config = dataclasses.replace(config, control=session.control)
            session.clock_ns = lambda: self.get_clock().now().nanoseconds
            action_dim = session.runtime.policy.action_dim
            period = control_period(config.control)
            self._outputs = [OutputPublisher(self, OutputAdapter(name, output, action_dim, period))
                             for name, output in config.outputs.items()]
            session.start_watchdog(self._publish_action)   # a step over its deadline: the safe action at once
            self.session, self._prepared = session, None
            self._status_timer = self.create_timer(1.0 / config.control.status_rate_hz, self._publish_status,
                                                   callback_group=self._status_group)
            if config.record.enabled:
                self._start_recording(session, "", config.record.storage)
        elif self._resume_on_activate:
            self.session.reenter("")
        self._resume_on_activate = False
        if not self._settled:
            settle_after_start()                       # no multi-ms garbage collections during the loop
            self._settled = True
        session = self.session
        session.warm_up()                              # the first active step is not a cold one
        self._subscribe_ports(config)
        self._configure_loop(config.control)
        self._active = True
        self.get_logger().info(
            f"serving on {session.runtime.device} ({'CUDA graph' if session.runtime.plan.captured else 'eager'}),"
            f" {config.control.mode} mode, episode {session.episode_id} {session.state.name}")

    def _deactivate(self) -> None:
        session, config = self.session, self.config
        assert session is not None and config is not None
        self._active = False
        self._stop_stepping()
        if session.state == EpisodeState.RUNNING:
            hold = HoldMode.HOLD_ZERO if config.control.deadline_action == "zero" else HoldMode.HOLD_LAST
            capsule = self.interrupt(hold, True, timeout_s=TRANSITION_BOUNDARY_S)
            self._resume_on_activate = True
            self.get_logger().info(f"deactivated at step {session.step}: boundary capsule "
                                   f"{capsule.id if capsule else '(none)'}; activate resumes from it")

    def _cleanup(self) -> None:
        self._stop_stepping()
        self._active, self._resume_on_activate = False, False
        if self.recorder is not None:
            self.stop_recording()
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
            self._status_timer = None
        for output in self._outputs:
            self.destroy_publisher(output.publisher)
        self._outputs = []
        session, self.session, self._prepared, self.config = self.session, None, None, None
        if self._settled:
            unsettle()                                  # start-up's objects can be collected again
            self._settled = False
        if session is not None:
            device = session.runtime.device
            session.release(TRANSITION_BOUNDARY_S)
            del session
            release_device_memory(device)

    def _stop_stepping(self) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        for subscription in self._port_subscriptions.values():
            self.destroy_subscription(subscription)
        self._port_subscriptions = {}

    # -- control loop ----------------------------------------------------------------------------
    def _configure_loop(self, control: ControlConfig) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        if control.mode == "timer":
            self._control_timer = self.create_timer(1.0 / control.rate_hz, lambda: self._control_tick(None),
                                                    callback_group=self._control_group)

    def _subscribe_ports(self, config: ServingConfig) -> None:
        """One subscription per port. The trigger port subscribes last: when a goal and a
        joint state wait at once, the executor takes them in subscription order, so the step
        sees the goal that came with it (clients wait for the goal's acknowledgement before
        the joint state)."""
        trigger = config.control.trigger_port if config.control.mode == "trigger" else ""
        ordered = sorted(config.ports.items(), key=lambda item: item[0] == trigger)
        self._port_subscriptions = {name: self._subscribe(name, port) for name, port in ordered}

    def _subscribe(self, name: str, port: PortConfig):
        def on_message(msg) -> None:
            self._on_port_message(name, msg)
        return self.create_subscription(message_class(port.type), port.topic, on_message,
                                        qos_profile(port.qos, port.depth), callback_group=self._control_group)

    def _on_port_message(self, name: str, msg) -> None:
        session = self.session
        if session is None or not self._active:
            return
        if self.recorder is not None:
            self._record_port_message(name, msg)
        try:
            session.receive(name, msg, self.get_clock().now().nanoseconds)
        except PortDrop as drop:
            self._warn_throttled(f"drop.{name}", f"port {name}: dropped a message ({drop.reason}): {drop}")
            return
        except Exception as exc:  # noqa: BLE001 - undecodable message: count it, never crash
            session.ports[name].counters.dropped["type"] += 1
            self._warn_throttled(f"drop.{name}", f"port {name}: undecodable message: {exc}")
            return
        self._last_port_messages[name] = msg
        control = session.control
        if control.mode == "trigger" and name == control.trigger_port:
            self._control_tick(stamp_ns(msg))

    def _record_port_message(self, name: str, msg) -> None:
        """Into the bag under the topic's resolved name (remaps applied); CDR serialisation is
        deterministic, so these are the bytes as received."""
        session = self.session
        assert session is not None
        self.recorder.write_raw(self._port_subscriptions[name].topic_name, session.ports[name].config.type,
                                serialize_message(msg), self.get_clock().now().nanoseconds)

    def _control_tick(self, stamp: Optional[int]) -> None:
        """One tick of the session; publishes what it hands out (the session decides
        whether that is the policy's action or the safe one)."""
        session = self.session
        if session is None or not self._active:
            return
        record = session.tick(stamp)
        if record is None:
            if not session.inputs.ready:
                self._warn_throttled("inputs", f"waiting for first message on port(s) {session.inputs.missing()}")
            return
        if not record.published:
            self._publish_action(record)
        if record.source == ActionSource.POLICY:
            self._count_stale_ports(session)
        elif record.fault:
            detail = (f"missed its {session.control.effective_deadline_s() * 1e3:.1f} ms deadline"
                      if record.late else session.counters.last_fault)
            self._warn_throttled(f"fault.{record.fault.value}", f"step {record.step + 1} {detail}: published the "
                                 f"safe action ({session.control.deadline_action})")
        self.run_policy.after_action(record)

    def _count_stale_ports(self, session: PolicySession) -> None:
        for adapter in session.ports.values():
            if adapter.is_stale():
                adapter.counters.stale_steps += 1
                self._warn_throttled(f"stale.{adapter.name}", f"port {adapter.name} is stale "
                                     f"({adapter.age_ms():.0f} ms > {adapter.config.staleness_ms:.0f} ms)")

    def interrupt(self, hold_mode: int, commit: bool, timeout_s: Optional[float] = None):
        """Interrupt the episode at a boundary and publish the hold mode's safe action; the
        boundary capsule when ``commit`` (the ~/interrupt service, RunPolicy, deactivate)."""
        session = self.active_session() if timeout_s is None else self.session
        assert session is not None
        capsule = session.interrupt(hold_mode, commit, timeout_s=timeout_s)
        record = session.safe_record(session.hold_mode)
        if record is not None:
            self._publish_action(record)
        return capsule

    def _publish_action(self, record: ActionRecord) -> None:
        """Publish (and record) an action on ~/action and the outputs; any thread (control
        loop, watchdog, services, a RunPolicy run)."""
        session = self.session
        assert session is not None
        msg = action_message(record, session.control.frame_id, session.runtime.policy.action_dim)
        with self._published_lock:
            self.action_pub.publish(msg)
            self._actions_published += 1
            self.last_action = msg
            if self._outputs:
                now_ns = self.get_clock().now().nanoseconds
                for output in self._outputs:
                    output.publish(record, now_ns)
        if self.recorder is not None:
            self.recorder.write_message(self.action_pub.topic_name, msg, self.get_clock().now().nanoseconds)

    def _on_event(self, event: EventRecord) -> None:
        msg = event_message(event, self.get_clock().now().nanoseconds)
        self.event_pub.publish(msg)
        if self.recorder is not None:
            self.recorder.write_message(self.event_pub.topic_name, msg, self.get_clock().now().nanoseconds)

    def _warn_throttled(self, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last_warn.get(key, -1e9) >= WARN_PERIOD_S:
            self._last_warn[key] = now
            self.get_logger().warning(text)

    # -- status ------------------------------------------------------------------------------------
    def _publish_status(self) -> None:
        session = self.session
        if session is None:
            return
        stamp = self.get_clock().now().to_msg()
        status = runtime_status(session, stamp)
        status.lifecycle_state = "active" if self._active else "inactive"
        status.actions_published = self._actions_published
        self.status_pub.publish(status)
        self.diag_pub.publish(self._diagnostics.build(status, stamp))

    # -- recording -----------------------------------------------------------------------------------
    def start_recording(self, path: str, storage: str):
        """Record inputs, actions and capsule events to a new bag (``path``: its directory,
        '' = a new one under record.directory); the node must be active."""
        return self._start_recording(self.active_session(), path, storage)

    def _start_recording(self, session: PolicySession, path: str, storage: str):
        from capsule_ros.bag.recorder import NodeRecorder
        config = self.config
        assert config is not None
        if self.recorder is not None:
            self.stop_recording()
        self.recorder = NodeRecorder.start(path, config.record.directory, storage or config.record.storage, config,
                                           self.action_pub.topic_name, self.event_pub.topic_name,
                                           fingerprint=session.runtime.fingerprint,
                                           initial_inputs=len(self._last_port_messages),
                                           serialize=serialize_message)
        for name, msg in self._last_port_messages.items():   # the inputs the next step will use
            self._record_port_message(name, msg)
        self.get_logger().info(f"recording to {self.recorder.path}")
        return self.recorder.path

    def stop_recording(self):
        recorder, self.recorder = self.recorder, None
        return recorder.path, recorder.close()

    # -- parameters --------------------------------------------------------------------------------
    def _on_set_parameters(self, params) -> SetParametersResult:
        """Validate run-time changes through the config dataclasses; apply them if valid (to
        the configured node; an unconfigured one validates everything at configure)."""
        if self.config is None:
            return SetParametersResult(successful=True)
        flat = flatten({"control": self.config.control.to_mapping(),
                        "ports": {n: p.to_mapping() for n, p in self.config.ports.items()}})
        touched = False
        for p in params:
            if p.name.startswith("control.") or (p.name.startswith("ports.") and p.name != "ports.names"):
                flat[p.name] = p.value
                touched = True
        if not touched:
            return SetParametersResult(successful=True)
        nested = unflatten(flat)
        try:
            control = ControlConfig.from_mapping(nested["control"])
            ports = {n: PortConfig.from_mapping(v, section=f"ports.{n}") for n, v in nested["ports"].items()}
            if control.mode == "trigger" and control.trigger_port not in ports:
                raise ConfigError(f"control.trigger_port = {control.trigger_port!r}: not a port")
            time_steps = [output.adapter.time_step(control_period(control)) for output in self._outputs]
        except CapsuleRosError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        rate_changed = (control.mode, control.rate_hz) != (self.config.control.mode, self.config.control.rate_hz)
        self.config = dataclasses.replace(self.config, ports=ports, control=control)
        if self._prepared is not None:
            self._prepared = dataclasses.replace(self._prepared, config=self.config)
        session = self.session
        if session is not None:
            session.control = control
            for name, adapter in session.ports.items():
                adapter.config = ports[name]
        if rate_changed and self._active:
            self._configure_loop(control)
        with self._published_lock:
            for output, time_step in zip(self._outputs, time_steps, strict=True):
                output.adapter.time_step_s = time_step
        return SetParametersResult(successful=True)

    def close(self) -> None:
        """Stop the node's threads, after the executor and before destroy_node and rclpy's
        shutdown (ros/entry.py): the service threads and a RunPolicy run first, letting a
        running call finish (it may publish an event or a safe action), then the session's
        deadline watchdog (no step can arm it any more and no service holds the session),
        then any recording, and the log bridge. After this no thread of the node publishes,
        so none can hit a destroyed publisher or context."""
        self._active = False
        self._service_threads.shutdown()
        self.run_policy.close()
        if self.session is not None:
            self.session.close()
        if self.recorder is not None:
            self.stop_recording()
        self._log_bridge.remove()
