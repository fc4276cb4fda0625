"""Where a fleet's tick spends its time on the host: cProfile, then torch.profiler.

    CAPSULE_ROS_WITHOUT_ROS=1 PYTHONPATH=.:examples/gru_policy python3 bench/profile_fleet_tick.py OUT
        [--device auto|cpu|cuda] [--case act|default|recurrent] [--robots 16] [--ticks 400] [--quick]

Builds a case of ``capsule-ros bench fleet`` as that benchmark does
(``capsule_ros.benchmarks.fleet.make_case``: the same checkpoint, frames and staggered chunks),
one fleet of ``--robots`` slots, and ticks every robot back to back, each tick timed after
each robot's inputs are staged (as the benchmark's fleet side times it). Writes
``OUT/profile_fleet_tick.txt``: the ticks' wall p10/p50/p90/p99 and mean, the Python
functions by own and by cumulative time under cProfile, then host ops, CUDA runtime calls and
device activities under torch.profiler, each over a pass of its own.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
from pathlib import Path
from typing import List

import numpy as np

from capsule_ros.runtime import numerics

TOP = 35


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--case", default="act", choices=("act", "default", "recurrent"))
    parser.add_argument("--robots", type=int, default=16)
    parser.add_argument("--ticks", type=int, default=400)
    parser.add_argument("--quick", action="store_true", help="the benchmark's small sizes")
    args = parser.parse_args()
    numerics.pin("avx2")                       # before torch's first operation, as capsule-ros bench does
    from torch.profiler import ProfilerActivity, profile

    from capsule_ros.benchmarks import fleet as bench
    from capsule_ros.benchmarks.common import resolve_device, write_report

    device = resolve_device(args.device)
    case = bench.make_case(args.case, device, args.quick, Path(tempfile.mkdtemp(prefix="capsule-fleet-profile-")),
                           np.random.default_rng(0), args.robots)
    fleet, names = bench.staggered_fleet(case, args.robots, "vmap")

    def ticks(count: int) -> np.ndarray:
        return bench.timed_ticks(fleet, case, names, count) * 1e3

    ticks(50)                                                   # past the first chunks and launches
    wall = ticks(args.ticks)
    lines: List[str] = [f"{args.case}, {args.robots} robots, {device}, {args.ticks} ticks back to back",
                        "tick ms p10 / p50 / p90 / p99: " + " / ".join(f"{np.percentile(wall, q):.3f}"
                                                                       for q in (10, 50, 90, 99))
                        + f", mean {wall.mean():.3f}"]
    profiler = cProfile.Profile()
    profiler.enable()
    ticks(args.ticks // 2)
    profiler.disable()
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(TOP)
        lines.append(text.getvalue())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        ticks(args.ticks // 4)
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    fleet.release()
    write_report(args.out, "profile_fleet_tick.txt", lines)


if __name__ == "__main__":
    main()
