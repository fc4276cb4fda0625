"""The control loop at the session level (no ROS): what ``PolicySession.feed`` and
``tick`` decide and count for the node (trigger steps, dropped, undecodable and stale
inputs, throttled warnings), on the session's clock, and run-time reconfiguration as a
session verb under the boundary."""
from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
from runtime_fixtures import default_config, logged

from capsule_ros.errors import Busy, InvalidArgument, WrongState
from capsule_ros.serving.factory import build_session
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.records import ActionSource, EventKind


def joint_state(stamp_s: int, values=(0.1, 0.2, 0.0, 0.0)):
    """A JointState-like message (port adapters read attributes of any message object)."""
    header = SimpleNamespace(stamp=SimpleNamespace(sec=stamp_s, nanosec=0))
    return SimpleNamespace(header=header, name=["shoulder", "elbow"], position=list(values[:2]),
                           velocity=list(values[2:]))


def goal(stamp_s: int, x: float = 0.3, y: float = 0.4):
    return SimpleNamespace(header=SimpleNamespace(stamp=SimpleNamespace(sec=stamp_s, nanosec=0)),
                           point=SimpleNamespace(x=x, y=y, z=0.0))


@pytest.fixture
def warned():
    """The session's warnings, as its control loop's logger handles them."""
    with logged("capsule_ros.serving.loop") as records:
        yield records


@pytest.fixture
def clocked(tmp_path):
    """A session whose clock the test sets (``now[0]``, ns), its events in ``events``; the
    goal port goes stale after 100 ms."""
    now, events = [10**18], []
    session = build_session(default_config(tmp_path, ports={"goal": {"staleness_ms": 100.0}}),
                            options=SessionOptions(clock_ns=lambda: now[0], on_event=events.append))
    del events[:]                                      # the autostart's RESET
    return session, now, events


def test_feed_steps_on_the_trigger_port_only_and_stages_the_rest(clocked):
    session, now, _ = clocked
    fed = session.loop.feed("goal", goal(1))
    assert fed.accepted and not fed.stepped and fed.record is None
    fed = session.loop.feed("joints", joint_state(1))
    assert fed.accepted and fed.stepped and fed.record.source == ActionSource.POLICY
    assert fed.record.stamp_ns == 1_000_000_000 and session.episode.step == 1      # stamped with the message's stamp
    staged = session.loop.feed("joints", joint_state(2), stage_only=True)
    assert staged.accepted and not staged.stepped and session.episode.step == 1
    assert session.loop.feed("joints", joint_state(3), late=True).record.late    # a re-enacted deadline miss


def test_dropped_and_undecodable_messages_are_counted_and_warned_once_per_period(clocked, warned):
    session, now, _ = clocked
    for _ in range(3):
        fed = session.loop.feed("joints", joint_state(1, values=(float("nan"), 0.0, 0.0, 0.0)))
        assert not fed.accepted and fed.drop.reason == "nonfinite" and not fed.stepped
    assert session.loop.feed("joints", None).drop.reason == "type"               # could not be decoded
    assert session.loop.feed("goal", object()).drop.reason == "type"             # unreadable fields
    counters = session.parts.loop.ports["joints"].counters
    assert counters.dropped["nonfinite"] == 3 and counters.dropped["type"] == 1
    assert session.parts.loop.ports["goal"].counters.dropped["type"] == 1
    warnings = [r.getMessage() for r in warned if "dropped a message" in r.getMessage()]
    assert len(warnings) == 3, warnings          # one per port and cause within the period, not one per message


def test_a_port_that_keeps_sending_garbage_is_warned_about_every_period_with_the_count(clocked, warned):
    """Drops are throttled the ROS way, per port and cause: a WARN at most once per period
    with the count since the last one, so the log shows a sensor that keeps failing."""
    session, now, _ = clocked
    notices = session.parts.loop.notices
    seconds = [100.0]
    notices.clock = lambda: seconds[0]               # the throttle's monotonic clock, set by the test
    nan = joint_state(1, values=(float("nan"), 0.0, 0.0, 0.0))

    def drops() -> list:
        return [r.getMessage() for r in warned if "port joints: dropped" in r.getMessage()]
    for _ in range(4):
        session.loop.feed("joints", nan)
    session.loop.feed("joints", None)                 # another cause: not hidden by the first
    assert len(drops()) == 2 and "(nonfinite)" in drops()[0] and "(type)" in drops()[1], drops()
    for _ in range(4):
        seconds[0] += notices.period_s / 2
        session.loop.feed("joints", nan)
    assert len(drops()) == 4, drops()             # two periods passed: two more warnings, each with its count
    assert "dropped 5 messages (nonfinite) since the last warning" in drops()[2], drops()
    assert "dropped 2 messages (nonfinite) since the last warning" in drops()[3], drops()
    assert session.parts.loop.ports["joints"].counters.dropped["nonfinite"] == 8


