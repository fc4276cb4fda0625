"""PolicyNode in this process, its lifecycle driven by calling the transitions (as rclpy's
own lifecycle tests do, no other process): what each transition does to the session and
to the services' answers, parameters as a session verb, and the servers offered only
once the node can answer. The cross-process tests (test_lifecycle.py) drive the
installed executable through ~/change_state."""
from __future__ import annotations

import pytest
import yaml
from harness import DEFAULT_PARAMS, unique_ns

from capsule_ros.errors import ErrorCode
from capsule_ros.serving.records import ActionSource, EpisodeState
from capsule_ros.serving.verbs import BY_NAME

pytestmark = pytest.mark.ros


@pytest.fixture
def make_node(tmp_path, rclpy_context):
    """``make_node(**params)``: a PolicyNode of config/policy.yaml plus ``params`` (nested),
    random weights, capsules in the test's directory, unconfigured (autostart off)."""
    from rclpy.lifecycle import TransitionCallbackReturn

    from capsule_ros.ros.node import PolicyNode
    made = []

    def make(**params):
        overlay = tmp_path / f"overlay{len(made)}.yaml"
        base = {"policy": {"weights": ""}, "lifecycle": {"autostart": False},
                "capsules": {"directory": str(tmp_path / "capsules")}}
        for group, values in params.items():
            base.setdefault(group, {}).update(values)
        overlay.write_text(yaml.safe_dump({"/**": {"ros__parameters": base}}))
        node = PolicyNode(namespace=unique_ns("inproc"),
                          cli_args=["--ros-args", "--params-file", str(DEFAULT_PARAMS), "--params-file", str(overlay)])
        made.append(node)
        return node

    make.SUCCESS = TransitionCallbackReturn.SUCCESS
    make.FAILURE = TransitionCallbackReturn.FAILURE
    yield make
    for node in made:
        if node.session is not None:
            node.trigger_shutdown()
        node.close()
        node.destroy_node()


def answer(node, verb: str, **fields):
    """What the node's service for ``verb`` answers (its handler, called on this thread)."""
    from capsule_ros.ros.messages import srv_type
    service = srv_type(BY_NAME[verb])
    return node.capsule_services.answer(BY_NAME[verb], service.Request(**fields), service.Response())


def test_transitions_build_interrupt_resume_and_release_the_session(make_node):
    node = make_node()
    assert node.capsule_services is None and node.run_policy is None    # nothing offered before start()
    node.start()                                                      # autostart off: offered, unconfigured
    assert node.capsule_services is not None and node.session is None
    refused = answer(node, "commit")
    assert not refused.success and refused.error_code == ErrorCode.WRONG_STATE and "unconfigured" in refused.message

    assert node.trigger_configure() == make_node.SUCCESS
    assert node.session is None and answer(node, "list").error_code == ErrorCode.WRONG_STATE   # inactive
    assert node.trigger_activate() == make_node.SUCCESS
    session = node.session
    assert session.episode.state == EpisodeState.RUNNING and node.active
    committed = answer(node, "commit", label="in process")
    assert committed.success and committed.capsule.label == "in process"

    published = node.actions.published
    assert node.trigger_deactivate() == make_node.SUCCESS                # interrupt: capsule + safe action
    episode = session.episode
    assert not node.active and episode.state == EpisodeState.INTERRUPTED and episode.interrupt_capsule is not None
    assert node.actions.published == published + 1 and node.actions.last.source == ActionSource.HOLD
    assert answer(node, "commit").error_code == ErrorCode.WRONG_STATE
    interrupted_at = session.episode.interrupt_capsule.id

    assert node.trigger_activate() == make_node.SUCCESS                  # resumes from the deactivate's capsule
    episode = session.episode
    assert node.session is session and episode.state == EpisodeState.RUNNING and episode.lineage == interrupted_at

    assert node.trigger_deactivate() == make_node.SUCCESS
    assert node.trigger_cleanup() == make_node.SUCCESS                   # released
    assert node.session is None and not node.actions.outputs
    with pytest.raises(Exception, match="released"):
        session.verbs.commit()
    assert answer(node, "reset").error_code == ErrorCode.WRONG_STATE


