"""policy_node as a managed node: every transition driven through the standard lifecycle
services (~/change_state, ~/get_state) from this process, against the installed
executable in its own process; the library's Python logging reaching /rosout."""
from __future__ import annotations

import numpy as np
import pytest
from harness import (
    ClientNode,
    Driver,
    GoalRunner,
    action_bytes,
    observations,
    set_params,
    start_policy_node,
    unique_ns,
    wait_for,
)

from capsule_ros.errors import ErrorCode

pytestmark = pytest.mark.ros


@pytest.fixture
def managed(tmp_path, rclpy_context):
    """A node that starts unconfigured (lifecycle.autostart false), with a bad
    control.trigger_port that configure must refuse until it is fixed."""
    from capsule_ros.ros.client import LifecycleClient
    ns = unique_ns("life")
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}, "lifecycle": {"autostart": False},
                                        "control": {"deadline_ms": 5000.0, "trigger_port": "gripper"},
                                        "ports": {"joints": {"qos": "reliable", "depth": 100}}},
                             namespace=ns)
    client = ClientNode(rclpy_context, f"life_client_{ns.strip('/')}", node_path=f"{ns}/capsule_policy")
    lifecycle = LifecycleClient(client.node, f"{ns}/capsule_policy", server_wait_s=60.0)
    yield proc, client, lifecycle, ns
    lifecycle.destroy()
    client.close()
    assert proc.stop() == 0, proc.log()


def set_string_param(client: ClientNode, node_path: str, name: str, value: str) -> bool:
    return set_params(client, node_path, **{name.replace(".", "__"): value})[0].successful


def test_the_full_lifecycle_from_another_process(managed):
    from capsule_ros.msg import CapsuleEvent
    from capsule_ros.ros.client import ServiceRefused
    proc, client, lifecycle, ns = managed
    node_path = f"{ns}/capsule_policy"
    assert lifecycle.state() == "unconfigured"
    with pytest.raises(ServiceRefused) as refused:                   # nothing to act on yet
        client.capsules.commit()
    assert refused.value.error_code == ErrorCode.WRONG_STATE

    # a bad configuration fails configure, with its reason in the log; fixed, it passes
    assert lifecycle.change("configure") is False
    assert lifecycle.state() == "unconfigured"
    wait_for(lambda: "control.trigger_port = 'gripper'" in proc.log(), timeout=10, what="the reason in the log")
    assert set_string_param(client, node_path, "control.trigger_port", "joints")
    assert lifecycle.change("configure") is True
    assert lifecycle.state() == "inactive"
    with pytest.raises(ServiceRefused) as refused:
        client.capsules.list()
    assert refused.value.error_code == ErrorCode.WRONG_STATE

    assert lifecycle.change("activate") is True
    driver = Driver(client, ns)
    driver.send_goal()
    driver.run(observations(3, 1))
    anchor = client.capsules.commit(label="before the pause").capsule
    obs = observations(10, 2)
    before = driver.run(obs[:5])

    assert lifecycle.change("deactivate") is True                   # a safe action, a capsule, no steps
    safe = driver.actions.get(timeout=10)
    assert safe.source == safe.SOURCE_HOLD and list(safe.values) == list(before[-1].values)
    events = ClientNode.drain(driver.events)
    interrupts = [e for e in events if e.kind == CapsuleEvent.INTERRUPT]
    assert len(interrupts) == 1 and interrupts[0].capsule_id, events
    assert lifecycle.state() == "inactive"
    assert driver.latest_status().lifecycle_state == "inactive"
    with pytest.raises(ServiceRefused) as refused:
        client.capsules.commit()
    assert refused.value.error_code == ErrorCode.WRONG_STATE
    published = driver.latest_status().actions_published            # an inactive node does not step:
    wait_for(lambda: driver.joints_pub.get_subscription_count() == 0, timeout=30,   # it reads no port
             what="the inactive node to drop its port subscriptions")
    driver.joints_pub.publish(driver.joint_msg(obs[5]))
    assert driver.latest_status().actions_published == published and driver.actions.empty()

    assert lifecycle.change("activate") is True                     # resumes from the deactivate's capsule
    # it subscribes to its ports again; a message sent before that subscription is matched is
    # not delivered, and on a busy machine matching takes a while
    wait_for(lambda: driver.joints_pub.get_subscription_count() == 1, timeout=30,
             what="the active node to subscribe to its ports again")
    after = driver.run(obs[5:])
    assert [a.step for a in after] == list(range(before[-1].step + 1, before[-1].step + 6))
    client.capsules.reenter(anchor.id)                              # the same inputs without the pause
    assert action_bytes(driver.run(obs)) == action_bytes(before + after)

    assert lifecycle.change("deactivate") is True
    assert lifecycle.change("cleanup") is True                      # the runtime is released
    assert lifecycle.state() == "unconfigured"
    assert lifecycle.change("configure") is True and lifecycle.change("activate") is True
    status = driver.latest_status(timeout=10)
    assert (status.lifecycle_state, status.episode_id, status.step) == ("active", 1, 0)
    assert lifecycle.change("shutdown") is True
    assert lifecycle.state() == "finalized"


