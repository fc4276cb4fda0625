"""`capsule-ros bench lifecycle`: is the first step after ``activate`` a cold one?

The node's lifecycle as the factory runs it (no ROS needed): ``prepare_serving`` is
configure, ``start_session`` is activate (arena, capture, warm-up), ``release`` is
cleanup. Each cycle configures, activates, times the first tick on staged inputs, then
``STEADY_TICKS`` more, and cleans up; the figure is the first tick against the p50 of the
steady ticks of the same cycle that ran the same program (a chunking policy's first tick
plans a chunk: it is compared with the later ticks that plan one), and over all cycles
(the median and the worst first tick). It also reports the device memory left allocated
after cleanup (CUDA), cleaned up as the node does.

Cases (``--cases``, default ``default,pi0,pi05``): ``default`` (config/policy.yaml, 20
cycles), and the VLA kinds with their chunk of 50 (5 cycles each): ``pi0`` / ``pi05``
(``lerobot_pi.BENCH``: ``mid`` on a GPU, ``tiny`` on a CPU or with ``--quick``; capsule_ros
writes the checkpoint) and ``smolvla`` (``lerobot_smolvla.SPECS``, the same sizes; LeRobot
writes the checkpoint, so it needs LeRobot's environment, as ``bench vla`` finds it).
Target: the first active step within 1.2x of the steady-state p50.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from capsule_ros.benchmarks.common import config_path, emit, environment, print_table, resolve_device
from capsule_ros.errors import ConfigError
from capsule_ros.runtime.engine import release_device_memory
from capsule_ros.runtime.streams import StreamKeeper
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import prepare_serving, start_session

TARGET_RATIO = 1.2
STEADY_TICKS = 200
CASES = ("default", "pi0", "pi05", "smolvla")
CYCLES = {"default": 20}          # the VLA kinds: VLA_CYCLES (each activation captures a whole VLA)
VLA_CYCLES = 5


def _for_the_cycles(config: ServingConfig, device: torch.device, directory: Path) -> ServingConfig:
    """``config`` on ``device``, its ports' staleness check off: the ticks stage their inputs
    directly (no message ever arrives on a port), and a node fed by its topics never warns
    that a port is stale on its first tick, which this one would (a log line: host work the
    first tick after activate does not pay in the node). The input log holds a cycle's ticks,
    as a node's holds its episode (the default 20,000 steps of a VLA's cameras are over the
    log's memory limit, which configure refuses)."""
    ports = {name: dataclasses.replace(port, staleness_ms=0.0) for name, port in config.ports.items()}
    return dataclasses.replace(
        config, ports=ports, runtime=dataclasses.replace(config.runtime, device=str(device)),
        control=dataclasses.replace(config.control, deadline_ms=0.0, input_log_steps=STEADY_TICKS + 1),
        capsules=dataclasses.replace(config.capsules, directory=str(directory)))


def case_config(case: str, device: torch.device, quick: bool, tmp: Path) -> ServingConfig:
    """The case's serving configuration (its checkpoint written under ``tmp``); ConfigError /
    RuntimeError: why it cannot be made here."""
    if case == "default":
        config = ServingConfig.from_file(config_path("policy.yaml"))
        return dataclasses.replace(config, policy=dataclasses.replace(config.policy, weights=""))
    from capsule_ros.benchmarks import lerobot_pi, lerobot_smolvla, vla
    size = "tiny" if quick or device.type == "cpu" else "mid"
    if case == "smolvla":
        python = vla.lerobot_python(None)
        if python is None:
            raise ConfigError("the SmolVLA checkpoint is written by LeRobot, and there is no LeRobot environment here")
        return lerobot_smolvla.serving_config(lerobot_smolvla.write_smolvla_checkpoint(tmp / case, size, python))
    checkpoint, tokenizer = lerobot_pi.write_pi_checkpoint(tmp / case, lerobot_pi.bench_spec(case, size),
                                                           device=device.type)
    return lerobot_pi.serving_config(checkpoint, tokenizer)


def _tick(session, fed: Sequence[str]) -> Tuple[float, str]:
    """One tick on fresh inputs (the ``fed`` ports); seconds (outputs on the host at the end,
    as the node reads them) and the program it ran."""
    staging = session.parts.runtime.staging
    for name in fed:
        session.loop.write_input(name, np.full(staging[name].shape, 0.1, staging[name].dtype))
    start = time.perf_counter()
    session.loop.tick()
    seconds = time.perf_counter() - start
    last = getattr(session.parts.runtime.mode, "last", None)       # a chunking mode's last program
    return seconds, str(last.program) if last is not None else "step"