def test_a_bad_configuration_fails_configure_with_its_reason_and_a_fix_passes(make_node):
    node = make_node(control={"trigger_port": "gripper"})
    node.start()
    assert node.trigger_configure() == make_node.FAILURE
    assert "control.trigger_port = 'gripper'" in str(node.transition_error)
    from rclpy.parameter import Parameter
    assert node.set_parameters([Parameter("control.trigger_port", value="joints")])[0].successful
    assert node.trigger_configure() == make_node.SUCCESS and node.transition_error is None


def test_run_time_parameters_go_through_the_sessions_reconfigure(make_node):
    from rclpy.parameter import Parameter
    node = make_node()
    node.start()
    node.trigger_configure()
    node.trigger_activate()
    session = node.session
    results = node.set_parameters([Parameter("control.deadline_ms", value=123.0),
                                   Parameter("control.service_timeout_ms", value=250.0),
                                   Parameter("ports.goal.staleness_ms", value=40.0)])
    assert all(r.successful for r in results), results
    assert session.loop.control.deadline_ms == 123.0 and session.parts.boundary.timeout_s == pytest.approx(0.25)
    assert session.parts.loop.ports["goal"].config.staleness_ms == 40.0 and node.config.control.deadline_ms == 123.0
    bad = node.set_parameters([Parameter("control.deadline_action", value="explode")])[0]
    assert not bad.successful and "'explode'" in bad.reason and session.loop.control.deadline_action == "hold"
    read_only = node.set_parameters([Parameter("ports.goal.dtype", value="float64")])[0]
    assert not read_only.successful and session.parts.loop.ports["goal"].config.dtype == "float32"
    assert node.set_parameters([Parameter("control.mode", value="timer")])[0].successful
    assert session.loop.control.mode == "timer" and node.config.control.mode == "timer"


def active_node(make_node, **params):
    node = make_node(**params)
    node.start()
    assert node.trigger_configure() == make_node.SUCCESS and node.trigger_activate() == make_node.SUCCESS
    return node


def in_thread(work, results: dict, name: str):
    import threading
    thread = threading.Thread(target=lambda: results.__setitem__(name, work()), name=name)
    thread.start()
    return thread


def test_a_verb_that_reaches_the_boundary_after_deactivate_is_refused_and_activate_resumes(make_node):
    """The interleaving that broke activate, made deterministic by the boundary's FIFO order:
    a re-entry of a persisted capsule passed the node's "active" check before deactivate and
    reached the boundary after deactivate's interrupt (it had to read the capsule's file
    again: a drop queued ahead of it took the capsule out of memory). It used to re-enter
    and answer success, and every activate after it failed ("reenter without a capsule id
    needs an interrupt capsule (episode is RUNNING)") until cleanup."""
    import threading

    from capsule_ros.polling import wait_until
    node = active_node(make_node)
    session = node.session
    capsule = answer(node, "commit", label="C", persist=True).capsule.id
    boundary, results, release, holding = session.parts.boundary, {}, threading.Event(), threading.Event()

    def a_step_in_progress():
        with boundary.blocking():
            holding.set()
            release.wait(30)
    threads = [threading.Thread(target=a_step_in_progress)]
    threads[0].start()
    assert holding.wait(30)
    for name, work in (("drop", lambda: answer(node, "drop", capsule_id=capsule)),
                       ("reenter", lambda: answer(node, "reenter", capsule_id=capsule)),
                       ("deactivate", node.trigger_deactivate)):
        queued = boundary.queued
        threads.append(in_thread(work, results, name))
        wait_until(lambda q=queued: boundary.queued > q, 30, f"{name} waiting at the boundary")
    release.set()
    for thread in threads:
        thread.join(30)

    assert results["deactivate"] == make_node.SUCCESS
    for verb in ("drop", "reenter"):                      # reached the boundary after deactivate
        assert results[verb].error_code == ErrorCode.WRONG_STATE and "inactive" in results[verb].message, \
            results[verb]
    interrupted_at = session.episode.interrupt_capsule.id
    assert node.trigger_activate() == make_node.SUCCESS, node.transition_error
    assert session.episode.state == EpisodeState.RUNNING and session.episode.lineage == interrupted_at
    assert answer(node, "reenter", capsule_id=capsule).success          # served again


