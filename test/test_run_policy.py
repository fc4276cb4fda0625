"""~/run_policy (capsule_ros/action/RunPolicy) from another process, against the installed
policy_node: a step budget, feedback, cancel, one goal at a time, a cancel that arrives
before its goal, and runs ended by other clients or by deactivation."""
from __future__ import annotations

import time
import uuid

import pytest
from harness import (
    ClientNode,
    Driver,
    GoalRunner,
    observations,
    spin_until,
    start_policy_node,
    unique_ns,
    wait_for,
)

from capsule_ros.errors import ErrorCode

pytestmark = pytest.mark.ros


def start(tmp_path, rclpy_context, prefix, **control):
    ns = unique_ns(prefix)
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""},
                                        "control": {"deadline_ms": 5000.0, **control},
                                        "ports": {"joints": {"qos": "reliable", "depth": 100}}}, namespace=ns)
    client = ClientNode(rclpy_context, f"run_client_{ns.strip('/')}", node_path=f"{ns}/capsule_policy")
    driver = Driver(client, ns)
    driver.send_goal()
    return proc, client, driver, GoalRunner(client, f"{ns}/capsule_policy"), ns


@pytest.fixture
def trigger_node(tmp_path, rclpy_context):
    proc, client, driver, runner, ns = start(tmp_path, rclpy_context, "runt")
    yield proc, client, driver, runner, ns
    client.close()
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def timer_node(tmp_path, rclpy_context):
    proc, client, driver, runner, ns = start(tmp_path, rclpy_context, "runr", mode="timer", rate_hz=50.0,
                                             deadline_ms=0.0)
    driver.joints_pub.publish(driver.joint_msg([0.1, 0.2, 0.0, 0.0]))
    yield proc, client, driver, runner, ns
    client.close()
    assert proc.stop() == 0, proc.log()


def test_a_step_budget_runs_exactly_that_many_steps_then_holds(trigger_node):
    proc, client, driver, runner, _ = trigger_node
    Result = runner.RunPolicy.Result
    client.capsules.interrupt()                                     # the run re-enters the interrupted episode
    handle = runner.send(max_steps=4, hold_mode=0)
    assert handle.accepted
    actions = [driver.step(o) for o in observations(4, 1)]
    held = driver.actions.get(timeout=10)                           # the budget's end: the safe action
    result = runner.result(handle)
    assert result.status == 4 and result.result.outcome == Result.OUTCOME_SUCCEEDED, result.result.message
    assert result.result.steps == 4 and all(a.source == a.SOURCE_POLICY for a in actions)
    assert held.source == held.SOURCE_HOLD and list(held.values) == list(actions[-1].values)
    assert result.result.capsule.step == actions[-1].step and result.result.capsule.id
    driver.joints_pub.publish(driver.joint_msg([0.1, 0.2, 0.0, 0.0]))
    assert driver.actions.get(timeout=10).source == held.SOURCE_HOLD, "a step ran past the budget"


def test_feedback_cancel_and_one_goal_at_a_time(timer_node):
    from action_msgs.msg import GoalStatus
    proc, client, driver, runner, _ = timer_node
    Result = runner.RunPolicy.Result
    handle = runner.send(reset=True, hold_mode=1)
    accepted = time.monotonic()
    assert handle.accepted
    feedback, arrived = runner.collect_feedback(8)                   # 10 Hz, with slack for start-up:
    assert arrived[-1] - accepted <= 1.0, f"8 feedback messages took {arrived[-1] - accepted:.2f} s"   # 8 in 1 s
    assert feedback[-1].steps > feedback[0].steps and feedback[-1].last_action.source == 0

    second = runner.send(max_steps=3)                               # refused with its reason; the first runs on
    second_result = runner.result(second)
    assert second_result.status == GoalStatus.STATUS_ABORTED
    assert (second_result.result.outcome, second_result.result.error_code) == (Result.OUTCOME_REJECTED,
                                                                               ErrorCode.BUSY)
    assert "another goal is running" in second_result.result.message
    ClientNode.drain(runner.feedback)
    runner.collect_feedback(1, timeout=5.0)                          # the first goal still runs

    assert runner.cancel(handle).return_code == 0
    result = runner.result(handle)
    assert result.status == GoalStatus.STATUS_CANCELED and result.result.outcome == Result.OUTCOME_CANCELED
    actions = ClientNode.drain(driver.actions)
    last_policy = max(i for i, a in enumerate(actions) if a.source == a.SOURCE_POLICY)
    after = actions[last_policy + 1:]
    assert after and all(a.source == a.SOURCE_ZERO for a in after), "the hold mode's safe action"
    assert result.result.capsule.step == actions[last_policy].step
    status = driver.latest_status()
    assert status.episode_state == status.INTERRUPTED


