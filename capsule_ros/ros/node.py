"""PolicyNode: the ROS 2 face of a PolicySession (a thin layer: topics and services in,
session verbs out).

Threads and callback groups. Sensor subscriptions, the trigger and the control timer
share one mutually exclusive *control* group, run by the executor's thread: steps never
overlap and a sensor message reaches the policy with no thread hand-off. Services have
their own group and are coroutines that hand the work to a small pool of service
threads and await it, so a service (a slow save, a recompute) never holds up the control
loop, several services run side by side, and each reaches the session between steps
through its boundary lock (it waits behind at most one step). Status has a third group.

Why not rclpy's MultiThreadedExecutor: it hands every callback to a thread pool and
spins while a group is busy; measured on the 2-core CI machine (`capsule-ros bench
loop`) it added ~3.8 ms at p50 and ~140 ms at p99 to the sensor-to-action path of the
default policy. ``policy_node`` spins this node on a SingleThreadedExecutor; the service
threads give the concurrency the services need.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional

from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.node import Node
from rclpy.serialization import serialize_message
from rclpy.task import Future

from capsule_ros import srv
from capsule_ros.config import flatten, unflatten
from capsule_ros.errors import CapsuleRosError, ConfigError, ErrorCode
from capsule_ros.msg import Action, CapsuleEvent, RuntimeStatus
from capsule_ros.ros.messages import action_message, capsule_info, event_message
from capsule_ros.ros.outputs import OutputPublisher, qos_profile
from capsule_ros.ros.params import declare_parameters
from capsule_ros.ros.status import DiagnosticsBuilder, runtime_status
from capsule_ros.serving.config import ControlConfig, PortConfig, ServingConfig
from capsule_ros.serving.factory import build_session
from capsule_ros.serving.files import SaveFailed
from capsule_ros.serving.outputs import OutputAdapter
from capsule_ros.serving.ports import PortDrop, stamp_ns
from capsule_ros.serving.records import ActionRecord, ActionSource, EventRecord, HoldMode

LOG = logging.getLogger(__name__)
WARN_PERIOD_S = 5.0


def message_class(type_name: str):
    package, _, name = type_name.split("/")
    return getattr(importlib.import_module(f"{package}.msg"), name)


def control_period(control: ControlConfig) -> Optional[float]:
    """Seconds between steps in timer mode; None in trigger mode."""
    return 1.0 / control.rate_hz if control.mode == "timer" else None


class PolicyNode(Node):
    """See the module docstring."""

    def __init__(self, node_name: str = "capsule_policy", **kwargs: Any):
        super().__init__(node_name, **kwargs)
        self.config = ServingConfig.from_params(declare_parameters(self), source="ROS parameters")
        control = self.config.control
        self._control_group = MutuallyExclusiveCallbackGroup()
        # services may run side by side (a slow save must not hold up a commit); the session's
        # boundary lock orders what touches the state
        self._service_group = ReentrantCallbackGroup()
        self._service_threads = concurrent.futures.ThreadPoolExecutor(max_workers=4,
                                                                      thread_name_prefix="capsule-service")
        self._status_group = MutuallyExclusiveCallbackGroup()
        self.action_pub = self.create_publisher(Action, "~/action", 10)
        self.event_pub = self.create_publisher(CapsuleEvent, "~/capsule_events", 100)
        self.status_pub = self.create_publisher(RuntimeStatus, "~/status", 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.recorder = None
        self._published_lock = threading.Lock()
        self._actions_published = 0
        self.session = build_session(self.config, on_event=self._on_event,
                                     node_name=self.get_fully_qualified_name())
        if self.session.directory is not None and self.session.directory.recovered:
            self.get_logger().warning(f"moved {len(self.session.directory.recovered)} unfinished capsule save(s) "
                                      f"aside: {[str(p) for p in self.session.directory.recovered]}")
        self.session.clock_ns = lambda: self.get_clock().now().nanoseconds
        action_dim = self.session.runtime.policy.action_dim
        self._outputs = [OutputPublisher(self, OutputAdapter(name, output, action_dim, control_period(control)))
                         for name, output in self.config.outputs.items()]
        self.session.start_watchdog(self._publish_action)   # a step over its deadline: the safe action at once
        self._last_warn: Dict[str, float] = {}
        self._diagnostics = DiagnosticsBuilder(self.get_fully_qualified_name())
        # The trigger port subscribes last: when a goal and a joint state wait at once, the
        # executor takes them in subscription order, so the step sees the goal that came
        # with it (clients wait for the goal's acknowledgement before the joint state).
        trigger = self.config.control.trigger_port if self.config.control.mode == "trigger" else ""
        ordered = sorted(self.config.ports.items(), key=lambda item: item[0] == trigger)
        self._port_subscriptions = {name: self._subscribe(name, port) for name, port in ordered}
        self._last_port_messages: Dict[str, Any] = {}     # written first into a new recording
        self._control_timer = None
        self._configure_loop(control)
        self._status_timer = self.create_timer(1.0 / control.status_rate_hz, self._publish_status,
                                               callback_group=self._status_group)
        self._capsule_services = [self.create_service(srv_type, f"~/{name}", self._service(handler),
                                              callback_group=self._service_group)
                          for srv_type, name, handler in self._service_table()]
        self.add_on_set_parameters_callback(self._on_set_parameters)
        if self.config.record.enabled:
            self._start_recording("", self.config.record.storage)
        self.get_logger().info(
            f"serving on {self.session.runtime.device} "
            f"({'CUDA graph' if self.session.runtime.plan.captured else 'eager'}),"
            f" {control.mode} mode, ports {list(self.config.ports)}, episode {self.session.episode_id} "
            f"{self.session.state.name}, fingerprint {self.session.runtime.fingerprint[:12]}")

    # -- control loop ----------------------------------------------------------------------------
    def _configure_loop(self, control: ControlConfig) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        if control.mode == "timer":
            self._control_timer = self.create_timer(1.0 / control.rate_hz, lambda: self._control_tick(None),
                                            callback_group=self._control_group)

    def _subscribe(self, name: str, port: PortConfig):
        adapter_name = name

        def on_message(msg) -> None:
            self._on_port_message(adapter_name, msg)
        return self.create_subscription(message_class(port.type), port.topic, on_message,
                                        qos_profile(port.qos, port.depth), callback_group=self._control_group)

    def _on_port_message(self, name: str, msg) -> None:
        if self.recorder is not None:
            self._record_port_message(name, msg)
        try:
            self.session.receive(name, msg, self.get_clock().now().nanoseconds)
        except PortDrop as drop:
            self._warn_throttled(f"drop.{name}", f"port {name}: dropped a message ({drop.reason}): {drop}")
            return
        except Exception as exc:  # noqa: BLE001 - undecodable message: count it, never crash
            self.session.ports[name].counters.dropped["type"] += 1
            self._warn_throttled(f"drop.{name}", f"port {name}: undecodable message: {exc}")
            return
        self._last_port_messages[name] = msg
        control = self.config.control
        if control.mode == "trigger" and name == control.trigger_port:
            self._control_tick(stamp_ns(msg))

    def _record_port_message(self, name: str, msg) -> None:
        """Into the bag under the topic's resolved name (remaps applied); CDR serialisation is
        deterministic, so these are the bytes as received."""
        self.recorder.write_raw(self._port_subscriptions[name].topic_name, self.session.ports[name].config.type,
                                serialize_message(msg), self.get_clock().now().nanoseconds)

    def _control_tick(self, stamp: Optional[int]) -> None:
        """One tick of the session; publishes what it hands out (the session decides
        whether that is the policy's action or the safe one)."""
        record = self.session.tick(stamp)
        if record is None:
            if not self.session.inputs.ready:
                missing = self.session.inputs.missing()
                self._warn_throttled("inputs", f"waiting for first message on port(s) {missing}")
            return
        if not record.published:
            self._publish_action(record)
        if record.source == ActionSource.POLICY:
            self._count_stale_ports()
        elif record.fault:
            detail = (f"missed its {self.config.control.effective_deadline_s() * 1e3:.1f} ms deadline"
                      if record.late else self.session.counters.last_fault)
            self._warn_throttled(f"fault.{record.fault.value}", f"step {record.step + 1} {detail}: published the "
                                 f"safe action ({self.config.control.deadline_action})")

    def _count_stale_ports(self) -> None:
        for adapter in self.session.ports.values():
            if adapter.is_stale():
                adapter.counters.stale_steps += 1
                self._warn_throttled(f"stale.{adapter.name}", f"port {adapter.name} is stale "
                                     f"({adapter.age_ms():.0f} ms > {adapter.config.staleness_ms:.0f} ms)")

    def _publish_action(self, record: ActionRecord) -> None:
        """Publish (and record) an action; any thread (control loop, watchdog, services)."""
        msg = action_message(record, self.config.control.frame_id, self.session.runtime.policy.action_dim)
        with self._published_lock:
            self.action_pub.publish(msg)
            self._actions_published += 1
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
        stamp = self.get_clock().now().to_msg()
        status = runtime_status(self.session, stamp)
        status.actions_published = self._actions_published
        self.status_pub.publish(status)
        self.diag_pub.publish(self._diagnostics.build(status, stamp))

    # -- services ----------------------------------------------------------------------------------
    def _service_table(self):
        return (
            (srv.Commit, "commit", self._srv_commit), (srv.Reset, "reset", self._srv_reset),
            (srv.Interrupt, "interrupt", self._srv_interrupt), (srv.Reenter, "reenter", self._srv_reenter),
            (srv.Fork, "fork", self._srv_fork), (srv.ListCapsules, "list_capsules", self._srv_list),
            (srv.DropCapsule, "drop_capsule", self._srv_drop), (srv.SaveCapsule, "save_capsule", self._srv_save),
            (srv.LoadCapsule, "load_capsule", self._srv_load), (srv.Record, "record", self._srv_record),
        )

    def _service(self, handler: Callable[[Any, Any], str]):
        """Wrap a handler as a coroutine that runs it on a service thread (see the module
        docstring); every call answers success / message / error_code, never raises."""
        async def callback(request, response):
            done: Future = Future(executor=self.executor)
            done.add_done_callback(lambda _f: None)   # completion wakes the executor to resume us
            self._service_threads.submit(self._answer, handler, request, response, done)
            return await done
        return callback

    def _answer(self, handler: Callable[[Any, Any], str], request, response, done: Future) -> None:
        try:
            response.message = handler(request, response) or "ok"
            response.success, response.error_code = True, int(ErrorCode.OK)
        except CapsuleRosError as exc:
            response.success, response.error_code, response.message = False, int(exc.code), str(exc)
        except Exception as exc:  # noqa: BLE001 - answer INTERNAL, keep serving
            self.get_logger().error(f"{handler.__name__} failed: {exc!r}")
            response.success, response.error_code = False, int(ErrorCode.INTERNAL)
            response.message = f"internal error ({type(exc).__name__}: {exc}); the live state is unchanged"
        done.set_result(response)

    def _srv_commit(self, req, resp) -> str:
        try:
            capsule = self.session.commit(req.label, req.persist, req.pin)
        except SaveFailed as exc:                  # committed in memory: say which capsule
            resp.capsule = capsule_info(exc.capsule)
            raise
        resp.capsule = capsule_info(capsule)
        return f"committed {capsule.id} at step {capsule.step}" + (f", saved to {capsule.path}" if req.persist else "")

    def _srv_reset(self, req, resp) -> str:
        episode, source = self.session.reset(req.capsule_id)
        resp.episode_id = episode
        if source is not None:
            resp.capsule = capsule_info(source)
        return f"episode {episode} started from " + (f"capsule {source.id}" if source else "the initial state")

    def _srv_interrupt(self, req, resp) -> str:
        capsule = self.session.interrupt(req.hold_mode, req.commit)
        record = self.session.safe_record(self.session.hold_mode)
        if record is not None:
            self._publish_action(record)
        if capsule is not None:
            resp.capsule = capsule_info(capsule)
        return f"interrupted at step {self.session.step} ({HoldMode(req.hold_mode).name})" + (
            f", boundary capsule {capsule.id}" if capsule else "")

    def _srv_reenter(self, req, resp) -> str:
        result = self.session.reenter(req.capsule_id)
        if result.capsule is not None:
            resp.capsule = capsule_info(result.capsule)
        resp.rollback, resp.fallback, resp.fallback_reason = result.rollback, result.fallback, result.fallback_reason
        resp.restore_ms, resp.recompute_ms = result.restore_seconds * 1e3, result.recompute_seconds * 1e3
        if result.capsule is None:
            return f"resumed at step {self.session.step}"
        verb = "rolled back to" if result.rollback else "re-entered"
        return f"{verb} {result.capsule.id} (episode {result.capsule.episode_id}, step {result.capsule.step})" + (
            f" by recomputation: {result.fallback_reason}" if result.fallback else "")

    def _srv_fork(self, req, resp) -> str:
        capsule = self.session.fork(req.capsule_id, req.label)
        resp.capsule = capsule_info(capsule)
        return f"forked {capsule.id} from {capsule.parent_id or 'the live state'}"

    def _srv_list(self, req, resp) -> str:
        capsules = self.session.list_capsules(req.current_episode_only)
        resp.capsules = [capsule_info(c) for c in capsules]
        return f"{len(capsules)} capsule(s)"

    def _srv_drop(self, req, resp) -> str:
        self.session.drop(req.capsule_id, req.from_disk)
        return f"dropped {req.capsule_id}"

    def _srv_save(self, req, resp) -> str:
        capsule = self.session.save(req.capsule_id)
        resp.capsule, resp.path = capsule_info(capsule), capsule.path or ""
        return f"saved {capsule.id} to {capsule.path}"

    def _srv_load(self, req, resp) -> str:
        capsule = self.session.load(req.capsule_id)
        resp.capsule = capsule_info(capsule)
        return f"loaded {capsule.id} (episode {capsule.episode_id}, step {capsule.step})"

    def _srv_record(self, req, resp) -> str:
        if req.start:
            path = self._start_recording(req.path, req.storage or self.config.record.storage)
            resp.bag_path = str(path)
            return f"recording to {path}"
        if self.recorder is None:
            from capsule_ros.errors import WrongState
            raise WrongState("not recording")
        path, count = self._stop_recording()
        resp.bag_path, resp.messages = str(path), count
        return f"wrote {count} messages to {path}"

    def _start_recording(self, path: str, storage: str):
        from capsule_ros.bag.recorder import NodeRecorder
        if self.recorder is not None:
            self._stop_recording()
        self.recorder = NodeRecorder.start(path, self.config.record.directory, storage, self.config,
                                           self.action_pub.topic_name, self.event_pub.topic_name,
                                           fingerprint=self.session.runtime.fingerprint,
                                           initial_inputs=len(self._last_port_messages),
                                           serialize=serialize_message)
        for name, msg in self._last_port_messages.items():   # the inputs the next step will use
            self._record_port_message(name, msg)
        self.get_logger().info(f"recording to {self.recorder.path}")
        return self.recorder.path

    def _stop_recording(self):
        recorder, self.recorder = self.recorder, None
        return recorder.path, recorder.close()

    # -- parameters --------------------------------------------------------------------------------
    def _on_set_parameters(self, params) -> SetParametersResult:
        """Validate run-time changes through the config dataclasses; apply them if valid."""
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
        self.session.control = control
        for name, adapter in self.session.ports.items():
            adapter.config = ports[name]
        if rate_changed:
            self._configure_loop(control)
            with self._published_lock:
                for output, time_step in zip(self._outputs, time_steps, strict=True):
                    output.adapter.time_step_s = time_step
        return SetParametersResult(successful=True)

    def close(self) -> None:
        """Stop the node's threads, after the executor and before destroy_node and rclpy's
        shutdown (ros/entry.py): the service threads first, letting a running call finish
        (it may publish an event or a safe action), then the session's deadline watchdog
        (no step can arm it any more and no service holds the session), then any recording.
        After this no thread of the node publishes, so none can hit a destroyed publisher
        or context."""
        self._service_threads.shutdown(wait=True, cancel_futures=True)
        self.session.close()
        if self.recorder is not None:
            self._stop_recording()
