"""policy_node under real use, through ROS (the installed executable, real topics and
services): values at the limits of their dtype, a sensor with a bad clock, HOLD on missed
deadlines, a save racing a drop, directories where capsule files should be, status under
four concurrent clients, and start-up errors.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time

import numpy as np
import pytest
from harness import (
    DEFAULT_PARAMS,
    ClientNode,
    Driver,
    action_bytes,
    observations,
    set_params_ok,
    spin_until,
    start_policy_node,
    unique_ns,
    wait_for,
)
from rclpy.qos import QoSProfile, ReliabilityPolicy

from capsule_ros.policies.registry import kind_names

pytestmark = pytest.mark.ros
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
STRESS_S = float(os.environ.get("CAPSULE_STATUS_STRESS_S", "60"))


@pytest.fixture
def served(tmp_path, rclpy_context):
    """A fresh node per test (these tests change its configuration and state)."""
    ns = unique_ns("safe")
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}, "control": {"deadline_ms": 5000.0},
                                        "ports": {"joints": {"qos": "reliable", "depth": 100}}},
                             namespace=ns)
    client = ClientNode(rclpy_context, f"safety_client_{ns.strip('/')}", node_path=f"{ns}/capsule_policy")
    driver = Driver(client, ns)
    driver.send_goal()
    yield proc, client, driver, ns, tmp_path
    client.close()
    assert proc.stop() == 0, proc.log()


def published(driver) -> int:
    """The node's count of published actions, from a status taken after this call."""
    return driver.latest_status().actions_published


def test_values_beyond_float32_never_reach_the_actuators(served):
    proc, client, driver, ns, _ = served
    driver.run(observations(3, 1))
    anchor = client.capsules.commit(label="before the overflow").capsule
    ClientNode.drain(driver.actions)
    before = published(driver)
    for value in (1e39, -1e39, 1e300):
        driver.joints_pub.publish(driver.joint_msg([value, 0.1, 0.0, 0.0]))
    huge_goal = driver.PointStamped()
    huge_goal.header.stamp.sec = driver.stamp
    huge_goal.point.x = 1e300
    driver.goal_pub.publish(huge_goal)
    wait_for(lambda: {p.name: p.dropped_nonfinite for p in driver.latest_status().ports} == {"joints": 3, "goal": 1},
             timeout=10, what="the four messages to be dropped as non-finite")
    assert published(driver) == before and driver.actions.empty(), "a refused message made a step"
    obs = observations(8, 2)
    after = driver.run(obs)
    assert all(np.isfinite(a.values).all() and a.source == a.SOURCE_POLICY for a in after)
    client.capsules.reenter(anchor.id)
    assert action_bytes(driver.run(obs)) == action_bytes(after)


def test_a_future_stamped_message_is_dropped_and_the_port_keeps_flowing(served):
    proc, client, driver, ns, _ = served
    now = time.time()
    ClientNode.drain(driver.actions)
    before = published(driver)
    driver.joints_pub.publish(driver.joint_msg([0.1, 0.2, 0.0, 0.0], stamp=int(now + 3600)))
    wait_for(lambda: next(p.dropped_future for p in driver.latest_status().ports if p.name == "joints") == 1,
             timeout=10, what="the future-stamped message to be dropped")
    assert published(driver) == before and driver.actions.empty()
    for i in range(5):                                 # correctly stamped messages still act
        driver.joints_pub.publish(driver.joint_msg([0.1, 0.2, 0.0, 0.0], stamp=int(now) - 10 + i))
        assert driver.actions.get(timeout=5).source == 0
    driver.joints_pub.publish(driver.joint_msg([0.1, 0.2, 0.0, 0.0], stamp=int(now) - 100))   # older: dropped
    wait_for(lambda: next(p.dropped_out_of_order for p in driver.latest_status().ports if p.name == "joints") == 1,
             timeout=10, what="the older message to be dropped")
    client.capsules.reset()                            # a new episode forgets the ordering point
    driver.joints_pub.publish(driver.joint_msg([0.1, 0.2, 0.0, 0.0], stamp=int(now) - 100))
    assert driver.actions.get(timeout=5).step == 1


def test_hold_on_missed_deadlines_holds_the_last_on_time_action(served):
    proc, client, driver, ns, _ = served
    driver.run(observations(3, 3))
    anchor = client.capsules.commit(label="before the deadline").capsule
    obs = observations(8, 4)
    on_time = driver.run(obs[:3])
    set_params_ok(client, None, control__deadline_ms=0.001)       # every step is late now
    held = driver.run(obs[3:])
    set_params_ok(client, None, control__deadline_ms=5000.0)
    assert all(a.source == a.SOURCE_HOLD and len(a.chunk) == 0 for a in held)
    assert all(list(a.values) == list(on_time[-1].values) for a in held), "HOLD published a late step's action"
    client.capsules.reenter(anchor.id)
    reference = driver.run(obs)                         # the same inputs, no deadline
    assert action_bytes(reference[:3]) == action_bytes(on_time)
    assert [list(a.values) for a in reference[3:]] != [list(a.values) for a in held]
    assert ClientNode.drain(driver.actions) == []      # no late action came afterwards either


