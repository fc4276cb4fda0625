"""policy_node through ROS: ports, both step modes, the services and their error paths,
bit-identical re-entry, interrupt/hold, deadlines, status, parameters, malformed floods.

Every test talks to the installed executable in its own process over real topics and
services; the policy has random (seeded) weights so the tests do not depend on training.
The tests of the module's node get it restored to a fresh node's state (``node``); those
that need another configuration start their own.
"""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from harness import (
    ClientNode,
    Driver,
    action_bytes,
    observations,
    restore_node,
    set_params,
    start_policy_node,
    wait_for,
)

pytestmark = pytest.mark.ros
NS = "/tn"
BASELINE = {"control__deadline_ms": 2000.0}      # the run-time parameters every test starts from


@pytest.fixture(scope="module")
def shared(tmp_path_factory, rclpy_context):
    tmp = tmp_path_factory.mktemp("trigger_node")
    params = {"policy": {"weights": ""}, "control": {"deadline_ms": BASELINE["control__deadline_ms"]},
              # a flood of 1,000 messages must not overflow the readers' history (it would be lost
              # in DDS before the node could count it)
              "ports": {"joints": {"qos": "reliable", "depth": 2000}, "goal": {"depth": 2000}}}
    proc = start_policy_node(tmp, params, namespace=NS)
    client = ClientNode(rclpy_context, "node_test_client", node_path=f"{NS}/capsule_policy")
    driver = Driver(client, NS)
    driver.send_goal()
    yield proc, client, driver, tmp
    client.close()
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def node(shared):
    """The module's node, put back before each test as a fresh one comes up (``restore_node``):
    the tests reset, commit, interrupt, drop and set parameters on it."""
    proc, client, driver, tmp = shared
    restore_node(client, BASELINE)
    for q in (driver.actions, driver.events):
        ClientNode.drain(q)
    return shared


def test_trigger_mode_publishes_one_action_per_message(node):
    proc, client, driver, _ = node
    actions = driver.run(observations(15, 1))
    steps = [a.step for a in actions]
    assert steps == list(range(steps[0], steps[0] + 15))
    for a in actions:
        assert a.source == a.SOURCE_POLICY and len(a.values) == 2 and a.action_dim == 2
        assert len(a.chunk) == a.chunk_horizon * a.action_dim == 16
        assert np.isfinite(a.values).all()
    assert len({a.episode_id for a in actions}) == 1


def test_commit_then_reenter_replays_bit_identically_through_ros(node):
    proc, client, driver, _ = node
    driver.run(observations(5, 2))
    capsule = client.capsules.commit(label="k").capsule
    obs = observations(40, 3)
    first = driver.run(obs)
    response = client.capsules.reenter(capsule.id)
    assert response.rollback and not response.fallback and response.capsule.step == capsule.step
    second = driver.run(obs)
    assert [a.step for a in second] == [a.step for a in first]
    assert action_bytes(second) == action_bytes(first)
    assert all(a.lineage == capsule.id for a in second[:1])


def test_interrupt_publishes_safe_action_stops_stepping_and_reenter_resumes(node):
    from capsule_ros.srv import Interrupt
    proc, client, driver, _ = node
    driver.run(observations(3, 4))
    reference_point = client.capsules.commit(label="before interrupt").capsule
    ClientNode.drain(driver.actions)
    response = client.capsules.interrupt(hold_mode=Interrupt.Request.HOLD_ZERO, commit=True)
    boundary = response.capsule
    safe = driver.actions.get(timeout=5)
    assert safe.source == safe.SOURCE_ZERO and list(safe.values) == [0.0, 0.0] and len(safe.chunk) == 0
    held = driver.run(observations(5, 5))
    assert all(a.source == a.SOURCE_ZERO and a.step == boundary.step for a in held)
    status = driver.latest_status()
    assert status.episode_state == status.INTERRUPTED
    resumed = client.capsules.reenter()
    assert resumed.capsule.id == boundary.id and not resumed.rollback
    obs = observations(10, 6)
    after_interrupt = driver.run(obs)
    assert after_interrupt[0].step == boundary.step + 1
    client.capsules.reenter(reference_point.id)
    uninterrupted = driver.run(obs)
    assert action_bytes(after_interrupt) == action_bytes(uninterrupted)


