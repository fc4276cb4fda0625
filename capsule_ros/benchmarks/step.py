"""`capsule-ros bench step`: control-step latency of the default and the reference policy,
CUDA-graph replay against the same plan run eagerly, side by side in one run.

Two figures per variant: ``gpu`` (the step alone, CUDA events; on a CPU the same as
``loop``) and ``loop`` (what the node pays per step: write the staged inputs, step, read
the action back; host clock). ``unguarded`` is the same plan without the step guard
(``runtime.guard_steps``: one on-device copy of the state before each step, so a failed
or non-finite step can be undone): the difference is the guard's cost. On a CPU, ``cpu``
is the step thread's CPU time, which other processes of a busy machine do not inflate.

``--numerics native,portable,...`` compares CPU numerics levels (``runtime.numerics``,
``capsule_ros.runtime.numerics``): a level is fixed for a process at torch's first
operation, so each level's ``bench step`` runs in its own child process, the levels
alternating over 5 rounds; the table gives each level's median step p50 (CPU time on a
CPU) and its ratio to the first level's: the cost of a pin.

``--policy exported`` times an exported program instead: the module ``--module`` names
(default: the example package's GRU) is exported with ``capsule-ros export``'s code and
served by the runtime (graph-captured on a GPU, its plan run eagerly for reference),
against the module itself called eagerly with its state threaded through static tensors,
which is how it would run without capsule_ros. ``speedup`` is the eager module's step over
the served program's (both without the step guard, so both do the same work).

``--policy onnx`` times an Isaac Lab-style recurrent ``policy.onnx`` served through
``policy.kind: onnx`` against a plain ONNX Runtime loop (``benchmarks/onnx_step.py``).

``--policy act`` times a LeRobot ACT checkpoint served through ``policy.kind: lerobot_act``
at batch 1 (``benchmarks/lerobot_act.py`` writes it: ACTConfig's defaults, one 480 x 640
camera, 14 joints; ``--quick`` a small one): the eager step and, on a GPU, the
graph-captured one with their ratio ``graph_speedup``; whether both give the same action
bit for bit; and the snapshot / restore of its whole arena (the capsule: inputs, action
queue, metadata, outputs) against the limit, one plain copy of as many bytes
(``benchmarks/snapshot.py``'s measurement). On a CPU the step is timed at the node's
default ``runtime.cpu_threads`` (1) and with every core. The network runs at every step
(its output is used when the queue is empty, ``policies/lerobot/act.py``), so the step
time is a forward pass, the worst case of LeRobot's ``select_action``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device, time_calls
from capsule_ros.benchmarks.reenter import QUICK
from capsule_ros.chunking.mode import mode_for
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.runtime.schema import BufferKind
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy


def measure(config: ServingConfig, device: torch.device, graphs: bool, reps: int, guard: bool = True) -> dict:
    runtime_cfg = dataclasses.replace(config.runtime, device=str(device), cuda_graphs=graphs, guard_steps=guard)
    policy = build_policy(dataclasses.replace(config, runtime=runtime_cfg), device=device)
    runtime = build_policy_runtime(policy, runtime_cfg, mode=mode_for(policy))
    kernels = getattr(runtime.policy, "kernels", None)
    return {**measure_runtime(runtime, device, reps), "compiled": bool(getattr(kernels, "compiled", False))}


def measure_runtime(runtime: PolicyRuntime, device: torch.device, reps: int) -> dict:
    """The step alone and the node's loop (stage inputs, step, read back) of a runtime, on
    random inputs (uniform bytes for uint8 ports, normal values otherwise); ``action``:
    the first step's action after a reset, as float32 bytes in hex (to compare plans)."""
    rng = np.random.default_rng(0)
    for view in runtime.staging.values():
        view[...] = (rng.integers(0, 256, size=view.shape) if view.dtype == np.uint8
                     else rng.normal(size=view.shape)).astype(view.dtype)
    runtime.load_inputs()
    runtime.step()
    first = runtime.read_outputs().action.astype(np.float32).tobytes().hex()
    gpu = time_calls(runtime.step, reps, device, warmup=5, stream=runtime.stream)

    def loop_step():
        runtime.load_inputs()
        runtime.step()
        runtime.read_outputs()
    loop = time_calls(loop_step, reps, torch.device("cpu"), warmup=5)
    cpu = {} if device.type != "cpu" else {
        "cpu_ms": pct(time_calls(runtime.step, reps, device, warmup=5, clock=time.thread_time), 1e3)}
    return {"gpu_ms": pct(gpu, 1e3), "loop_ms": pct(loop, 1e3), **cpu, "graph_captured": runtime.graphs.captured,
            "parameters": sum(p.numel() for p in runtime.policy.parameters()), "action": first,
            "threads": torch.get_num_threads() if device.type == "cpu" else None}


