"""PolicyNode: a PolicySession behind ROS 2 (topics, services and an action in, the
session's verbs and control loop out), managed by the standard ROS 2 lifecycle.

What the node itself does: the lifecycle (building, suspending, resuming and releasing
the session), subscriptions and timers, the parameters (validated, applied live through
the session's ``reconfigure``), the recording, the clock's jump callback, and publishing
(actions, events, ``~/status`` and ``/diagnostics`` from the session's ``status()``).
What it decides nothing about: when a message steps the policy, dropped or stale inputs,
throttled warnings (``PolicySession.loop``'s ``feed`` / ``tick``, so an in-process replay
counts what the node counts), what a verb does (``CapsuleServices`` and
``RunPolicyServer`` call the session's verbs, reaching the node only through its facade,
``NodeFacade``).

Lifecycle (``~/change_state``, ``~/get_state``; ``lifecycle.autostart`` runs configure and
activate at start-up so one command serves):

- configure: parameters validated, the policy built on the CPU with its weights, the
  layout and fingerprint computed, the capsule directory opened. No device memory yet; a
  bad configuration fails the transition with its reason (logged).
- activate: the runtime on its device (arena, capture, warm-up: the first active step is
  not a cold one), capsule pools, then subscriptions and stepping. After a deactivate it
  resumes the interrupted episode from the capsule the deactivate committed.
- deactivate: the capsule verbs are refused at the session's boundary (also a request
  that passed the "active" check just before), a running episode is interrupted there
  (safe action published, boundary capsule committed), stepping stops; the state is kept.
- cleanup: the runtime and the capsule pools are released (on CUDA the memory goes back
  to the driver); capsule files stay.
- shutdown: deactivate and cleanup as needed.

The capsule services and ``~/run_policy`` are offered once the node can answer at once
(``start``: after autostart's activate, or right away when a lifecycle manager drives
it): a client that discovers them early would otherwise wait behind start-up, which on a
busy machine outlasts a behaviour tree's call timeout. They answer WRONG_STATE (a
REJECTED result) unless the node is active.

Threads and callback groups. Sensor subscriptions, the trigger and the control timer
share one mutually exclusive *control* group, run by the executor's thread: steps never
overlap and a sensor message reaches the policy with no thread hand-off. Services have
their own group and are coroutines that hand the work to a small pool of service
threads and await it, so a service (a slow save, a recompute) never holds up the control
loop, several services run side by side, and each reaches the session between steps
through its boundary (it waits behind at most one step). A RunPolicy goal runs on its
own worker thread. Status has a third group. Lifecycle transitions and parameter changes
run on the executor's thread, so no step is in progress while one runs.

Why not rclpy's MultiThreadedExecutor: it hands every callback to a thread pool and
spins while a group is busy, which adds to the sensor-to-action path (docs/benchmarks.md,
"Executor: single-threaded vs MultiThreadedExecutor"). ``policy_node`` spins this node on
a SingleThreadedExecutor; the service threads give the concurrency the services need.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Callable, Dict, List, Optional

import torch
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType, JumpThreshold, TimeJump
from rclpy.duration import Duration
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from capsule_ros.config import APPLIES, CONFIGURE, flatten
from capsule_ros.errors import CapsuleRosError, ConfigError
from capsule_ros.msg import CapsuleEvent, RuntimeStatus
from capsule_ros.ros.capsule_services import CapsuleServices
from capsule_ros.ros.facade import NodeFacade
from capsule_ros.ros.log_bridge import RosLogBridge
from capsule_ros.ros.messages import event_message
from capsule_ros.ros.outputs import qos_profile
from capsule_ros.ros.params import declare_parameters, parameter_values, plain
from capsule_ros.ros.publishing import ActionOutput, NodeRecording
from capsule_ros.ros.run_policy import RunPolicyServer
from capsule_ros.ros.spinning import Offload
from capsule_ros.ros.status import DiagnosticsBuilder, runtime_status
from capsule_ros.runtime.engine import release_device_memory
from capsule_ros.runtime.streams import StreamKeeper
from capsule_ros.serving.config import ControlConfig, PortConfig, ServingConfig
from capsule_ros.serving.factory import PreparedServing, prepare_serving, settle_mode, start_session
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.outputs import OutputAdapter, point_spacing
from capsule_ros.serving.ports import TEXT_TYPE
from capsule_ros.serving.process import settle_after_start, unsettle
from capsule_ros.serving.records import (
    ActionRecord,
    EventKind,
    EventRecord,
    HoldMode,
    clock_jump_delta,
)
from capsule_ros.serving.session import PolicySession
from capsule_ros.updates.watch import ModelUpdateWatch

LOG = logging.getLogger(__name__)
TRANSITION_BOUNDARY_S = 5.0     # how long deactivate / cleanup wait for a service to leave the session
# jumps of the node's clock the session hears of: any jump back (a looping bag's /clock), and
# a change of clock (use_sim_time set or cleared); forward jumps need nothing (ages just grow)
CLOCK_JUMPS = JumpThreshold(min_forward=None, min_backward=Duration(nanoseconds=-1), on_clock_change=True)


def message_class(type_name: str) -> Any:
    package, _, name = type_name.split("/")
    return getattr(importlib.import_module(f"{package}.msg"), name)


def _config_error(params: Dict[str, Any]) -> str:
    """What ServingConfig.from_params says about ``params`` ("" when they are valid)."""
    try:
        ServingConfig.from_params(params)
    except ConfigError as exc:
        return str(exc)
    return ""


def control_period(control: ControlConfig) -> Optional[float]:
    """Seconds between steps in timer mode; None in trigger mode."""
    return 1.0 / control.rate_hz if control.mode == "timer" else None


class PolicyNode(LifecycleNode):
    """See the module docstring."""

    def __init__(self, node_name: str = "capsule_policy", **kwargs: Any):
        super().__init__(node_name, **kwargs)
        self._applies = declare_parameters(self)         # parameter name -> when a change takes effect
        self.config: Optional[ServingConfig] = None
        self.session: Optional[PolicySession] = None
        self.transition_error: Optional[BaseException] = None     # why the last transition failed
        self._prepared: Optional[PreparedServing] = None
        self._watch: Optional[ModelUpdateWatch] = None       # the capsule directory's model updates (configure)
        self._action_dim, self._device = 0, "cpu"           # the served runtime's (activate)
        self._settled = False
        self._streams = StreamKeeper()             # one CUDA stream across activations (StreamKeeper says why)
        self._raise_transition_errors = False
        self._control_group = MutuallyExclusiveCallbackGroup()
        # services may run side by side (a slow save must not hold up a commit); the session's
        # boundary orders what touches the state
        self._service_group = ReentrantCallbackGroup()
        self._status_group = MutuallyExclusiveCallbackGroup()
        self._service_threads = Offload(self, 4, "capsule-service")
        self.event_pub = self.create_publisher(CapsuleEvent, "~/capsule_events", 100)
        self.status_pub = self.create_publisher(RuntimeStatus, "~/status", 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.actions = ActionOutput(self)
        self.recording = NodeRecording(self, self.actions.publisher.topic_name, self.event_pub.topic_name)
        self.actions.recording = self.recording
        self.facade = NodeFacade(self.get_logger(), self.actions, self.recording)
        self.capsule_services: Optional[CapsuleServices] = None      # offered by start()
        self.run_policy: Optional[RunPolicyServer] = None
        self._port_subscriptions: Dict[str, Any] = {}
        self._control_timer: Any = None
        self._status_timer: Any = None
        self._steady_clock = Clock(clock_type=ClockType.STEADY_TIME)   # status: also while a sim clock pauses
        self._clock_jump_handle: Any = None        # the session's jump callback on the node's clock
        self._clock_before_jump_ns = 0
        self._diagnostics = DiagnosticsBuilder(self.get_fully_qualified_name())
        self._log_bridge = RosLogBridge.install(self.get_logger())
        self.add_on_set_parameters_callback(self._on_set_parameters)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Come up: with ``lifecycle.autostart``, configure and activate now (a failure
        raises the transition's error: ``policy_node`` exits 2 with it); otherwise wait
        unconfigured for a lifecycle manager. Then offer the capsule services and
        ``~/run_policy``: a client that finds them gets its answer at once."""
        if not self.get_parameter("lifecycle.autostart").value:
            self.get_logger().info("unconfigured: waiting for configure and activate (~/change_state)")
        else:
            self._raise_transition_errors = True           # the caller reports them (one line, exit 2)
            try:
                for trigger in (self.trigger_configure, self.trigger_activate):
                    if trigger() != TransitionCallbackReturn.SUCCESS:
                        raise self.transition_error or CapsuleRosError(f"{trigger.__name__} failed")
            finally:
                self._raise_transition_errors = False
        self._offer_servers()

    @property
    def active(self) -> bool:
        return self.facade.active

    def _offer_servers(self) -> None:
        if self.capsule_services is None:
            self.capsule_services = CapsuleServices(self, self.facade, self._service_threads, self._service_group)
            self.run_policy = RunPolicyServer(self, self.facade, self._service_group)

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
            if self.facade.active:
                self._deactivate()
            self._cleanup()
        return self._transition("shutdown", shutdown)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition("error recovery", self._cleanup)     # back to unconfigured

    def _configure(self) -> None:
        config = ServingConfig.from_params(parameter_values(self), source="ROS parameters")
        prepared = prepare_serving(config, node_name=self.get_fully_qualified_name())
        watch = ModelUpdateWatch.of(prepared)            # stale capsules counted by cause (headers only)
        if prepared.directory is not None and prepared.directory.recovered:
            self.get_logger().warning(f"moved {len(prepared.directory.recovered)} unfinished capsule save(s) "
                                      f"aside: {[str(p) for p in prepared.directory.recovered]}")
        self.config, self._prepared, self._watch = config, prepared, watch
        self.facade.config, self.facade.lifecycle_state = config, "inactive"
        self.get_logger().info(f"configured: policy {config.policy.kind}, ports {list(config.ports)}, "
                               f"fingerprint {prepared.fingerprint[:12]}")

    def _activate(self) -> None:
        config = self.config
        assert config is not None
        if self.session is None:
            assert self._prepared is not None
            # an auto inference delay is measured now, before the runtime is built: the recorded
            # and reported config carries the number
            prepared = settle_mode(self._prepared, streams=self._streams)
            config = self.config = prepared.config
            # the watchdog: a step over its deadline publishes the safe action at once
            options = SessionOptions(clock_ns=self._now_ns, on_event=self._on_event,
                                     on_safe_action=self._publish_action)
            session = start_session(prepared, options=options, streams=self._streams, watch=self._watch)
            if self._watch is not None:
                self._watch.start(config)     # capsules.regenerate_stale: in the background
            served = session.status()
            self._action_dim, self._device = served.action_dim, served.device
            self.actions.add_outputs([OutputAdapter(name, output, served.action_dim, control_period(config.control))
                                      for name, output in config.outputs.items()])
            self.session, self._prepared = session, None
            self.facade.session = session
            self._start_status_timer(config.control.status_rate_hz)
            self._clock_jump_handle = self.get_clock().create_jump_callback(
                CLOCK_JUMPS, pre_callback=self._before_clock_jump, post_callback=self._after_clock_jump)
            if config.record.enabled:
                self.recording.start(config, served.fingerprint)
        else:                   # after a deactivate: its interrupted episode resumes, the verbs are served
            self.session.resume(TRANSITION_BOUNDARY_S)
        if not self._settled:
            settle_after_start()                       # no multi-ms garbage collections during the loop
            self._settled = True
        session = self.session
        session.warm_up()                              # the first active step is not a cold one
        self._subscribe_ports(config)
        self._configure_loop(config.control)
        self.facade.active, self.facade.lifecycle_state = True, "active"
        served, episode = session.status(), session.episode
        self.get_logger().info(
            f"serving on {served.device} ({'CUDA graph' if served.graph_captured else 'eager'}),"
            f" {config.control.mode} mode, episode {episode.episode_id} {episode.state.name}")

    def _deactivate(self) -> None:
        """The verbs are refused at the session's boundary first (also those on their way
        there), then a running episode is interrupted there (its INTERRUPT event publishes
        the safe action): whatever a service was doing, activate can resume. Stepping stops
        (no step runs meanwhile: transitions run on the executor's thread)."""
        session, config = self.session, self.config
        assert session is not None and config is not None
        hold = HoldMode.HOLD_ZERO if config.control.deadline_action == "zero" else HoldMode.HOLD_LAST
        capsule = session.suspend(self.facade.refusal("inactive"), hold, timeout_s=TRANSITION_BOUNDARY_S)
        self.facade.active, self.facade.lifecycle_state = False, "inactive"
        self._stop_stepping()
        if self.run_policy is not None:
            self.run_policy.node_deactivated(capsule)
        if capsule is not None:
            self.get_logger().info(f"deactivated at step {session.episode.step}: boundary capsule {capsule.id}; "
                                   "activate resumes from it")

    def _cleanup(self) -> None:
        self._stop_stepping()
        self._unwatch_clock()
        self.facade.active, self.facade.lifecycle_state = False, "unconfigured"
        if self.recording.active:
            self.recording.stop()
        self.recording.forget_inputs()
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
            self._status_timer = None
        self.actions.remove_outputs()
        session, self.session, self._prepared, self.config = self.session, None, None, None
        self._watch = None                              # closed with the session
        self.facade.session, self.facade.config = None, None
        if self._settled:
            unsettle()                                  # start-up's objects can be collected again
            self._settled = False
        if session is not None:
            session.release(TRANSITION_BOUNDARY_S)
            del session
            release_device_memory(torch.device(self._device))

    def _stop_stepping(self) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        for subscription in self._port_subscriptions.values():
            self.destroy_subscription(subscription)
        self._port_subscriptions = {}

    # -- the clock --------------------------------------------------------------------------------
    def _before_clock_jump(self) -> None:
        self._clock_before_jump_ns = self.get_clock().now().nanoseconds

    def _after_clock_jump(self, jump: TimeJump) -> None:
        """The node's clock jumped back or changed (on the executor's thread, between
        messages: its /clock subscription): the session's ports follow it
        (``SessionLoop.clock_jumped``). The jump is measured here: a change of clock
        reports none."""
        session = self.session
        if session is None:
            return
        try:
            session.loop.clock_jumped(self.get_clock().now().nanoseconds - self._clock_before_jump_ns)
        except CapsuleRosError as exc:          # released meanwhile: nothing to follow the clock
            self.get_logger().warning(f"clock jump not applied: {exc}")

    def _unwatch_clock(self) -> None:
        if self._clock_jump_handle is not None:
            self._clock_jump_handle.unregister()
            self._clock_jump_handle = None

    # -- control loop ----------------------------------------------------------------------------
    def _configure_loop(self, control: ControlConfig) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        if control.mode == "timer":
            self._control_timer = self.create_timer(1.0 / control.rate_hz, self._on_timer,
                                                    callback_group=self._control_group)

    def _subscribe_ports(self, config: ServingConfig) -> None:
        """One subscription per port. The trigger port subscribes last: when a goal and a
        joint state wait at once, the executor takes them in subscription order, so the step
        sees the goal that came with it (clients wait for the goal's acknowledgement before
        the joint state)."""
        trigger = config.control.trigger_port if config.control.mode == "trigger" else ""
        ordered = sorted(config.ports.items(), key=lambda item: item[0] == trigger)
        self._port_subscriptions = {name: self._subscribe(name, port) for name, port in ordered}

    def _subscribe(self, name: str, port: PortConfig) -> Any:
        """A text port subscribes raw: its adapter decodes the bytes itself (``serving/ports.py``)."""
        def on_message(msg: Any) -> None:
            self._on_port_message(name, port.type, msg)
        return self.create_subscription(message_class(port.type), port.topic, on_message,
                                        qos_profile(port.qos, port.depth), callback_group=self._control_group,
                                        raw=port.type == TEXT_TYPE)

    def _on_port_message(self, name: str, msgtype: str, msg: Any) -> None:
        """A sensor message: into the recording as it came, then to the session, which stages
        it (or drops and counts it) and, on the trigger port in trigger mode, steps."""
        session = self.session
        if session is None or not self.facade.active:
            return
        topic = self._port_subscriptions[name].topic_name
        now = session.loop.observe_clock(self._now_ns())   # a jump it finds goes first in a bag
        self.recording.received(topic, msgtype, msg)
        fed = session.loop.feed(name, msg, now)
        if fed.accepted:
            self.recording.accepted(name, topic, msgtype, msg)
        if fed.stepped:
            self._after_tick(fed.record)

    def _on_timer(self) -> None:
        session = self.session
        if session is not None and self.facade.active:
            self._after_tick(session.loop.tick())

    def _after_tick(self, record: Optional[ActionRecord]) -> None:
        """Publish what a tick handed out (the session decided whether that is the policy's
        action or the safe one) and tell a running goal."""
        if record is None:
            return
        if not record.published:
            self._publish_action(record)
        if self.run_policy is not None:
            self.run_policy.after_action(record)

    def _publish_action(self, record: ActionRecord) -> None:
        """~/action, the outputs and the recording; any thread (control loop, watchdog,
        whichever thread interrupted)."""
        config = self.config
        assert config is not None
        self.actions.publish(record, config.control.frame_id, self._action_dim)

    def _now_ns(self) -> int:
        """The session's clock: the node's (ROS time: simulated with ``use_sim_time``)."""
        return self.get_clock().now().nanoseconds

    def _on_event(self, event: EventRecord) -> None:
        """A capsule event (emitted under the session's boundary): published and recorded;
        an INTERRUPT also publishes the hold mode's safe action, whoever interrupted (a
        service, a RunPolicy run ending, deactivate); a CLOCK_JUMP moves the recording's
        log times on across the jump."""
        msg = event_message(event, self.get_clock().now().nanoseconds)
        if event.kind == EventKind.CLOCK_JUMP:
            self.recording.clock_jumped(clock_jump_delta(event.detail))   # its log time goes on across it
        self.event_pub.publish(msg)
        self.recording.published(self.event_pub.topic_name, msg)
        if event.kind == EventKind.INTERRUPT and event.action is not None:
            self._publish_action(event.action)

    # -- status ------------------------------------------------------------------------------------
    def _start_status_timer(self, rate_hz: float) -> None:
        """~/status and /diagnostics at ``rate_hz`` of the steady clock (a new timer replaces the old)."""
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
        self._status_timer = self.create_timer(1.0 / rate_hz, self._publish_status, callback_group=self._status_group,
                                               clock=self._steady_clock)

    def _publish_status(self) -> None:
        session = self.session
        if session is None:
            return
        stamp = self.get_clock().now().to_msg()
        status = runtime_status(session.status(), stamp)
        status.lifecycle_state = "active" if self.facade.active else "inactive"
        status.actions_published = self.actions.published
        self.status_pub.publish(status)
        self.diag_pub.publish(self._diagnostics.build(status, stamp))

    # -- parameters --------------------------------------------------------------------------------
    def _on_set_parameters(self, params: List[Any]) -> SetParametersResult:
        """A set of the node's configuration parameters, in any lifecycle state: refused with
        the reason, nothing changed, unless every value is valid (the very check configure
        makes: ``ServingConfig.from_params`` over all the node's parameters with the change)
        and takes effect as its ``applies`` says (``capsule_ros.config``): a live one at once
        (``_apply_live``), a configure-time one only while the node is unconfigured (the
        next configure reads it). Read-only ones rclpy refuses by their descriptor; rclpy's
        own (``use_sim_time``) are rclpy's."""
        changes = {p.name: plain(p.value) for p in params if p.name in self._applies}
        if not changes:
            return SetParametersResult(successful=True)
        try:
            config = self._checked_config(changes)
            if self.config is not None and config is not None:
                self._apply_live(config)
        except CapsuleRosError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)

    def _checked_config(self, changes: Dict[str, Any]) -> Optional[ServingConfig]:
        """The configuration the node's parameters give with ``changes``, or ConfigError.
        None: an unconfigured node whose parameters were invalid before the change already
        (a bad start-up file: a fix of one value at a time must be possible; configure
        reports what is still wrong)."""
        if self.config is not None:
            current = flatten(parameter_values(self))
            late = sorted(name for name, value in changes.items()
                          if self._applies[name] == CONFIGURE and value != current.get(name))
            if late:
                raise ConfigError(f"{', '.join(late)}: {APPLIES[CONFIGURE]}; the node is "
                                  f"{self.facade.lifecycle_state}")
        try:
            return ServingConfig.from_params(parameter_values(self, changes), source="ROS parameters")
        except ConfigError as exc:
            if self.config is None and str(exc) == _config_error(parameter_values(self)):
                return None
            raise

    def _apply_live(self, new: ServingConfig) -> None:
        """Make the live settings of ``new`` take effect on the configured node: the control
        loop and the ports (the session's ``reconfigure``, at a boundary), the status rate,
        the recording (``record.enabled``: start or stop it now, once there is a session;
        directory and storage: the next recording), the outputs' trajectory points. What
        can fail comes first, and a failure leaves everything as it was."""
        old = self.config
        assert old is not None
        control = old.control.with_live_settings(new.control)
        ports = {name: port.with_live_settings(new.ports[name]) for name, port in old.ports.items()}
        outputs = {name: output.with_live_settings(new.outputs[name]) for name, output in old.outputs.items()}
        config = dataclasses.replace(old, control=control, ports=ports, outputs=outputs,
                                     record=old.record.with_live_settings(new.record))
        period = control_period(control)
        time_steps = {name: point_spacing(name, output, period) for name, output in outputs.items()}
        session = self.session
        start_recording = (session is not None and config.record.enabled and not old.record.enabled
                           and not self.recording.active)
        if start_recording:
            assert session is not None
            self.recording.start(config, session.status().fingerprint)
        try:
            if session is not None:
                session.reconfigure(control, ports)
        except BaseException:
            if start_recording:
                self.recording.stop()
            raise
        self.actions.retune(outputs, time_steps)
        self.config = self.facade.config = config
        if self._prepared is not None:
            self._prepared = dataclasses.replace(self._prepared, config=config)
        if (control.mode, control.rate_hz) != (old.control.mode, old.control.rate_hz) and self.facade.active:
            self._configure_loop(control)
        if control.status_rate_hz != old.control.status_rate_hz and self._status_timer is not None:
            self._start_status_timer(control.status_rate_hz)
        if old.record.enabled and not config.record.enabled and self.recording.active:
            self.recording.stop()

    def close(self) -> None:
        """Stop the node's threads, after the executor and before destroy_node and rclpy's
        shutdown (ros/entry.py): the service threads and a RunPolicy run first, letting a
        running call finish (it may publish an event or a safe action), then the session's
        deadline watchdog (no step can arm it any more and no service holds the session),
        then any recording, and the log bridge. After this no thread of the node publishes,
        so none can hit a destroyed publisher or context."""
        self.facade.active = False
        self._unwatch_clock()
        self._service_threads.shutdown()
        if self.run_policy is not None:
            self.run_policy.close()
        if self.session is not None:
            self.session.close()
        if self.recording.active:
            self.recording.stop()
        self._log_bridge.remove()
