"""PolicyNode: a PolicySession behind ROS 2 (topics, services and an action in, the
session's verbs and control loop out), managed by the standard ROS 2 lifecycle.

What the node itself does: the lifecycle (building, suspending, resuming and releasing
the session), timers, the parameters (validated, applied live through the session's
``reconfigure``) and the clock's jump callback. The robot's interface (subscriptions,
publishing actions, events, ``~/status`` and ``/diagnostics``, the recording, the capsule
services and ``~/run_policy``) is a ``RobotIO`` (``capsule_ros.ros.robot_io``), the same one
``fleet_node`` offers under each of its robots' namespaces.
What it decides nothing about: when a message steps the policy, dropped or stale inputs,
throttled warnings (``PolicySession.loop``'s ``feed`` / ``tick``, so an in-process replay
counts what the node counts), what a verb does (``CapsuleServices`` and
``RunPolicyServer`` call the session's verbs, reaching the node only through its facade,
``NodeFacade``, which ``RobotIO`` holds).

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
import logging
from typing import Any, Optional

import torch

from capsule_ros.ros.params import parameter_values
from capsule_ros.ros.robot_io import RobotIO
from capsule_ros.ros.serving_node import TRANSITION_BOUNDARY_S, ServingNode
from capsule_ros.runtime.engine import release_device_memory
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import PreparedServing, prepare_serving, settle_mode, start_session
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.process import settle_after_start, unsettle
from capsule_ros.serving.records import HoldMode
from capsule_ros.serving.session import PolicySession
from capsule_ros.updates.watch import ModelUpdateWatch

LOG = logging.getLogger(__name__)


class PolicyNode(ServingNode):
    """See the module docstring."""

    def __init__(self, node_name: str = "capsule_policy", **kwargs: Any):
        super().__init__(node_name, **kwargs)
        self.session: Optional[PolicySession] = None
        self._prepared: Optional[PreparedServing] = None
        self._watch: Optional[ModelUpdateWatch] = None       # the capsule directory's model updates (configure)
        self._device = "cpu"                                # the served runtime's (activate)
        self.io = RobotIO(self, self._service_threads, self._service_group, self._control_group)
        self.actions, self.recording, self.facade = self.io.actions, self.io.recording, self.io.facade

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.facade.active

    @property
    def lifecycle_state(self) -> str:
        return self.facade.lifecycle_state

    def _offer_servers(self) -> None:
        self.io.offer_servers()

    @property
    def capsule_services(self) -> Any:
        return self.io.capsule_services

    @property
    def run_policy(self) -> Any:
        return self.io.run_policy

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
            options = SessionOptions(clock_ns=self._now_ns, on_event=self.io.on_event,
                                     on_safe_action=self.io.publish_action)
            session = start_session(prepared, options=options, streams=self._streams, watch=self._watch,
                                    warm_up=False,            # below, once the heap is settled
                                    check_beside=True)        # where runtime.state_check_timing says so
            if self._watch is not None:
                self._watch.start(config)     # capsules.regenerate_stale: in the background
            served = session.status()
            self._device = served.device
            self.io.serve(session, config, served.action_dim)
            self.session, self._prepared = session, None
            self._start_status_timer(config.control.status_rate_hz)
            self._watch_clock()
            if config.record.enabled:
                self.recording.start(config, served.fingerprint)
        else:                   # after a deactivate: its interrupted episode resumes, the verbs are served
            self.session.resume(TRANSITION_BOUNDARY_S)
        if not self._settled:
            settle_after_start()                       # no multi-ms garbage collections during the loop
            self._settled = True
        session = self.session
        session.warm_up()                              # the first active step is not a cold one
        self.io.subscribe_ports(config, self._on_port_message)
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
        self._stop_stepping()
        self.io.deactivated(capsule)
        if capsule is not None:
            self.get_logger().info(f"deactivated at step {session.episode.step}: boundary capsule {capsule.id}; "
                                   "activate resumes from it")

    def _cleanup(self) -> None:
        self._stop_stepping()
        self._unwatch_clock()
        self.io.release()
        self._stop_status_timer()
        session, self.session, self._prepared, self.config = self.session, None, None, None
        self._watch = None                              # closed with the session
        if self._settled:
            unsettle()                                  # start-up's objects can be collected again
            self._settled = False
        if session is not None:
            session.release(TRANSITION_BOUNDARY_S)
            del session
            release_device_memory(torch.device(self._device), cublas_workspaces=True)   # its graphs are gone

    def _stop_stepping(self) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        self.io.unsubscribe_ports()

    # -- the clock --------------------------------------------------------------------------------
    def _follow_clock_jump(self, delta_ns: int) -> None:
        """The session's ports follow the node's clock (``SessionLoop.clock_jumped``)."""
        if self.session is not None:
            self.session.loop.clock_jumped(delta_ns)

    def _on_port_message(self, name: str, msgtype: str, msg: Any) -> None:
        """A sensor message (``RobotIO.feed``: recorded, staged, and on the trigger port in
        trigger mode a step), then what the step handed out."""
        session = self.session
        if session is None or not self.facade.active:
            return
        fed = self.io.feed(session.loop, name, msgtype, msg, self._now_ns())
        if fed.stepped:
            self.io.after_tick(fed.record)

    def _on_timer(self) -> None:
        session = self.session
        if session is not None and self.facade.active:
            self.io.after_tick(session.loop.tick())

    # -- status and parameters ---------------------------------------------------------------------
    def _publish_status(self) -> None:
        self.io.publish_status()

    def _apply_live(self, new: ServingConfig) -> None:
        """Make the live settings of ``new`` take effect on the configured node: the control
        loop and the ports (the session's ``reconfigure``, at a boundary), the status rate,
        the recording (``record.enabled``: start or stop it now, once there is a session;
        directory and storage: the next recording), the outputs' trajectory points. What
        can fail comes first, and a failure leaves everything as it was."""
        old = self.config
        assert old is not None
        config, time_steps = self._live_config(new)
        control, ports = config.control, config.ports
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
        self.actions.retune(config.outputs, time_steps)
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
        super().close()
        self.io.close_servers()
        if self.session is not None:
            self.session.close()
        self.io.close_recording()
        self._log_bridge.remove()
