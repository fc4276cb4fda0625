"""``FleetNode`` (the `fleet_node` executable): many robots served from the batch slots of one runtime (docs/fleet.md),
each robot with ``policy_node``'s interface under its own namespace.

``FleetNode`` is a lifecycle node (``/<ns>/capsule_fleet``) over a ``FleetSession``
(``capsule_ros.fleet``: one copy of the weights, one arena of ``fleet.slots`` slots, one
program over all of them, one capsule store and directory). For every robot of
``fleet.robots`` it keeps a plain rclpy node ``/<ns>/<robot>/capsule_policy`` in the same
process and executor, carrying that robot's ``RobotIO`` (``capsule_ros.ros.robot_io``, the
very interface ``policy_node`` offers): its sensor ports (relative topics resolve in the
robot's namespace: ``/<ns>/<robot>/arm/joint_states``), ``~/action`` and the command
outputs, ``~/capsule_events``, ``~/status``, the capsule services and ``~/run_policy``. So a
robot, a simulator or a behaviour tree that talked to ``policy_node`` launched in namespace
``<robot>`` talks to its robot of the fleet unchanged.

The fleet node holds the parameters (``policy_node``'s, every robot shares them, and
``fleet.*``), the lifecycle (configure / activate / deactivate / cleanup act on every robot
at once), the timers and the clock. Stepping: a robot's trigger message asks for a step
and the fleet gathers the requests into one fleet step (``fleet.gather_ms``: a timer steps
the robots that asked when the oldest has waited that long); in timer mode the fleet's
timer steps every robot at ``control.rate_hz``. Every action record of a fleet step is
published by its robot's ``RobotIO`` (``on_action``). The robots' nodes take the fleet
node's context but not the process's command-line arguments (their namespace would be
overridden by a launch's ``__ns`` remap), and their clock is the fleet node's.

Not offered yet: capsule model-update watching (``capsules.regenerate_stale``) and the
fleet's own status topic (``FleetSession.status()`` is in the log at activate only).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch
from rclpy.node import Node

from capsule_ros.fleet.config import FleetConfig
from capsule_ros.fleet.factory import PreparedFleet, prepare_fleet, start_fleet
from capsule_ros.fleet.replay import fleet_record
from capsule_ros.fleet.session import FleetSession
from capsule_ros.ros.params import declare_fleet_parameters, parameter_values
from capsule_ros.ros.robot_io import RobotIO
from capsule_ros.ros.serving_node import ServingNode
from capsule_ros.runtime.engine import release_device_memory
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import settle_mode
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.process import settle_after_start, unsettle
from capsule_ros.serving.records import ActionRecord, HoldMode

ROBOT_NODE_NAME = "capsule_policy"      # each robot's node: policy_node's name, in the robot's namespace
MIN_GATHER_TIMER_S = 1e-4


def fleet_parameters(node: Node) -> FleetConfig:
    """The node's ``fleet.*`` parameters, validated (ConfigError)."""
    return FleetConfig.from_mapping(parameter_values(node, groups={"fleet"}).get("fleet", {}))


