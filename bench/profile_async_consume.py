"""Where a chunking policy's consume step spends its time, sync against async, under torch.profiler.

    CAPSULE_ROS_WITHOUT_ROS=1 PYTHONPATH=.:examples/gru_policy python3 bench/profile_async_consume.py OUT
        [--device auto|cpu|cuda] [--case act100] [--steps 300] [--rate 50] [--quick] [--back-to-back]

Builds the benchmark policy of a ``capsule-ros bench chunking`` case as that benchmark does
(``capsule_ros.benchmarks.chunking``: the same checkpoint writer, camera, observations and
session settings), then for each mode (sync, async) runs ``--steps`` ticks unprofiled (the
timing pass) and ``--steps`` ticks under torch.profiler (CPU, and CUDA on a GPU), both paced
at ``--rate`` like the benchmark's paced sides (``--back-to-back``: not paced). Each tick is
wrapped in a ``capsule.tick.<program>`` range; events that start inside a consume tick's
range (host ops, CUDA runtime calls, and the kernels and copies they ran, which a tick
waits for) are the consume step's. Writes ``OUT/profile_async_consume.txt``: per mode, the
consume steps' wall p50 / p99 from the timing pass, then the top host ops by self time, the
CUDA runtime calls (launches, waits, synchronisations), and the device activities (kernels,
copies) by total time, each with its calls per consume step.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch
from torch.autograd import DeviceType

from capsule_ros.benchmarks.chunking import CASES, PORTS, Pacer, at, observations, side_session
from capsule_ros.benchmarks.common import resolve_device, write_report
from capsule_ros.benchmarks.lerobot_act import serving_config
from capsule_ros.chunking.mode import ChunkProgram
from capsule_ros.runtime import numerics

TICK = "capsule.tick."
TOP = 25


def pacing(rate: float, paced: bool) -> str:
    return f"paced at {rate:g} Hz" if paced else "back to back"


def drive(session, obs: Dict[str, np.ndarray], steps: int, period: float, paced: bool, first: int,
          profiling: bool) -> Tuple[List[str], np.ndarray]:
    """``steps`` ticks from observation ``first`` on; each one's program and wall seconds."""
    mode = session.parts.runtime.mode
    ports = {PORTS[key]: value for key, value in obs.items()}
    programs, seconds = [], np.zeros(steps)
    pacer = Pacer(period, paced)
    for i in range(steps):
        for port, value in ports.items():
            session.loop.write_input(port, at(value, first + i))
        program = mode.next_program().value
        start = time.perf_counter()
        if profiling:
            with torch.profiler.record_function(TICK + program):
                session.loop.tick()
        else:
            session.loop.tick()
        seconds[i] = time.perf_counter() - start
        programs.append(program)
        pacer.wait()
    return programs, seconds


def consume_events(events) -> Tuple[int, List]:
    """The number of consume ticks, and the events that start inside one (host and device)."""
    windows = sorted((e.time_range.start, e.time_range.end) for e in events        # the host's ranges (a GPU
                     if e.name == TICK + ChunkProgram.CONSUME.value and e.device_type == DeviceType.CPU)  # has its own)
    starts = [w[0] for w in windows]
    inside = []
    for e in events:
        if e.name.startswith(TICK):
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.start <= windows[i][1]:
            inside.append(e)
    return len(windows), inside


