"""`capsule-ros bench services`: round-trip time of commit, re-enter and reset.

``policy_node`` runs as its own process (trigger mode, the default policy) while this
process feeds it sensor messages at 50 Hz, so calls also wait for step boundaries as they
would on a robot; each service is called N times (1,000 by default) from this separate
rclpy process through one persistent client per service. Target: p99 at most 20 ms
(Nav2's default behaviour-tree service timeout).
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List

import numpy as np

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device
from capsule_ros.polling import wait_until
from capsule_ros.ros.processes import start_policy_node, workdir
from capsule_ros.ros.spinning import SpunNode

TARGET_P99_MS = 20.0
NS = "/bench_services"


def run(device_name: str = "cpu", quick: bool = False) -> dict:
    import rclpy
    from geometry_msgs.msg import PointStamped
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import JointState

    from capsule_ros.ros.client import CapsuleClient

    device = resolve_device(device_name)
    calls = 200 if quick else 1000
    tmp = workdir()
    node = start_policy_node(tmp, {"runtime": {"device": str(device)}, "policy": {"weights": ""},
                                   "capsules": {"directory": str(tmp / "capsules")}},
                             namespace=NS, params_file=config_path("policy.yaml"))
    rclpy.init()
    client = SpunNode(rclpy, "bench_services_client")
    stop = threading.Event()
    try:
        capsules = CapsuleClient(client.node, f"{NS}/capsule_policy", server_wait_s=60.0, call_timeout_s=5.0)
        joints = client.node.create_publisher(JointState, f"{NS}/arm/joint_states", qos_profile_sensor_data)
        goal = client.node.create_publisher(PointStamped, f"{NS}/arm/goal", 10)
        wait_until(lambda: joints.get_subscription_count() > 0 and goal.get_subscription_count() > 0, 60,
                   "policy_node")
        capsules.list(server_wait_s=60.0)

        def feed():
            msg, g = JointState(), PointStamped()
            msg.position, msg.velocity = [0.1, 0.2], [0.0, 0.0]
            g.point.x, g.point.y = 0.4, 0.3
            while not stop.is_set():
                goal.publish(g)
                joints.publish(msg)
                time.sleep(0.02)
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        time.sleep(0.5)
        samples: Dict[str, List[float]] = {"commit": [], "reenter": [], "reset": []}
        for i in range(calls):
            t0 = time.perf_counter()
            capsule = capsules.commit(label=f"bench {i}").capsule
            t1 = time.perf_counter()
            capsules.reenter(capsule.id)
            t2 = time.perf_counter()
            if i % 10 == 9:
                capsules.reset()
                samples["reset"].append(time.perf_counter() - t2)
            samples["commit"].append(t1 - t0)
            samples["reenter"].append(t2 - t1)
            capsules.drop(capsule.id)
        for _ in range(calls - len(samples["reset"])):
            t0 = time.perf_counter()
            capsules.reset()
            samples["reset"].append(time.perf_counter() - t0)
    finally:
        stop.set()
        client.close()
        rclpy.try_shutdown()
        code = node.stop()
    result = {"bench": "services", **environment(device), "quick": quick, "calls": calls,
              "node_exit_code": code, "target_p99_ms": TARGET_P99_MS}
    for name, values in samples.items():
        p = pct(values, 1e3)
        result[f"{name}_p50_ms"], result[f"{name}_p99_ms"] = p["p50"], p["p99"]
        result[f"{name}_max_ms"] = float(np.max(values) * 1e3)
    result["met"] = all(result[f"{n}_p99_ms"] <= TARGET_P99_MS for n in samples)
    return result


def table(result: dict) -> None:
    rows = [[name, result[f"{name}_p50_ms"], result[f"{name}_p99_ms"], result[f"{name}_max_ms"],
             "met" if result[f"{name}_p99_ms"] <= TARGET_P99_MS else "NOT met"]
            for name in ("commit", "reenter", "reset")]
    print_table(f"service round trip, {result['calls']} calls each, node on {result['device']} (ms)",
                ["service", "p50", "p99", "max", f"p99 <= {TARGET_P99_MS:.0f} ms"], rows)


def main(args) -> int:
    emit(run(args.device if args.device != "auto" else "cpu", args.quick), args.json, table)
    return 0