def test_a_stale_port_counts_a_stale_step_on_the_sessions_clock(clocked):
    session, now, _ = clocked
    session.loop.feed("goal", goal(1))
    session.loop.feed("joints", joint_state(1))
    now[0] += 50_000_000                                         # 50 ms later: fresh
    assert session.loop.feed("joints", joint_state(2)).record.source == ActionSource.POLICY
    assert session.parts.loop.ports["goal"].counters.stale_steps == 0
    now[0] += 200_000_000                                        # 250 ms since the goal: stale
    session.loop.feed("joints", joint_state(3))
    session.loop.feed("joints", joint_state(4))
    assert session.parts.loop.ports["goal"].counters.stale_steps == 2
    assert session.parts.loop.ports["joints"].counters.stale_steps == 0     # it triggered the step: fresh
    picture = {p.name: p for p in session.status().ports}
    assert picture["goal"].stale_steps == 2 and picture["goal"].age_ms == pytest.approx(250.0)
    session.verbs.interrupt()
    session.loop.feed("joints", joint_state(5))                       # a safe action: no stale step counted
    assert session.parts.loop.ports["goal"].counters.stale_steps == 2


def test_a_clock_that_goes_back_is_a_jump_the_ports_follow(clocked, warned):
    """A simulated clock looping back 10 s (``ros2 bag play --clock --loop``): the sensors'
    stamps start over and are taken, the jump is counted once, and a port that is not
    refreshed keeps ageing across the jump, so it goes stale after its bound."""
    session, now, events = clocked
    session.loop.feed("goal", goal(100))
    assert session.loop.feed("joints", joint_state(100)).record.source == ActionSource.POLICY
    now[0] += 50_000_000
    assert session.loop.feed("joints", joint_state(101)).accepted
    now[0] -= 10_000_000_000                                     # the clock goes back 10 s
    fed = session.loop.feed("joints", joint_state(91))                # stamped on the new timeline
    assert fed.accepted and fed.record.source == ActionSource.POLICY, fed.drop
    counters = session.parts.loop.counters
    assert counters.clock_jumps == 1 and counters.last_clock_jump_ns == -10_000_000_000
    assert [e.detail for e in events if e.kind == EventKind.CLOCK_JUMP] == ["-10000000000 ns"]
    assert any("the clock jumped -10.000 s" in r.getMessage() for r in warned)
    assert session.parts.loop.ports["goal"].counters.stale_steps == 0     # 50 ms old, on either timeline
    now[0] += 60_000_000                                         # 110 ms since the goal: stale
    session.loop.feed("joints", joint_state(92))
    assert session.parts.loop.ports["goal"].counters.stale_steps == 1
    assert {p.name: p.age_ms for p in session.status().ports}["goal"] == pytest.approx(110.0)
    now[0] -= 5_000_000_000
    session.loop.clock_jumped(-5_000_000_000)                         # the node's jump callback: not counted again
    assert session.loop.feed("joints", joint_state(80)).accepted and session.parts.loop.counters.clock_jumps == 2
    dropped = session.parts.loop.ports["joints"].counters.dropped
    assert dropped["out_of_order"] == 0 and dropped["future"] == 0


def test_ticks_before_every_input_has_a_value_wait_and_say_which(clocked, warned):
    session, now, _ = clocked
    assert session.loop.feed("joints", joint_state(1)).record is None
    assert session.loop.tick() is None
    assert any("waiting for first message on port(s) ['goal']" in r.getMessage() for r in warned)


def test_reconfigure_takes_effect_at_a_boundary_and_refuses_what_shapes_the_graph(clocked):
    session, now, _ = clocked
    control = dataclasses.replace(session.loop.control, deadline_action="zero", service_timeout_ms=120.0)
    goal_port = dataclasses.replace(session.parts.loop.ports["goal"].config, staleness_ms=5.0)
    session.reconfigure(control, {"goal": goal_port})
    assert session.loop.control is control and session.parts.boundary.timeout_s == pytest.approx(0.12)
    assert session.parts.loop.ports["goal"].config.staleness_ms == 5.0
    reshaped = dataclasses.replace(goal_port, shape=(3,))
    with pytest.raises(InvalidArgument, match="fixed at start-up"):
        session.reconfigure(control, {"goal": reshaped})
    with pytest.raises(InvalidArgument, match="not ports of this session"):
        session.reconfigure(control, {"camera": goal_port})
    with pytest.raises(InvalidArgument, match="trigger_port"):
        session.reconfigure(dataclasses.replace(control, trigger_port="camera"))
    assert session.parts.loop.ports["goal"].config is goal_port and session.loop.control is control  # nothing changed


def test_reconfigure_waits_for_the_boundary_like_any_verb(clocked):
    session, now, _ = clocked
    held, done = threading.Event(), threading.Event()

    def verb():
        with session.parts.boundary.held():                  # a verb that holds the boundary a while
            held.set()
            done.wait(10)
    thread = threading.Thread(target=verb)
    thread.start()
    assert held.wait(10)
    try:
        with pytest.raises(Busy):
            session.reconfigure(dataclasses.replace(session.loop.control, service_timeout_ms=1.0))
    finally:
        done.set()
        thread.join()
    assert session.loop.control.service_timeout_ms != 1.0


def test_a_released_session_answers_wrong_state(tmp_path):
    session = build_session(default_config(tmp_path))
    session.release()
    with pytest.raises(WrongState, match="released"):
        session.verbs.commit()
    with pytest.raises(WrongState):
        session.loop.tick()
