"""`policy_node` executable: the serving node (its threads are described in ros/node.py)."""
from __future__ import annotations

import sys
from typing import List, Optional

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

from capsule_ros.errors import ConfigError


def main(argv: Optional[List[str]] = None) -> int:
    rclpy.init(args=argv if argv is not None else sys.argv)
    from capsule_ros.ros.node import PolicyNode   # after init: torch import is slow, fail fast on bad args
    node = None
    try:
        node = PolicyNode()
    except ConfigError as exc:
        print(f"policy_node: invalid configuration: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    executor = SingleThreadedExecutor()       # services run on the node's own threads (see node.py)
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
