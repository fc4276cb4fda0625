"""`capsule-ros bench lifecycle`: is the first step after ``activate`` a cold one?

The node's lifecycle as the factory runs it (no ROS needed): ``prepare_serving`` is
configure, ``start_session`` is activate (arena, capture, warm-up), ``release`` is
cleanup. Each cycle configures, activates, times the first tick on staged inputs, then
``STEADY_TICKS`` more, and cleans up; the figure is the first tick against the p50 of the
steady ticks of the same cycle, and over all cycles (the median and the worst first
tick). It also reports the device memory left allocated after cleanup (CUDA).
Target: the first active step within 1.2x of the steady-state p50.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from capsule_ros.benchmarks.common import config_path, emit, environment, print_table, resolve_device
from capsule_ros.runtime.engine import release_device_memory
from capsule_ros.runtime.streams import StreamKeeper
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import prepare_serving, start_session

TARGET_RATIO = 1.2
STEADY_TICKS = 200


def _config(device: torch.device, directory: Path) -> ServingConfig:
    """config/policy.yaml on ``device``, its ports' staleness check off: the ticks stage their
    inputs directly (no message ever arrives on a port), and a node fed by its topics never
    warns that a port is stale on its first tick, which this one would (a log line: host
    work the first tick after activate does not pay in the node)."""
    config = ServingConfig.from_file(config_path("policy.yaml"))
    ports = {name: dataclasses.replace(port, staleness_ms=0.0) for name, port in config.ports.items()}
    return dataclasses.replace(
        config, ports=ports, policy=dataclasses.replace(config.policy, weights=""),
        runtime=dataclasses.replace(config.runtime, device=str(device)),
        control=dataclasses.replace(config.control, deadline_ms=0.0),
        capsules=dataclasses.replace(config.capsules, directory=str(directory)))


def _tick(session) -> float:
    """One tick on fresh inputs; seconds (outputs on the host at the end, as the node reads them)."""
    for name, view in session.parts.runtime.staging.items():
        session.loop.write_input(name, np.full(view.shape, 0.1, view.dtype))
    start = time.perf_counter()
    session.loop.tick()
    return time.perf_counter() - start


def _cycle(config: ServingConfig, streams: StreamKeeper) -> dict:
    session = start_session(prepare_serving(config), streams=streams)
    try:
        first = _tick(session)
        steady = np.array([_tick(session) for _ in range(STEADY_TICKS)])
    finally:
        device = session.parts.runtime.device
        session.release()
    del session
    release_device_memory(device, cublas_workspaces=True)      # as the node's cleanup does
    leftover = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    p50 = float(np.percentile(steady, 50))
    return {"first_ms": first * 1e3, "steady_p50_ms": p50 * 1e3, "ratio": first / p50,
            "allocated_after_cleanup_bytes": int(leftover)}


def run(device_name: str = "cpu", quick: bool = False) -> dict:
    device = resolve_device(device_name)
    cycles = 5 if quick else 20
    with tempfile.TemporaryDirectory(prefix="capsule-bench-lifecycle-") as tmp:
        config = _config(device, Path(tmp) / "capsules")
        baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        streams = StreamKeeper()                 # as the node keeps one across its activations
        results = [_cycle(config, streams) for _ in range(cycles)]
    firsts = np.array([r["first_ms"] for r in results])
    p50 = float(np.median([r["steady_p50_ms"] for r in results]))
    median_ratio = float(np.median(firsts) / p50)
    return {"bench": "lifecycle", **environment(device), "quick": quick, "cycles": cycles,
            "steady_ticks": STEADY_TICKS, "per_cycle": results, "first_ms_median": float(np.median(firsts)),
            "first_ms_max": float(firsts.max()), "steady_p50_ms": p50, "first_vs_p50_median": median_ratio,
            "first_vs_p50_worst": float(firsts.max() / p50),
            "allocated_before_bytes": int(baseline),
            "allocated_after_cleanup_bytes": max(r["allocated_after_cleanup_bytes"] for r in results),
            "target": TARGET_RATIO, "met": bool(median_ratio <= TARGET_RATIO)}


def table(result: dict) -> None:
    rows = [[i + 1, r["first_ms"], r["steady_p50_ms"], r["ratio"]] for i, r in enumerate(result["per_cycle"])]
    print_table(f"first active step vs steady state on {result['device']} (ms)",
                ["cycle", "first tick", "steady p50", "first / p50"], rows)
    print(f"first / steady p50: median {result['first_vs_p50_median']:.2f}, worst {result['first_vs_p50_worst']:.2f} "
          f"(target <= {result['target']}: {'met' if result['met'] else 'NOT met'}); device memory allocated "
          f"before {result['allocated_before_bytes']} B, after cleanup {result['allocated_after_cleanup_bytes']} B")


def main(args) -> int:
    emit(run(args.device, args.quick), args.json, table)
    return 0
