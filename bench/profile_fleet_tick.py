"""Where a fleet's tick spends its time on the host: cProfile, then torch.profiler.

    CAPSULE_ROS_WITHOUT_ROS=1 PYTHONPATH=.:examples/gru_policy python3 bench/profile_fleet_tick.py OUT
        [--device auto|cpu|cuda] [--case act|act-async|default|recurrent] [--robots 16] [--ticks 400] [--quick]

Builds a case of ``capsule-ros bench fleet`` as that benchmark does
(``capsule_ros.benchmarks.fleet.make_case``: the same checkpoint, frames and staggered chunks),
one fleet of ``--robots`` slots, and ticks every robot back to back, each tick timed after
each robot's inputs are staged (as the benchmark's fleet side times it). Writes
``OUT/profile_fleet_tick.txt``: the ticks' wall p10/p50/p90/p99 and mean; the wall time by part
of the ticks in which no robot plans (the robots' begin and finish, the fleet step, its
launches and waits; per tick and per robot); the Python functions by own and by cumulative time
under cProfile; then host ops, CUDA runtime calls and device activities under torch.profiler;
each over a pass of its own.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from capsule_ros.runtime import numerics

TOP = 35


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--case", default="act", choices=("act", "act-async", "default", "recurrent"))
    parser.add_argument("--robots", type=int, default=16)
    parser.add_argument("--ticks", type=int, default=400)
    parser.add_argument("--quick", action="store_true", help="the benchmark's small sizes")
    args = parser.parse_args()
    numerics.pin("avx2")                       # before torch's first operation, as capsule-ros bench does
    from torch.autograd import DeviceType
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
    lines += parts(fleet, case, names, args.ticks)
    profiler = cProfile.Profile()
    profiler.enable()
    ticks(args.ticks // 2)
    profiler.disable()
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(TOP)
        lines.append(text.getvalue())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiled = args.ticks // 4
    with profile(activities=activities) as prof:
        ticks(profiled)
    averages = prof.key_averages()
    if device.type == "cuda":                   # the GPU's busy time: a ceiling on the fleet's rate (run 31)
        busy_us = sum(e.self_device_time_total for e in averages       # the device's own events, as torch's
                      if e.device_type != DeviceType.CPU and not e.is_user_annotation)   # table totals them
        lines.append(f"GPU busy {busy_us / 1e3:.1f} ms over {profiled} ticks: {busy_us / profiled:.1f} us per tick "
                     f"(kernels and copies of the ticks' programs and of the refills planned meanwhile)")
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=40))
    fleet.release()
    write_report(args.out, "profile_fleet_tick.txt", lines)


def parts(fleet, case, names, count: int) -> List[str]:
    """Wall time by part of the ticks in which no robot plans (every tick for a policy that
    does not chunk), each part timed by a wrapper around it (no profiler: what cProfile adds
    per call would swamp parts of a few microseconds), per tick and per robot."""
    from capsule_ros.benchmarks import fleet as bench
    from capsule_ros.chunking.mode import ChunkingMode
    from capsule_ros.fleet import session as fleet_session
    from capsule_ros.serving.loop import ControlLoop

    runtime = fleet.runtime
    targets = [(ControlLoop, "begin_tick", "robots' begin_tick"), (runtime, "step", "fleet runtime step"),
               (runtime.graphs, "step", "  its programs' launches"), (fleet_session, "_finish", "robots' finish"),
               (runtime, "wait_for_step", "  the wait for the step")]
    spent: Dict[str, int] = {}
    saved = [(owner, attr, getattr(owner, attr), attr in vars(owner)) for owner, attr, _ in targets]

    def timed(fn, label):
        def run(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0) + time.perf_counter_ns() - start
        return run
    modes = [fleet.robot(name).session.parts.runtime.mode for name in names]
    chunking = [mode for mode in modes if isinstance(mode, ChunkingMode)]
    totals: Dict[str, int] = {}
    counted = 0
    try:
        for owner, attr, label in targets:
            setattr(owner, attr, timed(getattr(owner, attr), label))
        for t in range(count):
            for name in names:
                bench._stage(fleet.robot(name).loop, case, t)
            plans = any(mode.plans() for mode in chunking)
            spent.clear()
            start = time.perf_counter_ns()
            fleet.tick(names)
            spent["fleet tick"] = time.perf_counter_ns() - start
            if not plans:
                counted += 1
                for label, ns in spent.items():
                    totals[label] = totals.get(label, 0) + ns
    finally:
        for owner, attr, fn, own in saved:          # a class's or module's own back; an instance's shadow gone
            if own:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)
    out = [f"parts of the {counted} ticks in which no robot planned, us per tick / per robot:"]
    order = ["fleet tick"] + [label for _, _, label in targets]
    for label in order:
        us = totals.get(label, 0) / max(counted, 1) / 1e3
        out.append(f"  {label:28s} {us:9.1f} / {us / len(names):7.2f}")
    return out


if __name__ == "__main__":
    main()