def test_hold_last_and_silent_modes(node):
    from capsule_ros.srv import Interrupt
    proc, client, driver, _ = node
    last = driver.run(observations(2, 7))[-1]
    client.capsules.interrupt(hold_mode=Interrupt.Request.HOLD_LAST, commit=False)
    held = driver.step(observations(1, 8)[0])
    assert held.source == held.SOURCE_HOLD and list(held.values) == list(last.values)
    client.capsules.reenter()
    client.capsules.interrupt(hold_mode=Interrupt.Request.HOLD_SILENT, commit=False)
    driver.step(observations(1, 9)[0], expect_action=False)     # taken, and no action came of it
    client.capsules.reenter()


def test_reset_starts_a_new_episode_from_initial_state_or_capsule(node):
    proc, client, driver, _ = node
    before = driver.run(observations(3, 10))[-1]
    capsule = client.capsules.commit(label="for reset").capsule
    response = client.capsules.reset()
    assert response.episode_id == before.episode_id + 1
    first = driver.step(observations(1, 11)[0])
    assert first.episode_id == response.episode_id and first.step == 1 and first.lineage == ""
    response2 = client.capsules.reset(capsule.id)
    assert response2.episode_id == response.episode_id + 1 and response2.capsule.id == capsule.id
    nxt = driver.step(observations(1, 12)[0])
    assert nxt.episode_id == response2.episode_id and nxt.step == capsule.step + 1


def test_fork_list_save_drop_load(node):
    proc, client, driver, tmp = node
    driver.run(observations(2, 13))
    capsule = client.capsules.commit(label="source").capsule
    fork = client.capsules.fork(capsule.id, label="branch").capsule
    assert fork.id != capsule.id and fork.parent_id == capsule.id and fork.step == capsule.step
    ids = [c.id for c in client.capsules.list().capsules]
    assert capsule.id in ids and fork.id in ids
    saved = client.capsules.save(fork.id)
    assert os.path.exists(saved.path) and stat.S_IMODE(os.stat(saved.path).st_mode) == 0o600
    assert saved.capsule.persisted
    client.capsules.drop(fork.id)
    listed = {c.id: c for c in client.capsules.list().capsules}
    assert listed[fork.id].tier == listed[fork.id].TIER_DISK          # only on disk now
    loaded = client.capsules.load(fork.id).capsule
    assert loaded.id == fork.id and loaded.step == fork.step and loaded.tier != loaded.TIER_DISK
    obs = observations(8, 14)
    client.capsules.reenter(capsule.id)
    from_source = driver.run(obs)
    client.capsules.reenter(fork.id)
    from_fork = driver.run(obs)
    assert action_bytes(from_source) == action_bytes(from_fork)
    client.capsules.drop(fork.id, from_disk=True)
    assert not os.path.exists(saved.path)
    current = client.capsules.list(current_episode_only=True).capsules
    assert all(c.episode_id == capsule.episode_id for c in current)


def test_error_paths_answer_their_code_and_change_nothing(node):
    from capsule_ros.errors import ErrorCode as E
    from capsule_ros.srv import Commit, DropCapsule, Fork, Interrupt, LoadCapsule, Reenter, Reset, SaveCapsule
    proc, client, driver, tmp = node
    driver.run(observations(2, 15))
    anchor = client.capsules.commit(label="anchor").capsule
    status_before = driver.latest_status()
    bad_file_dir = tmp / "policy-capsules"
    (bad_file_dir / "garbage.capsule").write_bytes(b"CAPSULE\0 not really")
    os.chmod(bad_file_dir / "garbage.capsule", 0o600)
    cases = [
        ("commit", Commit.Request(label="x" * 300), E.INVALID_ARGUMENT),
        ("reenter", Reenter.Request(capsule_id="../etc/passwd"), E.INVALID_ARGUMENT),
        ("reenter", Reenter.Request(capsule_id="no-such-capsule"), E.NOT_FOUND),
        ("reenter", Reenter.Request(capsule_id="garbage"), E.CORRUPT),
        ("reset", Reset.Request(capsule_id="no-such-capsule"), E.NOT_FOUND),
        ("reset", Reset.Request(capsule_id="a/b"), E.INVALID_ARGUMENT),
        ("fork", Fork.Request(capsule_id="no-such-capsule"), E.NOT_FOUND),
        ("fork", Fork.Request(capsule_id=".hidden"), E.INVALID_ARGUMENT),
        ("drop_capsule", DropCapsule.Request(capsule_id="no-such-capsule"), E.NOT_FOUND),
        ("save_capsule", SaveCapsule.Request(capsule_id="no-such-capsule"), E.NOT_FOUND),
        ("load_capsule", LoadCapsule.Request(capsule_id="no-such-capsule"), E.NOT_FOUND),
        ("load_capsule", LoadCapsule.Request(capsule_id="garbage"), E.CORRUPT),
        ("load_capsule", LoadCapsule.Request(capsule_id=""), E.INVALID_ARGUMENT),
        ("interrupt", Interrupt.Request(hold_mode=7), E.INVALID_ARGUMENT),
    ]
    for name, request, code in cases:
        response = client.capsules.call(name, request, check=False)
        assert not response.success and response.error_code == code, (name, request, response)
        assert response.message
    # wrong-state paths: interrupting twice, dropping the held interrupt capsule
    boundary = client.capsules.interrupt(hold_mode=Interrupt.Request.HOLD_LAST, commit=True).capsule
    again = client.capsules.call("interrupt", Interrupt.Request(), check=False)
    assert again.error_code == E.WRONG_STATE, again
    wrong = client.capsules.call("drop_capsule", DropCapsule.Request(capsule_id=boundary.id), check=False)
    assert wrong.error_code == E.WRONG_STATE and boundary.id in wrong.message, wrong
    assert driver.latest_status().lineage == boundary.id
    client.capsules.reenter()
    record_stop = client.capsules.call("record", __import__("capsule_ros.srv", fromlist=["Record"]).Record.Request(
        start=False), check=False)
    assert record_stop.error_code == E.WRONG_STATE
    # nothing changed: same episode, and the live state still continues the anchor's timeline
    status_after = driver.latest_status()
    assert status_after.episode_id == status_before.episode_id
    obs = observations(6, 16)
    live = driver.run(obs)
    client.capsules.reenter(anchor.id)
    reference = driver.run(obs)
    assert action_bytes(live) == action_bytes(reference)
    assert proc.alive()