class FleetNode(ServingNode):
    """See the module docstring."""

    def __init__(self, node_name: str = "capsule_fleet", **kwargs: Any):
        super().__init__(node_name, extra_parameters=declare_fleet_parameters, **kwargs)
        self.fleet_config = fleet_parameters(self)           # read-only: the robots' nodes are made once
        self.fleet: Optional[FleetSession] = None
        self._prepared: Optional[PreparedFleet] = None
        self._device = "cpu"
        self._active = False
        self._lifecycle_state = "unconfigured"
        self._gather_timer: Any = None
        namespace = self.get_namespace().rstrip("/")
        self.robot_nodes: Dict[str, Node] = {
            name: Node(ROBOT_NODE_NAME, namespace=f"{namespace}/{name}", context=self.context,
                       use_global_arguments=False, start_parameter_services=False)
            for name in self.fleet_config.robots}
        self.robots: Dict[str, RobotIO] = {
            name: RobotIO(node, self._service_threads, self._service_group, self._control_group, self.get_clock())
            for name, node in self.robot_nodes.items()}

    @property
    def companion_nodes(self) -> List[Node]:
        """The robots' nodes, spun by the same executor (``capsule_ros.ros.entry.run_node``)."""
        return list(self.robot_nodes.values())

    @property
    def active(self) -> bool:
        return self._active

    @property
    def lifecycle_state(self) -> str:
        return self._lifecycle_state

    def _set_state(self, state: str) -> None:
        self._active, self._lifecycle_state = state == "active", state
        for io in self.robots.values():
            io.facade.active, io.facade.lifecycle_state = self._active, state

    def _offer_servers(self) -> None:
        for io in self.robots.values():
            io.offer_servers()

    # -- lifecycle ---------------------------------------------------------------------------------
    def _configure(self) -> None:
        config = ServingConfig.from_params(parameter_values(self), source="ROS parameters")
        prepared = prepare_fleet(config, fleet_parameters(self), node_name=self.get_fully_qualified_name())
        directory = prepared.serving.directory
        if directory is not None and directory.recovered:
            self.get_logger().warning(f"moved {len(directory.recovered)} unfinished capsule save(s) "
                                      f"aside: {[str(p) for p in directory.recovered]}")
        self.config, self._prepared = config, prepared
        for io in self.robots.values():
            io.facade.config = config
        self._set_state("inactive")
        self.get_logger().info(f"configured: fleet of {prepared.fleet.slot_count} slots for robots "
                               f"{list(prepared.fleet.robots)}, policy {config.policy.kind}, "
                               f"fingerprint {prepared.fingerprint[:12]}")

    def _activate(self) -> None:
        if self.fleet is None:
            assert self._prepared is not None
            # an auto inference delay is measured now: the recorded and reported config carries it
            serving = settle_mode(self._prepared.serving, streams=self._streams)
            prepared = dataclasses.replace(self._prepared, serving=serving)
            self.config = serving.config
            config = serving.config
            fleet = start_fleet(prepared, options=self._robot_options, on_action=self._on_action,
                                streams=self._streams)
            for name, io in self.robots.items():
                served = fleet.robot(name)
                picture = served.status()
                self._device = picture.device
                io.serve(served.session, config, picture.action_dim)
                io.recording.fleet = fleet_record(fleet, name)
                if config.record.enabled:
                    io.recording.start(config, picture.fingerprint)
            self.fleet, self._prepared = fleet, None
            self._start_status_timer(config.control.status_rate_hz)
            self._watch_clock()
        else:                   # after a deactivate: the interrupted episodes resume
            self.fleet.resume()
        live_config, fleet = self.config, self.fleet
        assert live_config is not None and fleet is not None
        config = live_config
        if not self._settled:
            settle_after_start()                       # no multi-ms garbage collections during the loop
            self._settled = True
        for robot in fleet.robots.values():
            robot.session.warm_up()
        self._gather_timer = self.create_timer(max(fleet.gather.wait_s, MIN_GATHER_TIMER_S), self._on_gather_timer,
                                               callback_group=self._control_group)
        self._gather_timer.cancel()                    # started by the first request of a gather
        for name, io in self.robots.items():
            io.subscribe_ports(config, self._port_callback(name))
        self._configure_loop(config.control)
        self._set_state("active")
        shape = fleet.status()
        self.get_logger().info(f"serving {len(shape.robots)} robot(s) in {shape.slot_count} slots on "
                               f"{self._device} ({shape.batching}), {config.control.mode} mode")

    def _deactivate(self) -> None:
        """Every robot's verbs refused and its running episode interrupted at the shared
        boundary (each INTERRUPT publishes that robot's safe action); stepping stops."""
        fleet, config = self.fleet, self.config
        assert fleet is not None and config is not None
        hold = HoldMode.HOLD_ZERO if config.control.deadline_action == "zero" else HoldMode.HOLD_LAST
        refusal = next(iter(self.robots.values())).facade.refusal("inactive")
        capsules = fleet.suspend(refusal, hold)
        self._stop_stepping()
        self._set_state("inactive")
        for name, io in self.robots.items():
            io.deactivated(capsules.get(name))
        self.get_logger().info("deactivated: every robot's episode interrupted; activate resumes them")

    def _cleanup(self) -> None:
        self._stop_stepping()
        self._unwatch_clock()
        for io in self.robots.values():
            io.release()
        self._set_state("unconfigured")
        self._stop_status_timer()
        fleet, self.fleet, self._prepared, self.config = self.fleet, None, None, None
        if self._settled:
            unsettle()
            self._settled = False
        if fleet is not None:
            fleet.release()
            del fleet
            release_device_memory(torch.device(self._device), cublas_workspaces=True)   # its graphs are gone

    def _stop_stepping(self) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        if self._gather_timer is not None:
            self.destroy_timer(self._gather_timer)
            self._gather_timer = None
        for io in self.robots.values():
            io.unsubscribe_ports()

    def _robot_options(self, name: str) -> SessionOptions:
        """A robot's session: the fleet node's clock, its events and safe actions on its interface."""
        io = self.robots[name]
        return SessionOptions(clock_ns=self._now_ns, on_event=io.on_event, on_safe_action=io.publish_action)

    # -- stepping ----------------------------------------------------------------------------------
    def _port_callback(self, robot: str):
        def on_message(port: str, msgtype: str, msg: Any) -> None:
            self._on_port_message(robot, port, msgtype, msg)
        return on_message

    def _on_port_message(self, robot: str, port: str, msgtype: str, msg: Any) -> None:
        """A robot's sensor message: recorded and staged through its fleet loop; a trigger
        asks for a fleet step (run at once when the gather is complete, else by the gather
        timer). The records go out through ``_on_action``."""
        fleet = self.fleet
        if fleet is None or not self._active:
            return
        self.robots[robot].feed(fleet.robot(robot).loop, port, msgtype, msg, self._now_ns())
        if fleet.next_poll() is None:
            return
        if fleet.gather.due():                      # fleet.gather_ms = 0: no wait
            fleet.poll()
        elif self._gather_timer is not None and self._gather_timer.is_canceled():
            self._gather_timer.reset()

    def _on_gather_timer(self) -> None:
        fleet = self.fleet
        if fleet is None or not self._active:
            return
        fleet.poll()
        if fleet.next_poll() is None and self._gather_timer is not None:
            self._gather_timer.cancel()

    def _on_timer(self) -> None:
        fleet = self.fleet
        if fleet is not None and self._active:
            fleet.tick_timer()

    def _on_action(self, robot: str, record: ActionRecord) -> None:
        """Every action record of a fleet step, on the thread that ran it: published on the
        robot's interface, and told to its running goal."""
        io = self.robots[robot]
        if io.facade.session is not None:
            io.after_tick(record)

    def _follow_clock_jump(self, delta_ns: int) -> None:
        if self.fleet is not None:
            for robot in self.fleet.robots.values():
                robot.loop.clock_jumped(delta_ns)

    # -- status and parameters ---------------------------------------------------------------------
    def _publish_status(self) -> None:
        for io in self.robots.values():
            io.publish_status()

    def _apply_live(self, new: ServingConfig) -> None:
        """The live settings of ``new`` for every robot: the control loop and the ports (each
        robot's session ``reconfigure``, then the fleet's gather follows the step modes), the
        outputs' trajectory points, the recordings, and the fleet's timers."""
        old = self.config
        assert old is not None
        config, time_steps = self._live_config(new)
        fleet = self.fleet
        if fleet is not None:
            for robot in fleet.robots.values():
                robot.session.reconfigure(config.control, config.ports)
            fleet.reconfigured()
        for io in self.robots.values():
            io.actions.retune(config.outputs, time_steps)
            io.facade.config = config
            if fleet is not None and config.record.enabled and not old.record.enabled and not io.recording.active:
                io.recording.start(config, fleet.runtime.fingerprint)
            if old.record.enabled and not config.record.enabled and io.recording.active:
                io.recording.stop()
        self.config = config
        if self._prepared is not None:
            self._prepared = dataclasses.replace(self._prepared,
                                                 serving=dataclasses.replace(self._prepared.serving, config=config))
        control = config.control
        if (control.mode, control.rate_hz) != (old.control.mode, old.control.rate_hz) and self._active:
            self._configure_loop(control)
        if control.status_rate_hz != old.control.status_rate_hz and self._status_timer is not None:
            self._start_status_timer(control.status_rate_hz)

    # -- process exit ------------------------------------------------------------------------------
    def close(self) -> None:
        """As ``PolicyNode.close``, for every robot: the service threads, the goals, the
        sessions' watchdogs, the recordings, the log bridge."""
        self._active = False
        super().close()
        for io in self.robots.values():
            io.close_servers()
        if self.fleet is not None:
            for robot in self.fleet.robots.values():
                robot.session.close()
        for io in self.robots.values():
            io.close_recording()
        self._log_bridge.remove()

    def destroy_node(self) -> None:
        for node in self.robot_nodes.values():
            node.destroy_node()
        super().destroy_node()
