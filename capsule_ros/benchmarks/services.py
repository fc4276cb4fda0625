"""`capsule-ros bench services`: round-trip time of commit, re-enter and reset.

``policy_node`` runs as its own process (trigger mode, the default policy) while this
process feeds it sensor messages at 50 Hz, so calls also wait for step boundaries as they
would on a robot; each service is called N times (1,000 by default) from this separate
rclpy process through one persistent client per service. Target: p99 at most 20 ms
(Nav2's default behaviour-tree service timeout).

``--cpu-hog``: a busy loop on every core (one process each, at normal priority, started
once the node serves and stopped after the last call), as on a robot computer whose other
software saturates it; the same target holds. The run then also measures a *floor* side
by side: after each capsule call, the same client calls ``std_srvs/Trigger`` on the plain
rclpy node of ``benchmarks/baseline_node.py`` (the same policy stepped at the same rate,
the answer given at once on the executor's thread), so the figures separate what the
capsule services add from what any Python ROS 2 service pays on a saturated machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Dict, List

import numpy as np

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device
from capsule_ros.polling import wait_until
from capsule_ros.ros.processes import ManagedProcess, start_policy_node, workdir
from capsule_ros.ros.spinning import SpunNode

TARGET_P99_MS = 20.0
NS = "/bench_services"
FLOOR_NS = "/bench_services_floor"
SERVICES = ("commit", "reenter", "reset")


BUSY_LOOP = "import os; os.setpriority(os.PRIO_PROCESS, 0, 0)\nwhile True: pass"   # at nice 0, whatever ours


class CpuHog:
    """A busy loop on each of ``cores`` cores, each its own process at normal priority (nice
    0, also when the benchmark itself runs under ``nice``), from ``start`` to ``stop``."""

    def __init__(self, cores: int):
        self.cores = cores
        self.procs: List[subprocess.Popen] = []

    def start(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-S", "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
                      for _ in range(self.cores)]

    def stop(self) -> None:
        procs, self.procs = self.procs, []
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def run(device_name: str = "cpu", quick: bool = False, cpu_hog: bool = False) -> dict:
    import rclpy
    from geometry_msgs.msg import PointStamped
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import JointState
    from std_srvs.srv import Trigger

    from capsule_ros.ros.client import CapsuleClient, call_service

    device = resolve_device(device_name)
    calls = 200 if quick else 1000
    tmp = workdir()
    node = start_policy_node(tmp, {"runtime": {"device": str(device)}, "policy": {"weights": ""},
                                   "capsules": {"directory": str(tmp / "capsules")}},
                             namespace=NS, params_file=config_path("policy.yaml"))
    floor = ManagedProcess([sys.executable, "-m", "capsule_ros.benchmarks.baseline_node", "--ros-args",
                            "-r", f"__ns:={FLOOR_NS}"], tmp / "floor.log") if cpu_hog else None
    rclpy.init()
    client = SpunNode(rclpy, "bench_services_client")
    stop = threading.Event()
    hog = CpuHog(len(os.sched_getaffinity(0)) if cpu_hog else 0)
    samples: Dict[str, List[float]] = {"commit": [], "reenter": [], "reset": []}
    try:
        capsules = CapsuleClient(client.node, f"{NS}/capsule_policy", server_wait_s=60.0, call_timeout_s=5.0)
        feeds = [(client.node.create_publisher(JointState, f"{ns}/arm/joint_states", qos_profile_sensor_data),
                  client.node.create_publisher(PointStamped, f"{ns}/arm/goal", 10))
                 for ns in (NS, *([FLOOR_NS] if floor else []))]
        wait_until(lambda: all(p.get_subscription_count() > 0 for pair in feeds for p in pair), 60, "policy nodes")
        capsules.list(server_wait_s=60.0)
        trigger = client.node.create_client(Trigger, f"{FLOOR_NS}/baseline_policy/trigger")

        def floor_call() -> None:        # the floor: a plain rclpy service, same client, same moment
            if floor is not None:
                t0 = time.perf_counter()
                call_service(trigger, Trigger.Request(), 60.0, 5.0)
                samples.setdefault("floor", []).append(time.perf_counter() - t0)

        def timed(name: str, fn):
            t0 = time.perf_counter()
            out = fn()
            samples[name].append(time.perf_counter() - t0)
            floor_call()
            return out

        def feed():
            msg, g = JointState(), PointStamped()
            msg.position, msg.velocity = [0.1, 0.2], [0.0, 0.0]
            g.point.x, g.point.y = 0.4, 0.3
            while not stop.is_set():
                for joints, goal in feeds:
                    goal.publish(g)
                    joints.publish(msg)
                time.sleep(0.02)
        hog.start()
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        time.sleep(0.5)
        if floor is not None:
            call_service(trigger, Trigger.Request(), 60.0, 5.0)              # discovered before timing
        for i in range(calls):
            capsule = timed("commit", lambda i=i: capsules.commit(label=f"bench {i}").capsule)
            timed("reenter", lambda c=capsule: capsules.reenter(c.id))
            if i % 10 == 9:
                timed("reset", capsules.reset)
            capsules.drop(capsule.id)
        while len(samples["reset"]) < calls:
            timed("reset", capsules.reset)
    finally:
        hog.stop()
        stop.set()
        client.close()
        rclpy.try_shutdown()
        code = node.stop()
        if floor is not None:
            floor.stop()
    result = {"bench": "services", **environment(device), "quick": quick, "calls": calls,
              "cpu_hog_processes": hog.cores, "node_exit_code": code, "target_p99_ms": TARGET_P99_MS}
    for name, values in samples.items():
        p = pct(values, 1e3)
        result[f"{name}_p50_ms"], result[f"{name}_p99_ms"] = p["p50"], p["p99"]
        result[f"{name}_max_ms"] = float(np.max(values) * 1e3)
    result["met"] = all(result[f"{n}_p99_ms"] <= TARGET_P99_MS for n in SERVICES)
    return result


def table(result: dict) -> None:
    rows = [[name, result[f"{name}_p50_ms"], result[f"{name}_p99_ms"], result[f"{name}_max_ms"],
             "met" if result[f"{name}_p99_ms"] <= TARGET_P99_MS else "NOT met"]
            for name in SERVICES]
    if "floor_p50_ms" in result:
        rows.append(["(floor: std_srvs/Trigger of a plain rclpy node)", result["floor_p50_ms"], result["floor_p99_ms"],
                     result["floor_max_ms"], "-"])
    hog = f", a busy loop on each of {result['cpu_hog_processes']} cores" if result["cpu_hog_processes"] else ""
    print_table(f"service round trip, {result['calls']} calls each, node on {result['device']}{hog} (ms)",
                ["service", "p50", "p99", "max", f"p99 <= {TARGET_P99_MS:.0f} ms"], rows)


def main(args) -> int:
    emit(run(args.device if args.device != "auto" else "cpu", args.quick, args.cpu_hog), args.json, table)
    return 0