def at_level(config: ServingConfig, level: str) -> ServingConfig:
    """``config`` at the CPU numerics level the benchmark runs at (``--numerics``)."""
    return dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, numerics=level))


def run_exported(device: torch.device, quick: bool, module_spec: str, level: str = "portable") -> dict:
    """The exported program served (graph and eager plan) against its module run eagerly."""
    from capsule_ros.policies.export import export_module, load_factory
    from capsule_ros.policies.exported import ExportedPolicy
    from capsule_ros.policies.phases import EagerLoop
    reps = 50 if quick else 300
    module = load_factory(module_spec)()
    with tempfile.TemporaryDirectory() as tmp:
        report = export_module(module, Path(tmp) / "program.pt2", source={"module": module_spec})
        served = {}
        for graphs in ((True, False) if device.type == "cuda" else (False,)):
            config = RuntimeConfig(device=str(device), cuda_graphs=graphs, guard_steps=False, numerics=level)
            policy = ExportedPolicy.from_file(report.path)
            runtime = build_policy_runtime(policy, config, mode=mode_for(policy))
            served["graph" if graphs else "eager"] = measure_runtime(runtime, device, reps)
    interface = report.interface
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn((1, *s.shape), generator=generator).to(s.dtype).to(device) if s.dtype.is_floating_point
              else torch.zeros((1, *s.shape), dtype=s.dtype, device=device) for s in interface.inputs]
    module = module.to(device).eval()
    loop = EagerLoop(module, inputs, device)
    eager = {"gpu_ms": pct(time_calls(loop.step, reps, device, warmup=5), 1e3),
             "parameters": sum(p.numel() for p in module.parameters())}
    best = served.get("graph") or served["eager"]
    return {"bench": "step", "policy": "exported", "module": module_spec, **environment(device), "quick": quick,
            "program": {"sha256": report.sha256, "bytes": report.nbytes, "interface": interface.describe(),
                        "equals_module_bit_for_bit": report.mismatch is None},
            "eager_module": eager, "exported_graph": served.get("graph"), "exported_eager": served["eager"],
            "speedup": eager["gpu_ms"]["p50"] / best["gpu_ms"]["p50"]}


def run(device_name: str = "auto", quick: bool = False, level: str = "portable") -> dict:
    device = resolve_device(device_name)
    default = at_level(ServingConfig.from_file(config_path("policy.yaml")), level)
    default = dataclasses.replace(default, policy=dataclasses.replace(default.policy, weights=""))
    reference = at_level(ServingConfig.from_file(config_path("reference_hybrid.yaml")), level)
    if quick or device.type == "cpu":
        # the 0.75 B bf16 reference is GPU-sized: on a CPU (or --quick) use its scaled-down variant
        quick_shape = dataclasses.replace(reference.policy_settings, **QUICK)
        reference = dataclasses.replace(reference, policy_settings=quick_shape)
    reps = 50 if quick else 300
    policies = []
    scaled = getattr(reference.policy_settings, "d_model", None) == QUICK["d_model"]
    for name, config in (("default", default), ("reference" + ("-quick" if scaled else ""), reference)):
        row: Dict[str, Any] = {"policy": name, "eager": measure(config, device, False, reps)}
        if device.type == "cuda":
            row["graph"] = measure(config, device, True, reps)
            row["graph_speedup"] = row["eager"]["gpu_ms"]["p50"] / row["graph"]["gpu_ms"]["p50"]
            row["unguarded"] = measure(config, device, True, reps, guard=False)
        else:
            row["graph"] = None          # no CUDA graphs on a CPU: the plan runs eagerly
            row["unguarded"] = measure(config, device, False, reps, guard=False)
        guarded = row["graph"] or row["eager"]
        row["guard_cost"] = guarded["gpu_ms"]["p50"] / row["unguarded"]["gpu_ms"]["p50"]
        policies.append(row)
    return {"bench": "step", **environment(device), "quick": quick, "numerics": level, "policies": policies}


