"""`capsule-ros bench cancel`: from a RunPolicy cancel to the robot's safe action.

``policy_node`` runs as its own process in timer mode at 50 Hz (the default policy) while
this process keeps its sensors fed; for each of N runs (1,000 by default) it sends a
RunPolicy goal, waits until the run has published two policy actions, cancels it, and
times the cancel request's send to the arrival here of the safe action (``Action.source``
HOLD) on ``~/action``, both on this process's clock: the whole path (cancel service,
boundary wait, interrupt and commit, publish) plus DDS both ways. Target: p99 within one
control period (20 ms).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device
from capsule_ros.polling import wait_until
from capsule_ros.ros.processes import start_policy_node, workdir
from capsule_ros.ros.spinning import SpinSafeActionClient, SpunNode

RATE_HZ = 50.0
NS = "/bench_cancel"


def _until(future, timeout_s: float, what: str):
    wait_until(future.done, timeout_s, what, 0.0005)
    return future.result()


def run(device_name: str = "cpu", quick: bool = False) -> dict:
    import rclpy
    from geometry_msgs.msg import PointStamped
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import JointState

    from capsule_ros.action import RunPolicy
    from capsule_ros.msg import Action

    device = resolve_device(device_name)
    runs = 100 if quick else 1000
    tmp = workdir()
    node = start_policy_node(tmp, {"runtime": {"device": str(device)}, "policy": {"weights": ""},
                                   "control": {"mode": "timer", "rate_hz": RATE_HZ, "deadline_ms": 0.0},
                                   "capsules": {"directory": str(tmp / "capsules")}},
                             namespace=NS, params_file=config_path("policy.yaml"))
    rclpy.init()
    client = SpunNode(rclpy, "bench_cancel_client")
    stop = threading.Event()
    arrivals: queue.Queue = queue.Queue()
    latencies, lost = [], 0
    try:
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        client.node.create_subscription(Action, f"{NS}/capsule_policy/action",
                                        lambda m: arrivals.put((time.perf_counter(), m.source)), reliable)
        joints = client.node.create_publisher(JointState, f"{NS}/arm/joint_states", reliable)
        goal_pub = client.node.create_publisher(PointStamped, f"{NS}/arm/goal", reliable)
        action: Any = SpinSafeActionClient(client.node, RunPolicy, f"{NS}/capsule_policy/run_policy")
        if not action.wait_for_server(timeout_sec=120):
            raise SystemExit("policy_node's ~/run_policy did not appear")

        def feed():
            msg, goal = JointState(), PointStamped()
            msg.position, msg.velocity = [0.1, 0.2], [0.0, 0.0]
            goal.point.x, goal.point.y = 0.4, 0.3
            while not stop.is_set():
                goal_pub.publish(goal)
                joints.publish(msg)
                time.sleep(1.0 / RATE_HZ)
        threading.Thread(target=feed, daemon=True).start()
        wait_until(lambda: not arrivals.empty(), 60, "the first action")
        for _ in range(runs):
            handle = _until(action.send_goal_async(RunPolicy.Goal(hold_mode=0)), 10, "goal acceptance")
            assert handle.accepted
            while not arrivals.empty():
                arrivals.get_nowait()
            policy_actions = 0
            while policy_actions < 2:
                policy_actions += arrivals.get(timeout=10)[1] == Action.SOURCE_POLICY
            sent = time.perf_counter()
            cancel = handle.cancel_goal_async()
            try:
                while True:
                    arrived, source = arrivals.get(timeout=5)
                    if source == Action.SOURCE_HOLD:
                        latencies.append(arrived - sent)
                        break
            except queue.Empty:
                lost += 1
            _until(cancel, 10, "the cancel response")
            _until(handle.get_result_async(), 10, "the result")
    finally:
        stop.set()
        client.close()
        rclpy.try_shutdown()
        code = node.stop()
    period_ms = 1e3 / RATE_HZ
    p = pct(latencies, 1e3)
    return {"bench": "cancel", **environment(device), "quick": quick, "runs": runs, "rate_hz": RATE_HZ,
            "period_ms": period_ms, "cancel_to_safe_action_p50_ms": p["p50"], "cancel_to_safe_action_p99_ms": p["p99"],
            "cancel_to_safe_action_max_ms": float(np.max(latencies) * 1e3) if latencies else None,
            "safe_actions_missing": lost, "p99_vs_period": p["p99"] / period_ms, "node_exit_code": code,
            "met": bool(p["p99"] <= period_ms and lost == 0)}


def table(result: dict) -> None:
    print_table(f"RunPolicy cancel -> safe action, {result['runs']} runs, {result['rate_hz']:.0f} Hz, "
                f"node on {result['device']} (ms)", ["p50", "p99", "max", "period", "missing"],
                [[result["cancel_to_safe_action_p50_ms"], result["cancel_to_safe_action_p99_ms"],
                  result["cancel_to_safe_action_max_ms"], result["period_ms"], result["safe_actions_missing"]]])
    print(f"p99 / control period: {result['p99_vs_period']:.2f} (target <= 1: {'met' if result['met'] else 'NOT met'})")


def main(args) -> int:
    emit(run(args.device if args.device != "auto" else "cpu", args.quick), args.json, table)
    return 0