def test_deactivate_and_activate_racing_capsule_verbs_always_leave_a_node_that_activates(make_node):
    """Seeded stress: hundreds of lifecycle round trips, each racing one capsule verb from a
    service thread (a re-entry read from disk, resets from the initial state and from a
    capsule, interrupt, commit), started 0-3 ms apart in either order."""
    import random
    import time
    node = active_node(make_node)
    session = node.session
    persisted = answer(node, "commit", label="C", persist=True).capsule.id
    verbs = {"reenter C from disk": lambda: answer(node, "reenter", capsule_id=persisted),
             "reset": lambda: answer(node, "reset"),
             "reset C": lambda: answer(node, "reset", capsule_id=persisted),
             "interrupt": lambda: answer(node, "interrupt", hold_mode=0, commit=True),
             "commit": lambda: answer(node, "commit", label="racing")}
    rng = random.Random(22)
    answered = {name: {"served": 0, "refused": 0} for name in verbs}
    for trial in range(300):
        if persisted in session.parts.store:
            assert answer(node, "drop", capsule_id=persisted).success       # memory only: its file stays
        name = rng.choice(sorted(verbs))
        offset_s, verb_first = rng.uniform(0.0, 0.003), rng.random() < 0.5
        results: dict = {}
        if verb_first:
            thread = in_thread(verbs[name], results, name)
            time.sleep(offset_s)                          # a jittered start, not a wait for anything
            deactivated = node.trigger_deactivate()
        else:
            thread = in_thread(lambda: (time.sleep(offset_s), verbs[name]())[1], results, name)
            deactivated = node.trigger_deactivate()
        thread.join(30)
        activated = node.trigger_activate()
        context = f"trial {trial}: {name} ({'first' if verb_first else 'second'}, {offset_s * 1e3:.1f} ms)"
        assert deactivated == make_node.SUCCESS and activated == make_node.SUCCESS, (context, node.transition_error)
        response = results[name]
        assert response.success or response.error_code == ErrorCode.WRONG_STATE, (context, response.message)
        answered[name]["served" if response.success else "refused"] += 1
        if session.episode.state == EpisodeState.INTERRUPTED:    # the racing interrupt won: resume for the next trial
            assert answer(node, "reenter").success, context
    assert answer(node, "commit", label="after the storm").success
    assert all(counts["served"] and counts["refused"] for counts in answered.values()), answered   # both sides won


# -- parameters: every writable one does what it answers ------------------------------------------
WITH_OUTPUT = {"outputs": {"names": ["arm"], "arm": {"topic": "arm_controller/joint_trajectory",
                                                    "joints": ["shoulder", "elbow"], "time_step_ms": 50.0}}}


def timer_period_ns(node, clock_type) -> int:
    """The period of the node's timer on ``clock_type`` (status: steady; control: ROS time)."""
    return next(t.timer_period_ns for t in node.timers if t.clock.clock_type == clock_type)


def set_param(node, name: str, value):
    """``node.set_parameters`` of one value (a list is an array of its items' type); its result."""
    from rclpy.parameter import Parameter
    if isinstance(value, list):
        kind = Parameter.Type.INTEGER_ARRAY if all(isinstance(v, int) for v in value) else Parameter.Type.STRING_ARRAY
        return node.set_parameters([Parameter(name, kind, value)])[0]
    return node.set_parameters([Parameter(name, value=value)])[0]


