"""`capsule-ros record`: ask a running policy node to record a rosbag2 through its
``~/record`` service, wait (``--duration`` seconds, or until Ctrl-C), stop, print the bag.

    capsule-ros record [--node /capsule_policy] [--out DIR] [--storage mcap|sqlite3] [--duration S]

The node writes the bag itself (it records sensor messages as it receives them, in the
order it processes them), so ``--out`` is a path on the node's machine; a relative one
is made absolute here. The bag path is the only line on stdout. A refusal (the node's
own, with its reason, e.g. a path it cannot write) is one line on stderr and exit 2
(docs/command-line.md); the node leaves nothing of a bag it could not finish.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
from typing import List, Optional

from capsule_ros.cli.command import COMMANDS
from capsule_ros.errors import CapsuleRosError

DESCRIPTION = ("Ask a running policy node to record a rosbag2 (sensor ports, ~/action, ~/capsule_events) through its "
               "~/record service; prints the bag path (docs/rosbag-replay.md).")


class Unavailable(CapsuleRosError):
    """This machine cannot run the command (no ROS 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", default="/capsule_policy", help="the policy node's full name")
    parser.add_argument("--out", default="", metavar="DIR",
                        help="bag directory to create (default: <record.directory>/<UTC stamp> of the node)")
    parser.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap", help="rosbag2 storage plugin")
    parser.add_argument("--duration", type=float, default=0.0, metavar="S", help="stop after S seconds (0: Ctrl-C)")
    parser.add_argument("--wait", type=float, default=10.0, metavar="S", help="how long to wait for the node")


def run(args: argparse.Namespace) -> int:
    """Record; 0 (errors, the node's refusals among them: ``COMMANDS['record'].guard``)."""
    try:
        import rclpy
        from rclpy.context import Context

        from capsule_ros.ros.client import CapsuleClient
        from capsule_ros.ros.spinning import SpunNode
    except ImportError as exc:
        raise Unavailable(f"needs ROS 2 and the built package ({exc})") from None
    out = os.path.abspath(os.path.expanduser(args.out)) if args.out else ""
    context = Context()
    rclpy.init(context=context)      # not the default context: no rclpy signal handlers, Ctrl-C is ours
    spun = SpunNode(rclpy, "capsule_ros_record", context=context)
    client = CapsuleClient(spun.node, args.node, server_wait_s=args.wait, call_timeout_s=10.0)
    started = False
    try:
        response = client.record(True, out, args.storage)
        started = True
        print(f"recording {args.node} to {response.bag_path}"
              + (f" for {args.duration:g} s" if args.duration > 0 else " (Ctrl-C stops)"), file=sys.stderr)
        with contextlib.suppress(KeyboardInterrupt):      # Ctrl-C: the way to stop without --duration
            threading.Event().wait(args.duration if args.duration > 0 else None)
        started = False
        response = client.record(False)
        print(f"wrote {response.messages} messages", file=sys.stderr)
        print(response.bag_path)
        return 0
    finally:
        if started:                    # interrupted while stopping: the node still stops, the bag is kept
            stopped = client.record(False, check=False)
            if stopped.success:
                print(stopped.bag_path)
        spun.close()
        context.try_shutdown()


def main(argv: Optional[List[str]] = None) -> int:
    return COMMANDS["record"].main(argv, add_arguments, run, DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