def test_a_client_slow_to_take_its_goal_answer_still_gets_it_while_others_send_goals(trigger_node, rclpy_context):
    """The action's goal answers to all its clients travel on one topic (as a service's do,
    test_node_safety.py): a tree busy elsewhere while another client sends 50 goals (each
    refused BUSY: one goal at a time) still finds its goal accepted, with this package's
    ``action_services_qos`` (the py_trees RunPolicy leaf's)."""
    from rclpy.executors import SingleThreadedExecutor

    from capsule_ros.action import RunPolicy
    from capsule_ros.ros.messages import action_services_qos
    from capsule_ros.ros.spinning import SpinSafeActionClient
    _, _, _, runner, ns = trigger_node
    slow_node = rclpy_context.create_node("slow_tree")
    executor = SingleThreadedExecutor()
    executor.add_node(slow_node)
    try:
        slow = SpinSafeActionClient(slow_node, RunPolicy, f"{ns}/capsule_policy/run_policy", **action_services_qos())
        spin_until(executor, slow.server_is_ready, what="~/run_policy")
        future = slow.send_goal_async(RunPolicy.Goal(max_steps=1000))
        time.sleep(0.5)                                        # the goal is out; nothing takes its answer
        for _ in range(50):
            assert runner.send(max_steps=3).accepted           # answered (its run then ends BUSY)
        spin_until(executor, future.done, timeout=10, what="the goal's answer (lost to the other client's 50?)")
        handle = future.result()
        assert handle.accepted
        spin_until(executor, handle.cancel_goal_async().done, what="the cancel's answer")   # nothing left running
    finally:
        executor.shutdown()
        slow_node.destroy_node()


def test_a_cancel_that_comes_before_its_goal_leaves_nothing_running(trigger_node):
    from action_msgs.msg import GoalInfo
    from action_msgs.srv import CancelGoal
    from unique_identifier_msgs.msg import UUID
    proc, client, driver, runner, ns = trigger_node
    goal_id = uuid.uuid4().bytes
    cancel = client.node.create_client(CancelGoal, f"{ns}/capsule_policy/run_policy/_action/cancel_goal")
    assert cancel.wait_for_service(timeout_sec=10)
    future = cancel.call_async(CancelGoal.Request(goal_info=GoalInfo(goal_id=UUID(uuid=list(goal_id)))))
    wait_for(future.done, timeout=10, what="the cancel response")
    assert future.result().return_code == CancelGoal.Response.ERROR_UNKNOWN_GOAL_ID
    client.capsules.interrupt()
    handle = runner.send(goal_id, max_steps=0)                      # the orphan: nobody would ever cancel it
    assert not handle.accepted
    assert driver.latest_status().episode_state == 2, "the rejected goal re-entered the episode"
    other = runner.send(max_steps=1)                                # other goals are still welcome
    assert other.accepted
    driver.step(observations(1, 3)[0])
    assert runner.result(other).result.steps == 1


def test_runs_ended_by_others_report_it(trigger_node):
    from capsule_ros.ros.client import LifecycleClient
    proc, client, driver, runner, ns = trigger_node
    Result = runner.RunPolicy.Result
    handle = runner.send(reset=True)
    assert handle.accepted
    driver.run(observations(2, 4))
    interrupted = client.capsules.interrupt().capsule               # another client ends the episode
    result = runner.result(handle)
    assert result.result.outcome == Result.OUTCOME_INTERRUPTED and result.result.steps == 2
    assert result.result.capsule.id == interrupted.id

    lifecycle = LifecycleClient(client.node, f"{ns}/capsule_policy")
    handle = runner.send()                                          # resumes the interrupted episode
    assert handle.accepted
    driver.run(observations(3, 5))
    assert lifecycle.change("deactivate")
    result = runner.result(handle)
    assert result.result.outcome == Result.OUTCOME_INTERRUPTED and result.result.steps == 3
    assert result.result.capsule.id, "the deactivate's capsule"
    assert "the node was deactivated" in result.result.message, result.result.message
    refused = runner.result(runner.send(max_steps=1))
    assert (refused.result.outcome, refused.result.error_code) == (Result.OUTCOME_REJECTED, ErrorCode.WRONG_STATE)
    assert lifecycle.change("activate")
    lifecycle.destroy()