def tables(events, ticks: int) -> List[str]:
    """Top host ops (self time), CUDA runtime calls, device activities, per consume step."""
    host: Dict[str, List[float]] = collections.defaultdict(lambda: [0, 0.0])
    runtime: Dict[str, List[float]] = collections.defaultdict(lambda: [0, 0.0])
    device: Dict[str, List[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        on_device = e.device_type != DeviceType.CPU
        if on_device:
            row = device[e.name]
            row[1] += e.time_range.elapsed_us()
        elif e.name.startswith("cu"):              # cudaGraphLaunch, cudaStreamSynchronize, cudaEventQuery, ...
            row = runtime[e.name]
            row[1] += e.time_range.elapsed_us()
        else:
            row = host[e.name]
            row[1] += e.self_cpu_time_total
        row[0] += 1
    out = []
    for title, rows, unit in (("host ops, by self CPU time", host, "self"),
                              ("CUDA runtime calls (launches, waits, syncs), by time", runtime, "wall"),
                              ("device activities (kernels, copies, memsets), by time", device, "device")):
        out.append(f"  {title}:")
        if not rows:
            out.append("    (none)")
            continue
        out.append(f"    {'calls/step':>10} {unit + ' us/step':>13} {'total ms':>9}  name")
        for name, (calls, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:TOP]:
            out.append(f"    {calls / ticks:10.2f} {us / ticks:13.2f} {us / 1e3:9.3f}  {name[:110]}")
    return out


def profile_mode(checkpoint: Path, device: torch.device, chunking: str, obs: Dict[str, np.ndarray], steps: int,
                 rate: float, paced: bool) -> List[str]:
    session = side_session(serving_config(checkpoint), device, chunking, rate, paced, 3 * steps + 20)
    period = 1.0 / rate
    try:
        schedule = session.parts.runtime.mode.schedule.describe()
        drive(session, obs, 20, period, paced, 0, False)                         # past the first, planned step
        programs, seconds = drive(session, obs, steps, period, paced, 20, False)
        consume = seconds[np.asarray(programs) == ChunkProgram.CONSUME.value] * 1e3
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            drive(session, obs, steps, period, paced, 20 + steps, True)
        ticks, inside = consume_events(prof.events())
    finally:
        session.release()
    counts = collections.Counter(programs)
    lines = [f"== {chunking}: {schedule}",
             f"  timing pass ({steps} ticks, {pacing(rate, paced)}, unprofiled): "
             f"programs {dict(counts)}; consume step p50 {np.percentile(consume, 50):.4f} ms, "
             f"p99 {np.percentile(consume, 99):.4f} ms, mean {consume.mean():.4f} ms",
             f"  profiled pass: {ticks} consume ticks; per consume step:"]
    return lines + tables(inside, max(ticks, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for profile_async_consume.txt")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--case", default="act100", choices=sorted(CASES))
    parser.add_argument("--steps", type=int, default=300, help="ticks per pass and mode")
    parser.add_argument("--rate", type=float, default=50.0, help="Hz (bench chunking paces a GPU at 50)")
    parser.add_argument("--quick", action="store_true", help="small networks and a 96 x 128 camera")
    parser.add_argument("--back-to-back", action="store_true", help="no pacing (every step on a warm machine)")
    parser.add_argument("--numerics", default="portable", choices=numerics.CHOICES,
                        help="CPU numerics level, pinned before torch's first operation (as capsule-ros bench does)")
    args = parser.parse_args(argv)
    numerics.pin(args.numerics)
    device = resolve_device(args.device)
    camera = (96, 128) if args.quick else (480, 640) if device.type == "cuda" else (240, 320)
    case = CASES[args.case]
    paced = not args.back_to_back
    lines = [f"profile_async_consume: case {case.name}, {device} "
             f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}, "
             f"camera {camera[0]} x {camera[1]}, {'quick' if args.quick else 'full'} networks, "
             f"{pacing(args.rate, paced)}, {args.steps} ticks per pass",
             "Events are attributed to a consume step when they start inside its tick (see the script's docstring).",
             ""]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = case.write(Path(tmp) / "pretrained_model", camera, args.quick)
        obs = observations(20 + 2 * args.steps, camera)
        for chunking in ("sync", "async"):
            lines += profile_mode(checkpoint, device, chunking, obs, args.steps, args.rate, paced) + [""]
            print(f"profile_async_consume: {chunking} done", file=sys.stderr, flush=True)
    target = write_report(args.out, "profile_async_consume.txt", lines)
    print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