def _cycle(config: ServingConfig, streams: StreamKeeper) -> dict:
    session = start_session(prepare_serving(config), streams=streams)
    fed = [name for name, port in config.ports.items() if port.type != "std_msgs/msg/String"]   # a task: policy.task
    try:
        first, program = _tick(session, fed)
        steady = [_tick(session, fed) for _ in range(STEADY_TICKS)]
    finally:
        device = session.parts.runtime.device
        session.release()
    del session
    release_device_memory(device, cublas_workspaces=True)      # as the node's cleanup does
    leftover = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    same = [seconds for seconds, ran in steady if ran == program]
    p50 = float(np.percentile(same, 50))
    return {"first_ms": first * 1e3, "program": program, "steady_p50_ms": p50 * 1e3, "steady_ticks_compared": len(same),
            "ratio": first / p50, "allocated_after_cleanup_bytes": int(leftover)}


def run_case(case: str, device: torch.device, quick: bool) -> dict:
    cycles = 5 if quick else CYCLES.get(case, VLA_CYCLES)
    with tempfile.TemporaryDirectory(prefix="capsule-bench-lifecycle-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            config = _for_the_cycles(case_config(case, device, quick, tmp), device, tmp / "capsules")
        except (ConfigError, RuntimeError) as exc:
            return {"case": case, "ran": False, "reason": str(exc)}
        release_device_memory(device, cublas_workspaces=True)
        baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        streams = StreamKeeper()                 # as the node keeps one across its activations
        try:
            results = [_cycle(config, streams) for _ in range(cycles)]
        except ConfigError as exc:               # configure refused it: the other cases still run
            return {"case": case, "ran": False, "reason": f"refused at configure: {exc}"}
    firsts = np.array([r["first_ms"] for r in results])
    p50 = float(np.median([r["steady_p50_ms"] for r in results]))
    median_ratio = float(np.median(firsts) / p50)
    return {"case": case, "cycles": cycles, "steady_ticks": STEADY_TICKS, "per_cycle": results,
            "first_program": results[0]["program"], "first_ms_median": float(np.median(firsts)),
            "first_ms_max": float(firsts.max()), "steady_p50_ms": p50, "first_vs_p50_median": median_ratio,
            "first_vs_p50_worst": float(firsts.max() / p50), "allocated_before_bytes": int(baseline),
            "allocated_after_cleanup_bytes": max(r["allocated_after_cleanup_bytes"] for r in results),
            "target": TARGET_RATIO, "met": bool(median_ratio <= TARGET_RATIO)}


def run(device_name: str = "cpu", quick: bool = False, cases: Sequence[str] = CASES[:3]) -> dict:
    device = resolve_device(device_name)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"--cases {unknown}: not among {list(CASES)}")
    results: List[Dict] = [run_case(case, device, quick) for case in cases]
    ran = [r for r in results if r.get("ran", True)]
    return {"bench": "lifecycle", **environment(device), "quick": quick, "target": TARGET_RATIO, "cases": results,
            "met": bool(ran) and all(r["met"] for r in ran),
            "allocated_after_cleanup_bytes": max((r["allocated_after_cleanup_bytes"] for r in ran), default=0)}


def table(result: dict) -> None:
    rows: List[List[object]] = []
    for case in result["cases"]:
        if not case.get("ran", True):
            rows.append([case["case"], case["reason"][:70], "", "", "", "", ""])
            continue
        rows.append([case["case"], case["first_program"], case["first_ms_median"], case["steady_p50_ms"],
                     case["first_vs_p50_median"], case["first_vs_p50_worst"],
                     f"{case['allocated_before_bytes']} -> {case['allocated_after_cleanup_bytes']}"])
    print_table(f"first active step vs steady state on {result['device']} (ms; target first / p50 <= "
                f"{result['target']})", ["case", "first program", "first tick (median)", "steady p50",
                                         "first / p50 median", "worst", "device bytes before -> after cleanup"],
                rows)


def main(args) -> int:
    cases: Optional[Sequence[str]] = tuple(args.cases.split(",")) if getattr(args, "cases", None) else None
    emit(run(args.device, args.quick, cases or CASES[:3]), args.json, table)
    return 0