def table_exported(result: dict) -> None:
    rows = [[label, result[key]["gpu_ms"]["p50"], result[key]["gpu_ms"]["p99"]]
            for label, key in (("eager module", "eager_module"), ("exported, CUDA graph", "exported_graph"),
                               ("exported, eager plan", "exported_eager")) if result.get(key)]
    print_table(f"{result['module']} step on {result['device']} (ms): the served program is "
                f"{result['speedup']:.2f}x the eager module", ["variant", "step p50", "step p99"], rows)


def run_act(device_name: str = "auto", quick: bool = False, level: str = "portable") -> dict:
    """ACT from a LeRobot checkpoint at batch 1 (module docstring)."""
    from capsule_ros.benchmarks.lerobot_act import checkpoint_summary, serving_config, write_act_checkpoint
    from capsule_ros.benchmarks.snapshot import bench_state
    device = resolve_device(device_name)
    reps = (10 if quick else 30) if device.type == "cpu" else (50 if quick else 300)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_act_checkpoint(Path(tmp) / "pretrained_model", quick=quick)
        config = at_level(serving_config(checkpoint), level)
        row: dict = {"policy": "act" + ("-quick" if quick else ""), "checkpoint": checkpoint_summary(checkpoint)}
        row["eager"] = measure(config, device, False, reps)
        if device.type == "cuda":
            row["graph"] = measure(config, device, True, reps)
            row["graph_speedup"] = row["eager"]["gpu_ms"]["p50"] / row["graph"]["gpu_ms"]["p50"]
            row["graph_matches_eager"] = row["graph"]["action"] == row["eager"]["action"]
        else:
            row["graph"] = None          # no CUDA graphs on a CPU: the plan runs eagerly
            cores = len(os.sched_getaffinity(0))
            if cores > 1:
                threads = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, cpu_threads=cores))
                row["eager_all_cores"] = measure(threads, device, False, reps)
                row["eager_all_cores_matches"] = row["eager_all_cores"]["action"] == row["eager"]["action"]
                torch.set_num_threads(1)
        policy = build_policy(config, device=device)
        runtime = build_policy_runtime(policy, dataclasses.replace(config.runtime, device=str(device)),
                                       mode=mode_for(policy))
        row["capsule"] = bench_state("act" + ("-quick" if quick else ""), runtime.layout, device,
                                     2000 if runtime.layout.nbytes < 2**24 else 200)
        row["capsule"]["state_bytes"] = {kind.value: hi - lo for kind in BufferKind
                                         for lo, hi in [runtime.layout.byte_range(kind)] if hi > lo}
    return {"bench": "step", **environment(device), "quick": quick, "numerics": level, "policies": [row]}


def table(result: dict) -> None:
    rows = []
    for p in result["policies"]:
        for variant in ("graph", "eager", "eager_all_cores", "unguarded"):
            m = p.get(variant)
            if m is None:
                continue
            label = variant if m.get("threads") is None else f"{variant} ({m['threads']} thr)"
            rows.append([p["policy"], label, f"{m['parameters'] / 1e6:.2f} M", m["gpu_ms"]["p50"],
                         m["gpu_ms"]["p99"], m["loop_ms"]["p50"], m["loop_ms"]["p99"]])
    print_table(f"step latency on {result['device']} (ms)",
                ["policy", "plan", "params", "step p50", "step p99", "loop p50", "loop p99"], rows)
    for p in result["policies"]:
        if "graph_speedup" in p:
            print(f"{p['policy']}: graph-captured step {p['graph_speedup']:.2f}x faster than eager"
                  + ("" if "graph_matches_eager" not in p else
                     f" (same action bit for bit: {p['graph_matches_eager']})"))
        capsule = p.get("capsule")
        if capsule:
            print(f"{p['policy']}: capsule of {capsule['bytes']} bytes: snapshot {capsule['snapshot_us']:.3g} us, "
                  f"restore {capsule['restore_us']:.3g} us, limit (one copy) {capsule['limit_us']:.3g} us, "
                  f"ratio {capsule['ratio_to_limit']:.2f}")


