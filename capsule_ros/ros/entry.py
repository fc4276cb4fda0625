"""The common `main` of the package's nodes: init, build, spin, clean shutdown on SIGINT."""
from __future__ import annotations

import sys
from typing import Callable, List, Optional

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node

from capsule_ros.errors import ConfigError


def run_node(make_node: Callable[[], Node], program: str, argv: Optional[List[str]] = None) -> int:
    """Spin the node ``make_node()`` builds until SIGINT; 0 on a clean exit, 2 when its
    configuration is invalid (the reason goes to stderr)."""
    rclpy.init(args=argv if argv is not None else sys.argv)
    try:
        node = make_node()
    except (ConfigError, ValueError) as exc:
        print(f"{program}: invalid configuration: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        close = getattr(node, "close", None)
        if close is not None:
            close()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
    return 0
