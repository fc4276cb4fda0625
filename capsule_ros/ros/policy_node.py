"""`policy_node` executable: the serving node on a multi-threaded executor."""
from __future__ import annotations

import sys
from typing import List, Optional

import rclpy
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor

from capsule_ros.errors import ConfigError


def main(argv: Optional[List[str]] = None) -> int:
    # Hand the GIL over within 1 ms (default 5 ms) so the deadline watchdog, the service
    # threads and the control loop interleave at control-loop time scales.
    sys.setswitchinterval(0.001)
    rclpy.init(args=argv if argv is not None else sys.argv)
    from capsule_ros.ros.node import PolicyNode   # after init: torch import is slow, fail fast on bad args
    node = None
    try:
        node = PolicyNode()
    except ConfigError as exc:
        print(f"policy_node: invalid configuration: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    executor = MultiThreadedExecutor(num_threads=4)
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.close()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