def test_malformed_flood_is_dropped_counted_and_harmless(node):
    proc, client, driver, _ = node
    driver.run(observations(2, 17))
    anchor = client.capsules.commit(label="before flood").capsule
    counts_before = {p.name: p for p in driver.latest_status().ports}
    sent = {"shape": 0, "nonfinite": 0, "out_of_order": 0}
    ClientNode.drain(driver.actions)
    for i in range(1000):
        kind = ("shape", "nonfinite", "out_of_order", "goal_nonfinite")[i % 4]
        if kind == "shape":
            msg = driver.joint_msg([0.1, 0.2, 0.3, 0.4])
            msg.velocity = [0.3]
            driver.joints_pub.publish(msg)
            sent["shape"] += 1
        elif kind == "nonfinite":
            driver.joints_pub.publish(driver.joint_msg([np.nan, 0.2, np.inf, 0.4]))
            sent["nonfinite"] += 1
        elif kind == "out_of_order":
            driver.joints_pub.publish(driver.joint_msg([0.1, 0.2, 0.3, 0.4], stamp=0))
            sent["out_of_order"] += 1
        else:
            goal = driver.PointStamped()
            goal.header.stamp.sec = driver.stamp
            goal.point.x = float("nan")
            driver.goal_pub.publish(goal)
    expected_goal_nonfinite = 250

    def counted():
        ports = {p.name: p for p in driver.latest_status().ports}
        j, g = ports["joints"], ports["goal"]
        b, bg = counts_before["joints"], counts_before["goal"]
        seen.append((j.dropped_shape - b.dropped_shape, j.dropped_nonfinite - b.dropped_nonfinite,
                     j.dropped_out_of_order - b.dropped_out_of_order, g.dropped_nonfinite - bg.dropped_nonfinite))
        return ((j.dropped_shape - b.dropped_shape, j.dropped_nonfinite - b.dropped_nonfinite,
                 j.dropped_out_of_order - b.dropped_out_of_order, g.dropped_nonfinite - bg.dropped_nonfinite)
                == (sent["shape"], sent["nonfinite"], sent["out_of_order"], expected_goal_nonfinite))

    seen = []
    try:
        wait_for(counted, timeout=30, what="drop counters to match what was sent")
    except TimeoutError:
        pytest.fail(f"drop counters {seen[-1] if seen else None} != sent {sent} + {expected_goal_nonfinite} goals")
    assert ClientNode.drain(driver.actions) == []           # no message of the flood made a step
    assert proc.alive()
    obs = observations(10, 18)
    after_flood = driver.run(obs)
    client.capsules.reenter(anchor.id)
    reference = driver.run(obs)
    assert action_bytes(after_flood) == action_bytes(reference)
    status = driver.latest_status()
    assert status.dropped_inputs >= 1000


