"""Where a VLA's chunk goes on the GPU: the refill program replayed from its CUDA graph
against the same program run eagerly, and the kernels inside it. ``--case act``: ACT's
batch-1 refill as ``capsule-ros bench fleet`` serves it (ALOHA's 480 x 640 camera), what
bounds a chunking fleet on a GPU (docs/fleet.md).

    CAPSULE_ROS_WITHOUT_ROS=1 PYTHONPATH=.:examples/gru_policy python3 bench/profile_vla_chunk.py OUT
        [--case smolvla-1cam|act] [--quick] [--runs 10] [--device cuda] [--float32-matmul high]

Builds the case's checkpoint and session as ``capsule-ros bench vla`` does
(``capsule_ros.benchmarks.vla``: SmolVLA's is written by LeRobot, which must import here or
be named by ``CAPSULE_ROS_LEROBOT_PYTHON``; ACT's as ``capsule_ros.benchmarks.lerobot_act``
writes it), steps once (the episode's first chunk), then
times ``--runs`` replays of the refill program's graph and as many eager runs of it
(CUDA events, each waited for), and profiles three eager runs under torch.profiler: the
number of kernels a chunk launches and the kernels by total GPU time. Before the profile it
times the refill captured again with ``SideBySide`` off
(``capsule_ros/policies/vla/side_by_side.py``: the cameras and the projections one after the
other), the same way (a VLA's only). Writes
``OUT/profile_vla_chunk.txt``. The program runs on the live arena: the session is thrown
away after.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.autograd import DeviceType

from capsule_ros.benchmarks import lerobot_act, vla
from capsule_ros.benchmarks.chunking import at, observations, side_session
from capsule_ros.benchmarks.common import resolve_device, time_calls, write_report
from capsule_ros.chunking.mode import ChunkProgram
from capsule_ros.runtime import numerics
from capsule_ros.runtime.numerics import FLOAT32_MATMUL_CHOICES, FLOAT32_MATMUL_HIGHEST

TOP = 30
ACT = "act"


def written_case(name: str, root: Path, quick: bool, device: torch.device) -> vla.Written:
    """The case's checkpoint as its benchmark writes it: a VLA of ``bench vla``, or ACT."""
    if name == ACT:
        checkpoint = lerobot_act.write_act_checkpoint(root, quick=quick)
        config = lerobot_act.serving_config(checkpoint)
        height, width, _ = config.ports[lerobot_act.PORTS[lerobot_act.CAMERA]].shape
        return vla.Written(checkpoint, config, dict(lerobot_act.PORTS), (lerobot_act.CAMERA,), (height, width), ())
    return vla.write_case(vla.CASES[name], root, quick, device, vla.lerobot_python(None), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--case", default="smolvla-1cam", choices=[*sorted(vla.CASES), ACT])
    parser.add_argument("--quick", action="store_true", help="the tiny sizes")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda (a CPU has no graphs: both runs are eager)")
    parser.add_argument("--float32-matmul", choices=FLOAT32_MATMUL_CHOICES, default=FLOAT32_MATMUL_HIGHEST,
                        help="runtime.float32_matmul (high: TensorFloat-32)")
    args = parser.parse_args()
    numerics.pin(numerics.PORTABLE)             # before torch's first operation, as capsule-ros bench does
    device = resolve_device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    lines = [f"{args.case} on {where}, torch {torch.__version__}, float32_matmul {args.float32_matmul}"]
    with tempfile.TemporaryDirectory() as tmp:
        written = written_case(args.case, Path(tmp) / args.case, args.quick, device)
        joints = int(written.config.ports["joints"].shape[0])           # every case's joint-position port
        obs = observations(4, written.camera, joints=joints, cameras=written.camera_keys)
        written = vla.at_float32_matmul(written, args.float32_matmul)
        session = side_session(written.config, device, "sync", vla.ASYNC_RATE_HZ, paced=False, steps=4)
        for key, value in obs.items():
            session.loop.write_input(written.ports_of[key], at(value, 0))
        session.loop.tick()                                   # the first chunk: inputs staged, state not initial
        runtime = session.parts.runtime
        refill = ChunkProgram.REFILL.value
        stream = runtime.stream
        graph_s = time_calls(lambda: runtime.graphs.step(refill), args.runs, device, stream=stream)
        eager_s = time_calls(lambda: runtime.graphs.step(refill, eager=True), args.runs, device, stream=stream)
        lines.append(f"refill, graph replay: p50 {np.percentile(graph_s, 50) * 1e3:.3f} ms, "
                     f"min {graph_s.min() * 1e3:.3f} ms")
        lines.append(f"refill, eager:        p50 {np.percentile(eager_s, 50) * 1e3:.3f} ms, "
                     f"min {eager_s.min() * 1e3:.3f} ms")
        side_by_side = getattr(runtime.policy, "side_by_side", None)   # a VLA's: the same refill, calls in order
        if side_by_side is not None:
            side_by_side.enabled = False
            runtime.graphs.recapture(refill)
            in_order_s = time_calls(lambda: runtime.graphs.step(refill), args.runs, device, stream=stream)
            side_by_side.enabled = True
            lines.append(f"refill, graph replay with no side-by-side branches (cameras, projections in order): p50 "
                         f"{np.percentile(in_order_s, 50) * 1e3:.3f} ms, min {in_order_s.min() * 1e3:.3f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runtime.graphs.step(refill, eager=True)
            runtime.synchronize()
        kernels: collections.Counter = collections.Counter()
        gpu_us: collections.Counter = collections.Counter()
        for event in prof.events():
            if event.device_type == DeviceType.CUDA or (device.type == "cpu" and event.device_type == DeviceType.CPU
                                                        and event.name.startswith("aten::")):
                kernels[event.name] += 1
                gpu_us[event.name] += event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
        total_kernels, total_us = sum(kernels.values()) / 3, sum(gpu_us.values()) / 3
        lines.append(f"per eager refill: {total_kernels:.0f} GPU activities (kernels and copies), "
                     f"{total_us / 1e3:.3f} ms of GPU time summed (the rest of a graph replay's time is gaps "
                     "between them)")
        lines.append(f"top {TOP} by GPU time per refill (us, count):")
        for name, us in gpu_us.most_common(TOP):
            lines.append(f"  {us / 3:10.1f}  {kernels[name] / 3:6.0f}  {name[:140]}")
        session.release()
    write_report(args.out, "profile_vla_chunk.txt", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
