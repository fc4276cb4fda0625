"""``ServingNode``: the lifecycle node that ``policy_node`` (``capsule_ros.ros.node``) and
``fleet_node`` (``capsule_ros.ros.fleet_node``) share: the parameters (declared from the
config dataclasses, validated as configure validates them, applied as their ``applies``
says), the lifecycle transitions (a failure reports its reason; ``lifecycle.autostart``),
the callback groups and service threads, the control and status timers, the clock's
jump callback, and answers that reach a client discovered late (``capsule_ros.ros.replies``:
the lifecycle and parameter services here, the capsule services where they are made).

What a subclass serves it provides: ``_configure`` / ``_activate`` / ``_deactivate`` /
``_cleanup``, ``_offer_servers``, ``_on_timer``, ``_publish_status``, ``_apply_live``,
``_follow_clock_jump``, and ``active`` / ``lifecycle_state``. Threads and groups: see
``capsule_ros.ros.node``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType, JumpThreshold, TimeJump
from rclpy.duration import Duration
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from capsule_ros.config import APPLIES, CONFIGURE, flatten
from capsule_ros.errors import CapsuleRosError, ConfigError
from capsule_ros.ros.log_bridge import RosLogBridge
from capsule_ros.ros.params import declare_parameters, parameter_values, plain
from capsule_ros.ros.replies import LateReplies
from capsule_ros.ros.robot_io import control_period
from capsule_ros.ros.spinning import Offload
from capsule_ros.runtime.streams import StreamKeeper
from capsule_ros.serving.config import ControlConfig, ServingConfig
from capsule_ros.serving.outputs import point_spacing

TRANSITION_BOUNDARY_S = 5.0     # how long deactivate / cleanup wait for a service to leave the session
# jumps of the node's clock the session hears of: any jump back (a looping bag's /clock), and
# a change of clock (use_sim_time set or cleared); forward jumps need nothing (ages just grow)
CLOCK_JUMPS = JumpThreshold(min_forward=None, min_backward=Duration(nanoseconds=-1), on_clock_change=True)


def _config_error(params: Dict[str, Any]) -> str:
    """What ServingConfig.from_params says about ``params`` ("" when they are valid)."""
    try:
        ServingConfig.from_params(params)
    except ConfigError as exc:
        return str(exc)
    return ""


class ServingNode(LifecycleNode):
    """See the module docstring. ``extra_parameters``: declares a subclass's own parameter
    groups on the node, returning when each takes effect (``fleet_node``'s ``fleet.*``)."""

    def __init__(self, node_name: str, *, extra_parameters: Optional[Callable[[Any], Dict[str, str]]] = None,
                 **kwargs: Any):
        super().__init__(node_name, **kwargs)
        replies = LateReplies(self.get_logger())
        for service in self.services:                  # the lifecycle's and the parameters' services
            replies.keep(service)                      # (the capsule services keep theirs)
        self._applies = declare_parameters(self)         # parameter name -> when a change takes effect
        if extra_parameters is not None:
            self._applies.update(extra_parameters(self))
        self.config: Optional[ServingConfig] = None
        self.transition_error: Optional[BaseException] = None     # why the last transition failed
        self._settled = False
        self._streams = StreamKeeper()             # one CUDA stream across activations (StreamKeeper says why)
        self._raise_transition_errors = False
        self._control_group = MutuallyExclusiveCallbackGroup()
        # services may run side by side (a slow save must not hold up a commit); the session's
        # boundary orders what touches the state
        self._service_group = ReentrantCallbackGroup()
        self._status_group = MutuallyExclusiveCallbackGroup()
        self._service_threads = Offload(self, 4, "capsule-service")
        self._control_timer: Any = None
        self._status_timer: Any = None
        self._steady_clock = Clock(clock_type=ClockType.STEADY_TIME)   # status: also while a sim clock pauses
        self._clock_jump_handle: Any = None        # the session's jump callback on the node's clock
        self._clock_before_jump_ns = 0
        self._log_bridge = RosLogBridge.install(self.get_logger())
        self.add_on_set_parameters_callback(self._on_set_parameters)

    # -- what a subclass serves --------------------------------------------------------------------
    @property
    def active(self) -> bool:
        raise NotImplementedError

    @property
    def lifecycle_state(self) -> str:
        raise NotImplementedError

    def _offer_servers(self) -> None:
        raise NotImplementedError

    def _configure(self) -> None:
        raise NotImplementedError

    def _activate(self) -> None:
        raise NotImplementedError

    def _deactivate(self) -> None:
        raise NotImplementedError

    def _cleanup(self) -> None:
        raise NotImplementedError

    def _on_timer(self) -> None:
        raise NotImplementedError

    def _publish_status(self) -> None:
        raise NotImplementedError

    def _apply_live(self, new: ServingConfig) -> None:
        raise NotImplementedError

    def _follow_clock_jump(self, delta_ns: int) -> None:
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Come up: with ``lifecycle.autostart``, configure and activate now (a failure
        raises the transition's error: the executable exits 2 with it); otherwise wait
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
            if self.active:
                self._deactivate()
            self._cleanup()
        return self._transition("shutdown", shutdown)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition("error recovery", self._cleanup)     # back to unconfigured

    # -- the clock --------------------------------------------------------------------------------
    def _now_ns(self) -> int:
        """The session's clock: the node's (ROS time: simulated with ``use_sim_time``)."""
        return self.get_clock().now().nanoseconds

    def _watch_clock(self) -> None:
        self._clock_jump_handle = self.get_clock().create_jump_callback(
            CLOCK_JUMPS, pre_callback=self._before_clock_jump, post_callback=self._after_clock_jump)

    def _before_clock_jump(self) -> None:
        self._clock_before_jump_ns = self.get_clock().now().nanoseconds

    def _after_clock_jump(self, jump: TimeJump) -> None:
        """The node's clock jumped back or changed (on the executor's thread, between
        messages: its /clock subscription): the sessions' ports follow it
        (``_follow_clock_jump``). The jump is measured here: a change of clock reports none."""
        try:
            self._follow_clock_jump(self.get_clock().now().nanoseconds - self._clock_before_jump_ns)
        except CapsuleRosError as exc:          # released meanwhile: nothing to follow the clock
            self.get_logger().warning(f"clock jump not applied: {exc}")

    def _unwatch_clock(self) -> None:
        if self._clock_jump_handle is not None:
            self._clock_jump_handle.unregister()
            self._clock_jump_handle = None

    # -- timers -----------------------------------------------------------------------------------
    def _configure_loop(self, control: ControlConfig) -> None:
        """The control timer in timer mode (none in trigger mode)."""
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        if control.mode == "timer":
            self._control_timer = self.create_timer(1.0 / control.rate_hz, self._on_timer,
                                                    callback_group=self._control_group)

    def _start_status_timer(self, rate_hz: float) -> None:
        """~/status and /diagnostics at ``rate_hz`` of the steady clock (a new timer replaces the old)."""
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
        self._status_timer = self.create_timer(1.0 / rate_hz, self._publish_status, callback_group=self._status_group,
                                               clock=self._steady_clock)

    def _stop_status_timer(self) -> None:
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
            self._status_timer = None

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
            current = flatten(parameter_values(self, groups=self._groups()))
            late = sorted(name for name, value in changes.items()
                          if self._applies[name] == CONFIGURE and value != current.get(name))
            if late:
                raise ConfigError(f"{', '.join(late)}: {APPLIES[CONFIGURE]}; the node is {self.lifecycle_state}")
        try:
            return ServingConfig.from_params(parameter_values(self, changes), source="ROS parameters")
        except ConfigError as exc:
            if self.config is None and str(exc) == _config_error(parameter_values(self)):
                return None
            raise

    def _groups(self) -> frozenset:
        """The parameter groups of ``self._applies`` (the serving config's and a subclass's)."""
        return frozenset(name.split(".", 1)[0] for name in self._applies)

    def _live_config(self, new: ServingConfig) -> Tuple[ServingConfig, Dict[str, float]]:
        """The configured node's config with ``new``'s live settings (control, ports,
        outputs, record), and each output's point spacing (checked: ConfigError)."""
        old = self.config
        assert old is not None
        control = old.control.with_live_settings(new.control)
        ports = {name: port.with_live_settings(new.ports[name]) for name, port in old.ports.items()}
        outputs = {name: output.with_live_settings(new.outputs[name]) for name, output in old.outputs.items()}
        config = dataclasses.replace(old, control=control, ports=ports, outputs=outputs,
                                     record=old.record.with_live_settings(new.record))
        period = control_period(control)
        return config, {name: point_spacing(name, output, period) for name, output in outputs.items()}

    def close(self) -> None:
        """The node's own threads (``capsule_ros.ros.entry`` calls it after the executor
        stopped): the clock's callback, the service threads; subclasses add theirs."""
        self._unwatch_clock()
        self._service_threads.shutdown()
