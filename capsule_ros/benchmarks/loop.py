"""`capsule-ros bench loop`: sensor-to-action latency in trigger mode, policy_node against
the baseline a user writes today (benchmarks/baseline_node.py: the same policy called
eagerly in a plain rclpy subscription callback), side by side in one run.

Both run as their own processes with the same policy and weights; this process publishes
a joint state to one, then the other, and times until the action comes back. Target:
policy_node adds no latency on a CPU (ratio = capsule p50 / baseline p50 at most 1.0).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Dict, List

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device
from capsule_ros.polling import wait_until
from capsule_ros.ros.processes import ManagedProcess, start_policy_node, workdir
from capsule_ros.ros.spinning import SpunNode

TARGET_RATIO = 1.0


class Endpoint:
    """Publishes joint states to one policy and waits for its action."""

    def __init__(self, node, namespace: str, action_topic: str):
        from geometry_msgs.msg import PointStamped
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import JointState

        from capsule_ros.msg import Action
        self.JointState = JointState
        self.joints = node.create_publisher(JointState, f"{namespace}/arm/joint_states", 10)
        self.goal = node.create_publisher(PointStamped, f"{namespace}/arm/goal",
                                          QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        self._event = threading.Event()
        self._stamp = 0                       # increasing: older stamps are dropped as out of order
        node.create_subscription(Action, action_topic, lambda _m: self._event.set(), 10)
        self.goal_msg = PointStamped()
        self.goal_msg.point.x, self.goal_msg.point.y = 0.4, 0.3

    def ready(self) -> bool:
        return self.joints.get_subscription_count() > 0 and self.goal.get_subscription_count() > 0

    def prime(self, timeout: float = 60.0) -> None:
        """Publish the goal and joint states until an action comes back (discovery done)."""
        deadline = time.monotonic() + timeout
        while True:
            self.goal.publish(self.goal_msg)
            try:
                self.roundtrip(0, timeout=0.5)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise SystemExit("the policy never answered (see the node's log)") from None

    def roundtrip(self, i: int, timeout: float = 5.0) -> float:
        msg = self.JointState()
        self._stamp += 1
        msg.header.stamp.sec = self._stamp
        msg.position, msg.velocity = [0.1 * (i % 7), 0.2], [0.0, 0.01 * (i % 5)]
        self._event.clear()
        t0 = time.perf_counter()
        self.joints.publish(msg)
        if not self._event.wait(timeout):
            raise TimeoutError(f"no action came back within {timeout} s")
        return time.perf_counter() - t0


def run(device_name: str = "cpu", quick: bool = False) -> dict:
    import rclpy
    device = resolve_device(device_name)
    steps = 300 if quick else 2000
    tmp = workdir()
    params = {"runtime": {"device": str(device)}, "policy": {"weights": ""},
              "capsules": {"directory": str(tmp / "capsules")}, "control": {"deadline_ms": 1000.0}}
    capsule_proc = start_policy_node(tmp, params, namespace="/bench_loop_capsule",
                                     params_file=config_path("policy.yaml"))
    baseline_proc = ManagedProcess([sys.executable, "-m", "capsule_ros.benchmarks.baseline_node", "--ros-args",
                             "-r", "__ns:=/bench_loop_baseline"], tmp / "baseline.log")
    rclpy.init()
    client = SpunNode(rclpy, "bench_loop_client")
    try:
        ours = Endpoint(client.node, "/bench_loop_capsule", "/bench_loop_capsule/capsule_policy/action")
        base = Endpoint(client.node, "/bench_loop_baseline", "/bench_loop_baseline/baseline_policy/action")
        wait_until(lambda: ours.ready() and base.ready(), 60, "both policy nodes")
        ours.prime()
        base.prime()
        for i in range(20):                                   # warm-up, both
            ours.roundtrip(i)
            base.roundtrip(i)
        samples: Dict[str, List[float]] = {"capsule": [], "baseline": []}
        for i in range(steps):                                # interleaved: same load for both
            samples["capsule"].append(ours.roundtrip(i))
            samples["baseline"].append(base.roundtrip(i))
    finally:
        client.close()
        rclpy.try_shutdown()
        capsule_proc.stop()
        baseline_proc.stop()
    result = {"bench": "loop", **environment(device), "quick": quick, "steps": steps}
    for name, values in samples.items():
        p = pct(values, 1e3)
        result[f"{name}_p50_ms"], result[f"{name}_p99_ms"] = p["p50"], p["p99"]
    result["ratio"] = result["capsule_p50_ms"] / result["baseline_p50_ms"]
    result["ratio_p99"] = result["capsule_p99_ms"] / result["baseline_p99_ms"]
    result["target_ratio"] = TARGET_RATIO
    result["met"] = result["ratio"] <= TARGET_RATIO
    return result


def table(result: dict) -> None:
    rows = [["policy_node (capsule_ros)", result["capsule_p50_ms"], result["capsule_p99_ms"]],
            ["baseline rclpy node", result["baseline_p50_ms"], result["baseline_p99_ms"]],
            ["ratio", f"{result['ratio']:.3f}", f"{result['ratio_p99']:.3f}"]]
    print_table(f"sensor-to-action latency, trigger mode, {result['steps']} steps each on {result['device']} (ms)",
                ["", "p50", "p99"], rows)


def main(args) -> int:
    emit(run(args.device if args.device != "auto" else "cpu", args.quick), args.json, table)
    return 0
