"""``capsule-ros replay BAG``: drive the recorded policy step by step from a bag's sensor
messages and compare every action with the recorded one (``capsule_ros.bag.replay``
does the work; docs/rosbag-replay.md is the guide).

    capsule-ros replay BAG [--verify [--partial]] [--from-capsule ID] [--node | --in-process]
                       [--params-file F] [--capsule-dir D] [--json] [--ablation kv-only]

The arguments are parsed before anything heavy is imported, so a mistyped option
answers at once.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, List, Optional

from capsule_ros.bag.ablation import ABLATIONS
from capsule_ros.cli.command import COMMANDS
from capsule_ros.cli.paths import input_dir, input_file

EXIT_IDENTICAL, EXIT_BAD = 0, 2
DESCRIPTION = ("Drive the recorded policy step by step from a bag's sensor messages and compare every action with "
               "the recorded one, bit for bit (docs/rosbag-replay.md).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bag", help="rosbag2 directory recorded by capsule_ros (MCAP or sqlite3)")
    parser.add_argument("--verify", action="store_true",
                        help="exit 1 on a divergence, 3 when some recorded actions could not be compared")
    parser.add_argument("--partial", action="store_true",
                        help="with --verify: accept a verdict that skipped actions (exit 0 if the compared ones match)")
    parser.add_argument("--from-capsule", default="", metavar="ID",
                        help="start from this saved capsule, where the bag committed it")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--node", action="store_true", help="replay through a policy_node process started here")
    where.add_argument("--in-process", action="store_true", help="replay over a PolicySession here (default)")
    parser.add_argument("--params-file", type=Path, help="serving parameters instead of the recorded ones")
    parser.add_argument("--capsule-dir", type=Path, help="capsule files (default: the recorded capsules.directory)")
    parser.add_argument("--ablation", choices=sorted(ABLATIONS), default="",
                        help="re-entries restore only these buffers (expected to diverge)")
    parser.add_argument("--timeout", type=float, default=60.0, help="--node: seconds to wait for the node")
    parser.add_argument("--json", action="store_true", help="print the verdict as one JSON object")


def replay(bag, options):
    """``capsule_ros.bag.replay.replay_bag`` with the policy_node target for ``--node`` (and a
    fleet robot's bag on its fleet's shape: ``capsule_ros.fleet.replay``)."""
    from capsule_ros.bag.errors import ReplaySetupError
    from capsule_ros.fleet.replay import replay_fleet_bag as replay_bag
    node_target: Any = None
    if options.node:
        try:
            from capsule_ros.ros.replay_target import NodeTarget as node_target
        except ImportError as exc:
            raise ReplaySetupError(f"--node needs ROS 2 and the built package ({exc})") from None
    return replay_bag(bag, options, node_target)


def run(args: argparse.Namespace) -> int:
    """Replay the bag; the exit status (errors: ``COMMANDS['replay'].guard``)."""
    bag = input_dir(args.bag, "BAG")
    params_file = input_file(args.params_file, "--params-file") if args.params_file else None
    capsule_dir = input_dir(args.capsule_dir, "--capsule-dir") if args.capsule_dir else None
    from capsule_ros.bag.replay import ReplayOptions
    options = ReplayOptions(from_capsule=args.from_capsule, node=args.node, params_file=params_file,
                            capsule_dir=capsule_dir, ablation=args.ablation, timeout_s=args.timeout,
                            partial=args.partial)
    verdict = replay(bag, options)
    if args.json:
        print(verdict.to_json())
    else:
        from rich.console import Console
        verdict.render(Console())
    if verdict.steps_compared == 0:
        print("capsule-ros replay: nothing verified: the bag has no step after an anchor (initial state, reset, "
              "re-entry of a known capsule, --from-capsule)", file=sys.stderr)
        return EXIT_BAD
    return verdict.exit_code(allow_partial=args.partial) if args.verify else EXIT_IDENTICAL


def main(argv: Optional[List[str]] = None) -> int:
    return COMMANDS["replay"].main(argv, add_arguments, run, DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