def test_status_and_diagnostics_are_published(node, rclpy_context):
    from diagnostic_msgs.msg import DiagnosticArray
    proc, client, driver, _ = node
    diag = client.subscribe(DiagnosticArray, "/diagnostics")
    ClientNode.drain(driver.status)
    statuses = [driver.status.get(timeout=5) for _ in range(5)]
    stamps = [st.header.stamp.sec + st.header.stamp.nanosec * 1e-9 for st in statuses]
    assert 1.5 <= stamps[-1] - stamps[0] <= 2.5, f"5 status messages over {stamps[-1] - stamps[0]:.2f} s at 2 Hz"
    s = statuses[-1]
    assert s.device == "cpu" and len(s.fingerprint) == 64 and s.steps_run > 0
    assert s.step_p50_ms > 0 and s.step_p99_ms >= s.step_p50_ms
    assert s.hits_device > 0 and s.hit_rate_device > 0
    assert {p.name for p in s.ports} == {"joints", "goal"}
    diags = wait_for(lambda: [d for d in ClientNode.drain(diag) for st in d.status if "capsule_policy" in st.name],
                     timeout=5, what="/diagnostics")
    keys = {kv.key for st in diags[-1].status for kv in st.values}
    assert {"step_p99_ms", "restore_p99_ms", "deadline_misses", "port.joints.dropped"} <= keys


def test_parameters_are_validated_with_a_reason(node):
    proc, client, driver, _ = node
    def set_param(name, value):
        return set_params(client, None, **{name.replace(".", "__"): value})[0]

    bad = set_param("control.rate_hz", -5.0)          # refused by the descriptor's range
    assert not bad.successful and "-5.0" in bad.reason
    bad_choice = set_param("control.deadline_action", "explode")   # refused by the config's validation
    assert not bad_choice.successful and "'explode'" in bad_choice.reason and "hold" in bad_choice.reason
    read_only = set_param("policy.hybrid.d_model", 128)
    assert not read_only.successful
    good = set_param("control.deadline_ms", 1500.0)
    assert good.successful


def test_deadline_miss_publishes_the_safe_action_never_a_stale_chunk(tmp_path, rclpy_context):
    params = {"policy": {"weights": ""}, "control": {"deadline_ms": 0.001, "deadline_action": "zero"}}
    proc = start_policy_node(tmp_path, params, namespace="/deadline", tag="deadline")
    client = ClientNode(rclpy_context, "deadline_client", node_path="/deadline/capsule_policy")
    try:
        driver = Driver(client, "/deadline")
        driver.send_goal()
        actions = driver.run(observations(10, 19))
        assert all(a.source == a.SOURCE_ZERO and len(a.chunk) == 0 and list(a.values) == [0.0, 0.0]
                   for a in actions)
        # an interrupt publishes a HOLD: every action before it is one of the ten above, so no
        # late step's action was published after its safe action
        from capsule_ros.srv import Interrupt
        client.capsules.interrupt(hold_mode=Interrupt.Request.HOLD_LAST, commit=False)
        sentinel = driver.actions.get(timeout=5)
        assert sentinel.source == sentinel.SOURCE_HOLD, "a late step's action came after its safe action"
        status = wait_for(lambda: (lambda s: s if s.deadline_misses >= 10 else None)(driver.latest_status()),
                          timeout=5, what="deadline misses in status")
        assert status.deadline_misses >= 10
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()


def test_timer_mode_steps_at_the_control_rate(tmp_path, rclpy_context):
    params = {"policy": {"weights": ""}, "control": {"mode": "timer", "rate_hz": 40.0}}
    proc = start_policy_node(tmp_path, params, namespace="/timer", tag="timer")
    client = ClientNode(rclpy_context, "timer_client", node_path="/timer/capsule_policy")
    try:
        driver = Driver(client, "/timer")
        def first_action():       # best-effort joint states: repeat until the inputs are in
            driver.send_goal(wait=False)
            driver.joints_pub.publish(driver.joint_msg([0.1, 0.2, 0.0, 0.0]))
            return driver.actions.qsize() > 0
        wait_for(first_action, timeout=30, interval=0.1, what="the first timer action")
        ClientNode.drain(driver.actions)
        actions = [driver.actions.get(timeout=5) for _ in range(41)]
        stamps = [a.header.stamp.sec + a.header.stamp.nanosec * 1e-9 for a in actions]
        span = stamps[-1] - stamps[0]
        assert 0.8 <= span <= 1.6, f"40 periods took {span:.2f} s at 40 Hz"
        steps = [a.step for a in actions]
        assert steps == sorted(steps) and all(a.source == a.SOURCE_POLICY for a in actions)
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()
