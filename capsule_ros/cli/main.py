"""`capsule-ros`: the command line (demo, replay, record, inspect, bench).

Subcommands import what they need lazily, so `capsule-ros bench snapshot` runs on a
machine without ROS and `--help` is instant.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _bench(args) -> int:
    module = __import__(f"capsule_ros.benchmarks.{args.which}", fromlist=["main"])
    return module.main(args)


def _delegate(module_name: str):
    def run(args) -> int:
        module = __import__(module_name, fromlist=["main"])
        return module.main(args.rest)
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capsule-ros", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser("bench", help="benchmarks (one JSON object with --json)")
    bench.add_argument("which", choices=("snapshot", "reenter", "step", "services", "loop"))
    bench.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    bench.add_argument("--quick", action="store_true", help="small sizes: under a minute on a 2-core CPU")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench.add_argument("--prefixes", type=int, nargs="*", help="reenter: prefix lengths in tokens")
    bench.set_defaults(func=_bench)

    for name, module, text in (
            ("demo", "capsule_ros.cli.demo", "the main job: sim + policy node + scripted capsule plan + report"),
            ("replay", "capsule_ros.bag.replay", "replay a rosbag step by step and verify the actions"),
            ("record", "capsule_ros.bag.record_cmd", "record the node's topics into a rosbag2"),
            ("inspect", "capsule_ros.cli.inspect_cmd", "print and verify a capsule file")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_delegate(module))
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
