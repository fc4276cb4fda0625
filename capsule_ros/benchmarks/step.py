"""`capsule-ros bench step`: control-step latency of the default and the reference policy,
CUDA-graph replay against the same plan run eagerly, side by side in one run.

Two figures per variant: ``gpu`` (the step alone, CUDA events; on a CPU the same as
``loop``) and ``loop`` (what the node pays per step: write the staged inputs, step, read
the action back; host clock). ``unguarded`` is the same plan without the step guard
(``runtime.guard_steps``: one on-device copy of the state before each step, so a failed
or non-finite step can be undone): the difference is the guard's cost.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device, time_calls
from capsule_ros.benchmarks.reenter import QUICK
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy


def measure(config: ServingConfig, device: torch.device, graphs: bool, reps: int, guard: bool = True) -> dict:
    runtime_cfg = dataclasses.replace(config.runtime, device=str(device), cuda_graphs=graphs, guard_steps=guard)
    runtime = PolicyRuntime(build_policy(dataclasses.replace(config, runtime=runtime_cfg), device=device),
                            runtime_cfg)
    rng = np.random.default_rng(0)
    for view in runtime.staging.values():
        view[...] = rng.normal(size=view.shape).astype(view.dtype)
    runtime.load_inputs()
    gpu = time_calls(runtime.step, reps, device, warmup=5, stream=runtime.stream)

    def loop_step():
        runtime.load_inputs()
        runtime.step()
        runtime.read_outputs()
    loop = time_calls(loop_step, reps, torch.device("cpu"), warmup=5)
    return {"gpu_ms": pct(gpu, 1e3), "loop_ms": pct(loop, 1e3), "graph_captured": runtime.plan.captured,
            "compiled": runtime.policy.kernels.compiled,
            "parameters": sum(p.numel() for p in runtime.policy.parameters())}


def run(device_name: str = "auto", quick: bool = False) -> dict:
    device = resolve_device(device_name)
    default = ServingConfig.from_file(config_path("policy.yaml"))
    default = dataclasses.replace(default, policy=dataclasses.replace(default.policy, weights=""))
    reference = ServingConfig.from_file(config_path("reference_hybrid.yaml"))
    if quick or device.type == "cpu":
        # the 0.75 B bf16 reference is GPU-sized: on a CPU (or --quick) use its scaled-down variant
        quick_shape = dataclasses.replace(reference.policy_settings, **QUICK)
        reference = dataclasses.replace(reference, policy_settings=quick_shape)
    reps = 50 if quick else 300
    policies = []
    scaled = reference.policy_settings.d_model == QUICK["d_model"]
    for name, config in (("default", default), ("reference" + ("-quick" if scaled else ""), reference)):
        row = {"policy": name, "eager": measure(config, device, False, reps)}
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
    return {"bench": "step", **environment(device), "quick": quick, "policies": policies}


def table(result: dict) -> None:
    rows = []
    for p in result["policies"]:
        for variant in ("graph", "eager", "unguarded"):
            m = p.get(variant)
            if m is None:
                continue
            rows.append([p["policy"], variant, f"{m['parameters'] / 1e6:.2f} M", m["gpu_ms"]["p50"],
                         m["gpu_ms"]["p99"], m["loop_ms"]["p50"], m["loop_ms"]["p99"]])
    print_table(f"step latency on {result['device']} (ms)",
                ["policy", "plan", "params", "step p50", "step p99", "loop p50", "loop p99"], rows)


def main(args) -> int:
    emit(run(args.device, args.quick), args.json, table)
    return 0