def goal_message(stamp_ns: int):
    from geometry_msgs.msg import PointStamped
    msg = PointStamped()
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(int(stamp_ns), 10**9)
    return msg


def recorded_to(node, answer_fn) -> str:
    """Start and stop a recording through ~/record: the bag's path."""
    started = answer_fn(node, "record", start=True)
    assert started.success, started.message
    stopped = answer_fn(node, "record", start=False)
    assert stopped.success, stopped.message
    return stopped.bag_path


def _live_effects(tmp_path):
    """Each live parameter: a new value and what must hold on the active node right after
    the set answered success (in this order: the control timer is checked in timer mode)."""
    from pathlib import Path

    from rclpy.clock import ClockType
    ros, steady = ClockType.ROS_TIME, ClockType.STEADY_TIME

    def frame_of_a_published_action(node):
        assert answer(node, "interrupt").success and answer(node, "reenter").success
        return node.actions.last.header.frame_id

    def future_drop(node):
        session = node.session
        return session.loop.feed("goal", goal_message(session.parts.loop.now() + 500_000_000)).drop

    return [
        ("control.mode", "timer", lambda n: n.session.loop.control.mode == "timer"
            and timer_period_ns(n, ros) == 50_000_000),
        ("control.rate_hz", 40.0, lambda n: n.session.loop.control.rate_hz == 40.0
            and timer_period_ns(n, ros) == 25_000_000),
        ("control.trigger_port", "goal", lambda n: n.session.loop.control.trigger_port == "goal"),
        ("control.deadline_ms", 123.0, lambda n: n.session.loop.control.effective_deadline_s() == pytest.approx(0.123)),
        ("control.deadline_action", "zero", lambda n: n.session.loop.control.deadline_action == "zero"),
        ("control.future_tolerance_ms", 100.0, lambda n: future_drop(n).reason == "future"),   # 500 ms ahead
        ("control.frame_id", "gripper_base", lambda n: frame_of_a_published_action(n) == "gripper_base"),
        ("control.status_rate_hz", 20.0, lambda n: timer_period_ns(n, steady) == 50_000_000),
        ("control.service_timeout_ms", 250.0, lambda n: n.session.parts.boundary.timeout_s == pytest.approx(0.25)),
        ("ports.joints.staleness_ms", 40.0, lambda n: n.session.parts.loop.ports["joints"].config.staleness_ms == 40.0),
        ("ports.goal.staleness_ms", 60.0, lambda n: n.session.parts.loop.ports["goal"].config.staleness_ms == 60.0),
        ("outputs.arm.time_step_ms", 20.0, lambda n: n.actions.outputs[0].adapter.time_step_s == pytest.approx(0.02)),
        ("outputs.arm.points", 3, lambda n: n.actions.outputs[0].adapter.config.points == 3),
        ("record.directory", str(tmp_path / "other_bags"),
            lambda n: Path(recorded_to(n, answer)).parent == tmp_path / "other_bags"),
        ("record.storage", "sqlite3", lambda n: any(Path(recorded_to(n, answer)).glob("*.db3"))),
        ("record.enabled", True, lambda n: n.recording.active),
        ("record.enabled", False, lambda n: not n.recording.active),
        ("use_sim_time", True,
         lambda n: n.get_clock().ros_time_is_active and n.session.parts.loop.counters.clock_jumps == 1),
    ]


# configure-time parameters: a new value, and what holds after cleanup -> set -> configure -> activate
CONFIGURE_EFFECTS = [
    ("control.autostart", False, lambda n: n.session.episode.state == EpisodeState.IDLE),
    ("control.input_log_steps", 0, lambda n: n.session.parts.recompute.log.capacity == 0),
    ("control.input_log_max_mb", 4096.0, lambda n: n.config.control.input_log_max_mb == 4096.0),
    ("runtime.seed", 7, lambda n: n.session.parts.runtime.config.seed == 7),
    ("runtime.debug_checks", True, lambda n: n.session.parts.runtime.graphs.debug_checks is True),
    ("policy.prefix", [], lambda n: n.session.parts.machine.prefix == ()),
]


