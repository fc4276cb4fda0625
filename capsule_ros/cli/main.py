"""`capsule-ros`: the command line (demo, replay, record, inspect, export, check, regenerate, bench).

Subcommands import what they need lazily, so `capsule-ros bench snapshot` runs on a
machine without ROS and `--help` is instant. Every subcommand ends an error in one line
and its documented exit status (``capsule_ros.cli.command``, docs/command-line.md).
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import List, Optional

from capsule_ros.cli.command import COMMANDS
from capsule_ros.errors import InvalidArgument, path_error
from capsule_ros.runtime.numerics import FLOAT32_MATMUL_CHOICES, FLOAT32_MATMUL_HIGHEST


def _bench(args) -> int:
    from capsule_ros.runtime import numerics
    if args.policy != "builtin" and args.which != "step":
        raise InvalidArgument(f"bench {args.which}: --policy {args.policy} is an option of bench step only")
    if args.cpu_hog and args.which != "services":
        raise InvalidArgument(f"bench {args.which}: --cpu-hog is an option of bench services only")
    if args.lerobot_python is not None:
        from capsule_ros.cli.paths import input_file
        if args.which not in ("chunking", "vla"):
            raise InvalidArgument(f"bench {args.which}: --lerobot-python is an option of bench chunking and vla only")
        python = input_file(args.lerobot_python, "--lerobot-python").absolute()
        if not os.access(python, os.X_OK):
            raise path_error(OSError(errno.EACCES, "Permission denied (not executable)", str(python)),
                             "--lerobot-python")
        args.lerobot_python = str(python)
    args.numerics = [level.strip() for level in args.numerics.split(",") if level.strip()]
    unknown = [level for level in args.numerics if level not in numerics.CHOICES]
    if unknown or not args.numerics:
        raise InvalidArgument(f"--numerics {','.join(unknown)}: levels are {', '.join(numerics.CHOICES)}")
    if len(args.numerics) > 1 and args.which != "step":
        raise InvalidArgument(f"bench {args.which}: several --numerics levels side by side is bench step only")
    if len(args.numerics) == 1:   # before the benchmark runs torch: the level is fixed at its first operation
        numerics.pin(args.numerics[0])
    if args.async_steps is not None and args.which != "vla":
        raise InvalidArgument(f"bench {args.which}: --async-steps is an option of bench vla only")
    if args.async_steps is not None and args.async_steps < 0:
        raise InvalidArgument(f"--async-steps {args.async_steps}: a count of steps, 0 or more")
    if args.sides is not None and args.which not in ("fleet", "vla"):
        raise InvalidArgument(f"bench {args.which}: --sides is an option of bench fleet and vla only")
    if args.float32_matmul is not None and args.which not in ("fleet", "vla"):
        raise InvalidArgument(f"bench {args.which}: --float32-matmul is an option of bench fleet and vla only")
    args.float32_matmul = args.float32_matmul or FLOAT32_MATMUL_HIGHEST
    module = __import__(f"capsule_ros.benchmarks.{args.which}", fromlist=["main"])
    if args.which == "fleet":
        return module.main(args, sides=_fleet_sides())
    return module.main(args)


def _fleet_sides() -> list:
    """bench fleet's sides: the in-process ones, and the process sides (policy_node and
    fleet_node processes) where ROS imports; where it does not (the GPU machine), those
    sides are recorded as skipped with the reason."""
    from capsule_ros.benchmarks import fleet
    try:
        from capsule_ros.benchmarks.fleet_nodes import PROCESS_SIDES
    except ImportError as exc:
        return [*fleet.in_process_sides(),
                *(fleet.Side(name, None, f"ROS 2 is not importable here ({exc})") for name in fleet.PROCESSES)]
    return [*fleet.in_process_sides(), *PROCESS_SIDES]


DELEGATED = {"demo": "capsule_ros.cli.demo", "replay": "capsule_ros.cli.replay_cmd",
             "record": "capsule_ros.cli.record_cmd", "inspect": "capsule_ros.cli.inspect_cmd",
             "export": "capsule_ros.cli.export_cmd", "check": "capsule_ros.cli.check_cmd",
             "regenerate": "capsule_ros.cli.regenerate_cmd"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capsule-ros", description=__doc__.splitlines()[0],
                                     epilog="Each command's --help lists its exit statuses; an error is one line on "
                                            "stderr (docs/command-line.md).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser("bench", help=COMMANDS["bench"].description, epilog=COMMANDS["bench"].epilog())
    bench.add_argument("which", choices=("snapshot", "reenter", "step", "services", "loop", "commits", "lifecycle",
                                         "cancel", "chunking", "regenerate", "fleet", "startup", "vla"))
    bench.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    bench.add_argument("--quick", action="store_true", help="small sizes: under a minute on a 2-core CPU")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench.add_argument("--prefixes", type=int, nargs="*", help="reenter: prefix lengths in tokens")
    bench.add_argument("--policy", choices=("builtin", "exported", "act", "onnx"), default="builtin",
                       help="step: the built-in policies; an exported program against its eager module; "
                            "ACT from a LeRobot checkpoint (policy.kind lerobot_act) with the snapshot / restore "
                            "of its state; or an ONNX policy (policy.kind onnx) against a plain ONNX Runtime loop")
    bench.add_argument("--module", default="capsule_gru_policy.export:module",
                       help="step --policy exported: package.module:factory of the module to export "
                            "(default: %(default)s, the example package)")
    bench.add_argument("--cases", help=(
        "chunking, fleet, startup, vla, lifecycle: comma-separated cases (chunking default: act100,act10,diffusion,"
        "diffusion-small,smolvla-tiny,smolvla-mid,pi0-tiny,pi05-tiny,pi0-mid; --quick skips smolvla-mid and pi0-mid; "
        "fleet default: default,act,recurrent; startup default: default,onnx,act,diffusion; vla default: smolvla, "
        "pi0 and pi05 with 1, 2 and 3 cameras, smolvla-1cam ... pi05-3cam; lifecycle default: default,pi0,pi05, also "
        "smolvla)"))
    bench.add_argument("--steps", type=int, help="chunking: steps per side (default 3000; --quick 200); fleet: "
                                                 "control periods per side and N (default 200; --quick 50); vla: "
                                                 "steps of the LeRobot and graph sides (default 1000; --quick 100)")
    bench.add_argument("--async-steps", type=int, help="vla: steps of the async side at 30 Hz (default 3000; "
                                                       "--quick 100; 0: not run)")
    bench.add_argument("--sides", help="fleet: comma-separated sides (default fleet,loop,separate,nodes,fleet_node; "
                                       "nodes and fleet_node are processes, skipped where ROS 2 is missing); vla: "
                                       "(default lerobot,lerobot_deterministic,graph,sync_paced,async; a π case's "
                                       "LeRobot side alone takes minutes on a GPU)")
    bench.add_argument("--lerobot-python", help="chunking, vla: the Python of LeRobot's environment for its "
                                                "baseline loop (default tools/lerobot_bench/.venv/bin/python; vla: "
                                                "else this Python where LeRobot imports)")
    bench.add_argument("--numerics", default="portable", metavar="LEVEL[,LEVEL...]",
                       help="CPU numerics level of the policies (runtime.numerics: portable, native, baseline, avx2, "
                            "avx512; default: %(default)s, the node's); step takes several, measured side by side in "
                            "child processes (the cost of a pin: --numerics native,avx2)")
    bench.add_argument("--float32-matmul", choices=FLOAT32_MATMUL_CHOICES,
                       help="fleet, vla: float32 matrix products on the GPU, every side (capsule_ros's "
                            f"runtime.float32_matmul; vla: LeRobot's process the same): {FLOAT32_MATMUL_HIGHEST} "
                            "(default) or high (TensorFloat-32)")
    bench.add_argument("--cpu-hog", action="store_true",
                       help="services: a busy loop on every core for the whole run (a loaded robot computer)")
    bench.set_defaults(func=_bench)

    for name in DELEGATED:
        sub.add_parser(name, help=f"{COMMANDS[name].description} (see capsule-ros {name} --help)", add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:            # the subcommand parses its own options
        module = __import__(DELEGATED[argv[0]], fromlist=["main"])
        return int(module.main(argv[1:]) or 0)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:                    # --help, or a usage error (argparse's 2: bench's refusal)
        return exc.code if isinstance(exc.code, int) else COMMANDS["bench"].refused
    return COMMANDS["bench"].guard(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