def test_a_drop_racing_a_save_never_brings_the_capsule_back(served):
    from capsule_ros.srv import Reenter, SaveCapsule
    proc, client, driver, ns, tmp = served
    capsule_dir = tmp / "policy-capsules"
    resurrected = []
    for trial in range(40):
        driver.run(observations(1, 100 + trial))
        capsule = client.capsules.commit(label=f"race {trial}").capsule
        answers = {}
        save = threading.Thread(target=lambda: answers.update(save=client.capsules.call(
            "save_capsule", SaveCapsule.Request(capsule_id=capsule.id), check=False)))
        save.start()
        time.sleep(0.001 * (trial % 8))
        dropped = client.capsules.drop(capsule.id, from_disk=True)
        save.join()
        assert dropped.success
        if (capsule_dir / f"{capsule.id}.capsule").exists():
            resurrected.append(capsule.id)
        reenter = client.capsules.call("reenter", Reenter.Request(capsule_id=capsule.id), check=False)
        assert not reenter.success and reenter.error_code == reenter.NOT_FOUND, reenter.message
    assert resurrected == [], f"{len(resurrected)} of 40 dropped capsules came back on disk"


def test_a_directory_where_a_capsule_file_should_be(served):
    proc, client, driver, ns, tmp = served
    from capsule_ros.srv import LoadCapsule
    (tmp / "policy-capsules" / "adir.capsule").mkdir(parents=True)
    fds = len(os.listdir(f"/proc/{proc.proc.pid}/fd"))
    for _ in range(500):
        response = client.capsules.call("load_capsule", LoadCapsule.Request(capsule_id="adir"), check=False)
        assert response.error_code == response.CORRUPT, response.message
        assert "adir.capsule" in response.message and "is a directory" in response.message
    assert len(os.listdir(f"/proc/{proc.proc.pid}/fd")) == fds, "each load leaked a file descriptor"
    inspect = subprocess.run(["capsule-ros", "inspect", str(tmp / "policy-capsules" / "adir.capsule")],
                             capture_output=True, text=True, timeout=60)
    assert inspect.returncode == 2 and "Traceback" not in inspect.stderr
    assert len(inspect.stderr.strip().splitlines()) == 1 and "is a directory" in inspect.stderr.lower()


def test_a_client_slow_to_take_its_commit_answer_still_gets_it_while_others_call(tmp_path, rclpy_context):
    """A service's answers to all its clients travel on one topic and each client's reader
    keeps the last ``depth`` of them: a client busy elsewhere (its executor not taking) while
    another client commits 50 times must still find its commit's answer, not lose it to the
    others' (ROS's default depth of 10 loses it, and a commit asked again commits twice). The
    slow client is an rclpy client with this package's ``service_qos`` (``CapsuleClient``'s and
    the behaviour tree's), never spun until the other client is done."""
    import rclpy

    from capsule_ros import srv
    from capsule_ros.ros.messages import service_qos
    ns = unique_ns("slowtake")
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}}, namespace=ns, tag="slowtake")
    other_context = rclpy.Context()
    rclpy.init(context=other_context)
    other = ClientNode(rclpy, "slowtake_other", node_path=f"{ns}/capsule_policy", context=other_context)
    slow_node = rclpy.create_node("slowtake_slow")
    try:
        other.capsules.list()                                    # the node serves
        slow = slow_node.create_client(srv.Commit, f"{ns}/capsule_policy/commit", qos_profile=service_qos())
        executor = rclpy.executors.SingleThreadedExecutor()
        executor.add_node(slow_node)
        spin_until(executor, slow.service_is_ready, what="the commit service")
        future = slow.call_async(srv.Commit.Request(label="slow"))
        time.sleep(0.5)                                          # the request is out; nothing takes the answer
        for _ in range(50):
            other.capsules.commit(label="other")                 # answers on the same service's topic
        spin_until(executor, future.done, timeout=10, what="the commit's answer (lost to the other client's 50?)")
        answer = future.result()
        assert answer.success and answer.capsule.label == "slow", answer.message
        assert answer.capsule.id in {c.id for c in other.capsules.list().capsules}   # committed once
    finally:
        other.close()
        other_context.try_shutdown()
        slow_node.destroy_node()
        proc.stop()