def test_every_writable_parameter_takes_effect_when_it_answers_success(make_node, tmp_path):
    node = active_node(make_node, **WITH_OUTPUT)
    live = _live_effects(tmp_path)
    writable = {name for name in node.get_parameters_by_prefix("") if not node.describe_parameter(name).read_only}
    assert writable == {name for name, *_ in live} | {name for name, *_ in CONFIGURE_EFFECTS}, \
        "a writable parameter without an entry here: say what it does and test it"
    for name, value, effect in live:
        result = set_param(node, name, value)
        assert result.successful, (name, result.reason)
        assert effect(node), f"{name} = {value!r} answered success but did not take effect"


def test_configure_time_parameters_are_refused_while_configured_and_apply_at_configure(make_node):
    node = active_node(make_node)
    for name, value, _ in CONFIGURE_EFFECTS:
        if value == []:
            value = [5]
        refused = set_param(node, name, value)
        assert not refused.successful and "takes effect at the next lifecycle configure" in refused.reason, name
        assert "the node is active" in refused.reason
        assert set_param(node, name, node.get_parameter(name).value).successful, f"{name}: its own value"
    assert node.trigger_deactivate() == make_node.SUCCESS
    assert "the node is inactive" in set_param(node, "runtime.seed", 3).reason
    assert node.trigger_cleanup() == make_node.SUCCESS

    # unconfigured: validated all the same; what needs the policy is checked by configure
    for name, bad, why in (("control.mode", "bogus", "must be one of ['timer', 'trigger']"),
                           ("record.storage", "bogus", "must be one of ['mcap', 'sqlite3']"),
                           ("policy.prefix", [-1], "must be >= 0")):
        result = set_param(node, name, bad)
        assert not result.successful and why in result.reason, (name, result.reason)
    for name, bad, why in (("policy.prefix", [1, 2], "this policy has no prefix input"),
                           ("control.input_log_max_mb", 0.001, "over control.input_log_max_mb = 0.001")):
        assert set_param(node, name, bad).successful
        assert node.trigger_configure() == make_node.FAILURE and why in str(node.transition_error), name
        assert set_param(node, name, [] if name == "policy.prefix" else 2048.0).successful
    for name, value, _ in CONFIGURE_EFFECTS:
        assert set_param(node, name, value).successful, name
    assert node.trigger_configure() == make_node.SUCCESS and node.trigger_activate() == make_node.SUCCESS
    for name, value, effect in CONFIGURE_EFFECTS:
        assert effect(node), f"{name} = {value!r} did not take effect at configure"


def test_every_parameter_has_a_value(make_node):
    from rclpy.parameter import Parameter
    node = make_node(**WITH_OUTPUT)
    unset = [name for name, p in node.get_parameters_by_prefix("").items() if p.type_ == Parameter.Type.NOT_SET]
    assert unset == []
    assert node.get_parameter("policy.prefix").type_ == Parameter.Type.INTEGER_ARRAY
    assert node.get_parameter("ports.joints.names").type_ == Parameter.Type.STRING_ARRAY
    assert node.describe_parameter("ports.names").read_only and node.describe_parameter("ports.joints.names").read_only


def test_a_policy_kinds_own_writable_setting_applies_at_configure():
    """The node builds a policy kind's section at configure only, so a setting another
    package did not mark read-only is refused while configured rather than ignored."""
    from dataclasses import dataclass

    from capsule_ros.config import CONFIGURE, LIVE, ConfigSection, setting
    from capsule_ros.ros.params import applies

    @dataclass(frozen=True)
    class OwnKind(ConfigSection):
        SECTION = "policy.own"
        gain: float = setting(1.0, "a gain, not marked read-only")

    gain = next(OwnKind.settings())
    assert applies("policy.own.gain", gain) == CONFIGURE and applies("control.gain", gain) == LIVE