def run_levels(args, levels: Sequence[str], rounds: int = 5) -> dict:
    """``bench step`` at each CPU numerics level in its own child process (a level is fixed
    for a process at torch's first operation), the levels alternating for ``rounds``
    rounds so that a busy machine's noise falls on all of them alike. ``step_p50_ms``: the
    median over the rounds of each run's step p50; ``cost``: each level's over the first
    level's, per policy and plan."""
    runs: Dict[str, List[dict]] = {level: [] for level in levels}
    for _ in range(rounds):
        for level in levels:
            argv = [sys.executable, "-m", "capsule_ros.cli.main", "bench", "step", "--json", "--numerics", level,
                    "--device", args.device, "--policy", args.policy, "--module", args.module]
            done = subprocess.run(argv + (["--quick"] if args.quick else []), capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"bench step --numerics {level}: {done.stderr.strip().splitlines()[-1:]}")
            runs[level].append(json.loads(done.stdout))
    summary = {level: {variant: float(np.median(v)) for variant, v in _step_p50s(r).items()}
               for level, r in runs.items()}
    cost = {level: {variant: summary[level][variant] / summary[levels[0]][variant] for variant in summary[level]}
            for level in levels[1:]}
    capability = {level: r[0].get("cpu_capability", "") for level, r in runs.items()}
    return {"bench": "step-numerics", **environment(resolve_device(args.device)), "quick": args.quick,
            "levels": list(levels), "rounds": rounds, "cpu_capability": capability, "step_p50_ms": summary,
            "cost": cost, "runs": runs}


def _step_p50s(runs: List[dict]) -> Dict[str, List[float]]:
    """'policy plan' -> the step p50 (ms) of each run: the step thread's CPU time on a CPU
    (robust on a shared machine), CUDA-event time on a GPU."""
    out: Dict[str, List[float]] = {}
    for result in runs:
        for p in result["policies"]:
            for variant in ("graph", "eager", "unguarded"):
                if p.get(variant):
                    figure = p[variant].get("cpu_ms") or p[variant]["gpu_ms"]
                    out.setdefault(f"{p['policy']} {variant}", []).append(figure["p50"])
    return out


def table_levels(result: dict) -> None:
    levels = result["levels"]
    header = ["policy, plan", *[f"{level} ({result['cpu_capability'][level]}) p50" for level in levels],
              *[f"{level} / {levels[0]}" for level in levels[1:]]]
    rows = [[variant, *[result["step_p50_ms"][level][variant] for level in levels],
             *[result["cost"][level][variant] for level in levels[1:]]] for variant in result["step_p50_ms"][levels[0]]]
    clock = "CPU time of the step" if result["device"] == "cpu" else "step"
    print_table(f"{clock} by CPU numerics level on {result['device']} (p50 in ms; median of {result['rounds']} "
                "alternating rounds)", header, rows)


def main(args) -> int:
    levels = args.numerics
    if args.policy == "onnx":
        from capsule_ros.benchmarks import onnx_step
        return onnx_step.main(args)
    if len(levels) > 1:
        emit(run_levels(args, levels), args.json, table_levels)
    elif args.policy == "exported":
        emit(run_exported(resolve_device(args.device), args.quick, args.module, levels[0]), args.json, table_exported)
    else:
        emit(run_act(args.device, args.quick, levels[0]) if args.policy == "act" else
             run(args.device, args.quick, levels[0]), args.json, table)
    return 0