def test_status_stays_consistent_under_four_clients_committing_and_dropping(tmp_path, rclpy_context):
    from capsule_ros.msg import RuntimeStatus
    ns = "/stress"
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}, "control": {"deadline_ms": 5000.0,
                                                                               "status_rate_hz": 50.0},
                                        "capsules": {"device_budget_mb": 0.2, "host_budget_mb": 0.4}},
                             namespace=ns, tag="stress")
    driver_client = ClientNode(rclpy_context, "stress_driver", node_path=f"{ns}/capsule_policy")
    clients = [ClientNode(rclpy_context, f"stress_client_{i}", node_path=f"{ns}/capsule_policy") for i in range(4)]
    for client in clients:              # this test is about consistency under load, not latency
        client.capsules.call_timeout_s = 30.0
    statuses = driver_client.subscribe(RuntimeStatus, f"{ns}/capsule_policy/status", RELIABLE)
    stop = threading.Event()
    refusals, failures, answered = [], [], []
    try:
        driver = Driver(driver_client, ns)
        driver.send_goal()
        wait_for(lambda: driver.latest_status().ports, timeout=30, what="status")

        def stream():
            rows = iter(observations(100000, 5))
            while not stop.is_set():
                driver.joints_pub.publish(driver.joint_msg(next(rows)))
                time.sleep(0.01)

        def churn(client, seed):
            from capsule_ros.ros.client import ServiceRefused
            rng = np.random.default_rng(seed)
            mine = []
            while not stop.is_set():
                start = time.monotonic()
                try:
                    if not mine or rng.random() < 0.6:
                        mine.append(client.capsules.commit(label="stress", persist=bool(rng.random() < 0.3)).capsule.id)
                    else:
                        client.capsules.drop(mine.pop(int(rng.integers(len(mine)))), from_disk=bool(rng.random() < 0.5))
                    answered.append(time.monotonic() - start)
                except ServiceRefused as exc:          # typed refusals are fine (e.g. evicted meanwhile)
                    refusals.append(exc.error_code)
                except Exception as exc:  # noqa: BLE001 - anything else fails the test
                    failures.append(repr(exc))
        threads = [threading.Thread(target=stream)] + [threading.Thread(target=churn, args=(c, i))
                                                       for i, c in enumerate(clients)]
        ClientNode.drain(statuses)
        for t in threads:
            t.start()
        deadline = time.monotonic() + STRESS_S
        stamps, last = [], time.monotonic()
        while time.monotonic() < deadline:
            status = statuses.get(timeout=2.0)         # a stop of the node's status would time out here
            now = time.monotonic()
            stamps.append(now - last)
            last = now
            assert status.capsules_device + status.capsules_host >= 1
        stop.set()
        for t in threads:
            t.join(timeout=30)
    finally:
        stop.set()
        for c in clients:
            c.close()
        driver_client.close()
        code = proc.stop()
    print(f"\n{len(answered)} commits / drops answered, slowest {max(answered) * 1e3:.0f} ms, "
          f"p99 {np.percentile(answered, 99) * 1e3:.0f} ms; {len(stamps)} status messages")
    assert failures == [] and len(answered) >= 20 * STRESS_S, (f"{len(answered)} commits and drops answered, "
                                                               f"{failures[:3]}; node log: {proc.log()[-3000:]}")
    assert code == 0 and proc.alive() is False
    log = proc.log()
    assert "Traceback" not in log and "changed size" not in log, log[-2000:]
    assert len(stamps) >= 40 * STRESS_S, f"{len(stamps)} status messages in {STRESS_S:.0f} s at 50 Hz"
    assert max(stamps) < 1.0, f"status stalled for {max(stamps):.2f} s"
    from capsule_ros.errors import ErrorCode
    assert set(refusals) <= {ErrorCode.NOT_FOUND, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.BUSY}, set(refusals)


# -- start-up errors: one line on stderr, exit 2, never a traceback ---------------------------------

def _start_up(tmp_path, params: dict, extra_args=()) -> subprocess.CompletedProcess:
    import yaml
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    from capsule_ros.ros.processes import installed_executable
    return subprocess.run([installed_executable("policy_node"), "--ros-args", "--params-file", str(DEFAULT_PARAMS),
                           "--params-file", str(overlay), *extra_args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["bad_value", "bad_type", "loose_key_file", "missing_weights", "small_image",
                                  "unknown_kind"])
def test_start_up_errors_end_with_one_line_and_exit_2(tmp_path, case):
    capsules = {"directory": str(tmp_path / "capsules")}
    if case == "bad_value":
        params, expect = {"control": {"rate_hz": -5.0}, "capsules": capsules}, "control.rate_hz"
    elif case == "bad_type":
        params, expect = {"control": {"deadline_ms": "soon"}, "capsules": capsules}, "control.deadline_ms"
    elif case == "loose_key_file":
        key = tmp_path / "kek"
        key.write_bytes(os.urandom(32))
        os.chmod(key, 0o644)
        params, expect = {"capsules": {**capsules, "key_file": str(key)}}, "chmod 600"
    elif case == "unknown_kind":
        params, expect = {"policy": {"kind": "gru"}, "capsules": capsules}, \
            f"policy.kind = 'gru': no such policy; known: {list(kind_names())}"    # built-ins and the example's
    elif case == "missing_weights":
        params, expect = {"policy": {"weights": str(tmp_path / "nowhere.safetensors")}, "capsules": capsules}, \
            "nowhere.safetensors"
    else:
        params = {"ports": {"names": ["joints", "goal", "camera"],
                            "camera": {"topic": "camera/image", "type": "sensor_msgs/msg/Image", "fields": ["data"],
                                       "shape": [2, 2, 3], "dtype": "uint8"}},
                  "policy": {"weights": ""}, "capsules": capsules}
        expect = "'camera'"
    result = _start_up(tmp_path, params)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("policy_node: ") and expect in lines[0], result.stderr
