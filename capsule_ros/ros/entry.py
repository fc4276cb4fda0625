"""The common `main` of the package's nodes: init, build, spin, clean shutdown on SIGINT."""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, List, Optional

import rclpy
from rclpy.exceptions import NameValidationException, ParameterException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node

from capsule_ros.errors import CapsuleRosError, ConfigError, ErrorCode
from capsule_ros.serving.process import settle_after_start


def start_up_error(program: str, exc: BaseException) -> str:
    """The one line a start-up failure prints: what went wrong, in the error's own words.
    Set CAPSULE_ROS_TRACEBACK=1 to get the traceback as well (for a bug report)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (ConfigError, ParameterException, NameValidationException)):
        return f"{program}: invalid configuration: {text}"
    if isinstance(exc, CapsuleRosError):
        return f"{program}: {ErrorCode(exc.code).name}: {text}"
    return f"{program}: cannot start ({type(exc).__name__}): {text}"


def run_node(make_node: Callable[[], Node], program: str, argv: Optional[List[str]] = None) -> int:
    """Spin the node ``make_node()`` builds until SIGINT; 0 on a clean exit, 2 when it
    cannot start (a bad parameter, key file or weights file...): one line on stderr,
    never a traceback."""
    rclpy.init(args=argv if argv is not None else sys.argv)
    try:
        node = make_node()
    except Exception as exc:  # noqa: BLE001 - every start-up error: one line and exit 2
        if os.environ.get("CAPSULE_ROS_TRACEBACK"):
            traceback.print_exc()
        print(start_up_error(program, exc), file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    settle_after_start()                       # no multi-ms garbage collections during the loop
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