def test_library_logging_reaches_rosout(tmp_path, rclpy_context):
    """The runtime logs its arena and the capsule pools with Python logging; a ROS user
    sees them on /rosout under the node's logger."""
    from rcl_interfaces.msg import Log
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    ns = unique_ns("logs")
    client = ClientNode(rclpy_context, f"log_client_{ns.strip('/')}", node_path=f"{ns}/capsule_policy")
    logs = client.subscribe(Log, "/rosout", QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE,
                                                       durability=DurabilityPolicy.TRANSIENT_LOCAL))
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}}, namespace=ns)
    try:
        seen = []

        def library_lines():
            seen.extend(m for m in ClientNode.drain(logs) if m.name == f"{ns.strip('/')}.capsule_policy")
            return [m.msg for m in seen if m.msg.startswith(("[runtime.engine]", "[capsules.store]"))]
        wait_for(lambda: len(library_lines()) >= 2, timeout=60, what="the runtime's and the store's log lines")
        assert any("arena" in line for line in library_lines()), library_lines()
        assert any("capsule pools" in line for line in library_lines()), library_lines()
        assert sum(line.count("runtime on") for line in proc.log().splitlines()) == 1, "printed twice"
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()


def test_cleanup_releases_the_runtime_and_a_new_configure_starts_fresh(managed):
    proc, client, lifecycle, ns = managed
    assert set_string_param(client, f"{ns}/capsule_policy", "control.trigger_port", "joints")
    assert lifecycle.change("configure") and lifecycle.change("activate")
    driver = Driver(client, ns)
    driver.send_goal()
    first = driver.run(observations(4, 7))
    committed = client.capsules.commit(label="kept in memory").capsule
    assert lifecycle.change("deactivate") and lifecycle.change("cleanup")
    assert lifecycle.change("configure") and lifecycle.change("activate")
    assert [c.id for c in client.capsules.list().capsules if c.id == committed.id] == [], \
        "a capsule in memory outlived cleanup"
    driver.send_goal(wait=False)          # the new session counts its ports from 0
    wait_for(lambda: driver.port("goal").received >= 1, timeout=60, what="the goal to be taken")
    again = driver.run(observations(4, 7))                          # the same policy from its initial state
    assert np.array_equal(np.asarray([a.values for a in again]), np.asarray([a.values for a in first]))


def test_deactivate_racing_reentries_resets_and_goals_from_other_processes_always_reactivates(tmp_path,
                                                                                            rclpy_context):
    """The trials that left a node unable to activate (3 of 20, 8 of 30): a persisted capsule
    C not in memory, then ``~/reenter C``, ``~/reset`` or a ``~/run_policy`` goal from one
    client and ``change_state deactivate`` from another, 0-3 ms apart; then ``activate``."""
    import random
    import threading
    import time

    from capsule_ros.ros.client import LifecycleClient
    ns = unique_ns("race")
    node_path = f"{ns}/capsule_policy"
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}, "control": {"deadline_ms": 5000.0}}, namespace=ns)
    client = ClientNode(rclpy_context, f"race_client_{ns.strip('/')}", node_path=node_path)
    lifecycle = LifecycleClient(client.node, node_path, server_wait_s=60.0)
    runner = GoalRunner(client, node_path)
    try:
        capsule = client.capsules.commit(label="C", persist=True).capsule.id
        requests = {"reenter C": lambda: client.capsules.reenter(capsule, check=False),
                    "reset": lambda: client.capsules.reset(check=False),
                    "goal": lambda: runner.send(reset=True, max_steps=0)}
        rng = random.Random(20)
        for trial in range(30):
            client.capsules.drop(capsule, check=False)            # from memory (its file stays)
            name, offset_s = rng.choice(sorted(requests)), rng.uniform(0.0, 0.003)
            answered: dict = {}
            thread = threading.Thread(target=lambda n=name: answered.__setitem__(n, requests[n]()))
            thread.start()
            time.sleep(offset_s)                                  # a jittered start, not a wait for anything
            assert lifecycle.change("deactivate") is True, f"trial {trial}: {name}"
            thread.join(60)
            assert lifecycle.change("activate") is True, f"trial {trial}: {name}: {proc.log()[-2000:]}"
            if name == "goal":                                    # it ran (ended by the deactivate) or was refused
                handle = answered[name]
                if handle.accepted and not handle.get_result_async().done():
                    runner.cancel(handle)
                result = runner.result(handle).result if handle.accepted else None
                assert result is None or result.outcome in (result.OUTCOME_INTERRUPTED, result.OUTCOME_REJECTED,
                                                            result.OUTCOME_CANCELED), (trial, result)
            else:
                response = answered[name]
                assert response.success or response.error_code == ErrorCode.WRONG_STATE, (trial, response.message)
        assert client.capsules.commit(label="after the trials").success
    finally:
        lifecycle.destroy()
        client.close()
        assert proc.stop() == 0, proc.log()
