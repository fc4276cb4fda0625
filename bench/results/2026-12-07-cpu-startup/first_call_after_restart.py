"""The first commit to a just-started policy_node, timed from the moment one long-lived
client process finds the service to the answer, over several node starts in turn
(docs/benchmarks.md, "A restarted node and a long-lived client").

    . scripts/env.sh && python bench/results/2026-12-07-cpu-startup/first_call_after_restart.py 5 [--gaps]

``--gaps``: sleep 0, 0.7, 1.4, 0.3, 2.0 s before each start (the delay follows the phase of
the client's DDS announcements)."""
from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import rclpy
from rclpy.executors import SingleThreadedExecutor

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "test"))
from harness import start_policy_node, unique_ns

from capsule_ros import srv

GAPS_S = (0.0, 0.7, 1.4, 0.3, 2.0)


def main(starts: int, gaps: bool) -> None:
    rclpy.init()
    node = rclpy.create_node("first_call_client")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    threading.Thread(target=executor.spin, daemon=True).start()
    for i in range(starts):
        if gaps:
            time.sleep(GAPS_S[i % len(GAPS_S)])
        ns = unique_ns("first_call")
        proc = start_policy_node(Path(tempfile.mkdtemp()), {"policy": {"weights": ""}}, namespace=ns, tag=f"fc{i}")
        client = node.create_client(srv.Commit, f"{ns}/capsule_policy/commit")
        launched = time.monotonic()
        while not client.service_is_ready():
            time.sleep(0.001)
        found = time.monotonic()
        future = client.call_async(srv.Commit.Request(label="first"))
        while not future.done():
            time.sleep(0.0005)
        print(f"start {i}: service found after {found - launched:.2f} s, answered in "
              f"{(time.monotonic() - found) * 1e3:.0f} ms", flush=True)
        node.destroy_client(client)
        proc.stop()
    executor.shutdown()
    rclpy.try_shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4, "--gaps" in sys.argv)
