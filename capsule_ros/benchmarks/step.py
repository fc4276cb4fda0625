"""`capsule-ros bench step`: control-step latency of the default and the reference policy,
CUDA-graph replay against the same plan run eagerly, side by side in one run.

Two figures per variant: ``gpu`` (the step alone, CUDA events; on a CPU the same as
``loop``) and ``loop`` (what the node pays per step: write the staged inputs, step, read
the action back; host clock). ``unguarded`` is the same plan without the step guard
(``runtime.guard_steps``: one on-device copy of the state before each step, so a failed
or non-finite step can be undone): the difference is the guard's cost.

``--policy exported`` times an exported program instead: the module ``--module`` names
(default: the example package's GRU) is exported with ``capsule-ros export``'s code and
served by the runtime (graph-captured on a GPU, its plan run eagerly for reference),
against the module itself called eagerly with its state threaded through static tensors,
which is how it would run without capsule_ros. ``speedup`` is the eager module's step over
the served program's (both without the step guard, so both do the same work).
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import torch

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device, time_calls
from capsule_ros.benchmarks.reenter import QUICK
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy


def measure(config: ServingConfig, device: torch.device, graphs: bool, reps: int, guard: bool = True) -> dict:
    runtime_cfg = dataclasses.replace(config.runtime, device=str(device), cuda_graphs=graphs, guard_steps=guard)
    runtime = PolicyRuntime(build_policy(dataclasses.replace(config, runtime=runtime_cfg), device=device),
                            runtime_cfg)
    return {**measure_runtime(runtime, device, reps), "compiled": runtime.policy.kernels.compiled}


def measure_runtime(runtime: PolicyRuntime, device: torch.device, reps: int) -> dict:
    """The step alone and the node's loop (stage inputs, step, read back) of a runtime, on random inputs."""
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
            "parameters": sum(p.numel() for p in runtime.policy.parameters())}


def run_exported(device: torch.device, quick: bool, module_spec: str) -> dict:
    """The exported program served (graph and eager plan) against its module run eagerly."""
    from capsule_ros.policies.export import export_module, load_factory
    from capsule_ros.policies.exported import ExportedPolicy
    reps = 50 if quick else 300
    module = load_factory(module_spec)()
    with tempfile.TemporaryDirectory() as tmp:
        report = export_module(module, Path(tmp) / "program.pt2", source={"module": module_spec})
        served = {}
        for graphs in ((True, False) if device.type == "cuda" else (False,)):
            config = RuntimeConfig(device=str(device), cuda_graphs=graphs, guard_steps=False)
            runtime = PolicyRuntime(ExportedPolicy.from_file(report.path), config)
            served["graph" if graphs else "eager"] = measure_runtime(runtime, device, reps)
    interface = report.interface
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn((1, *s.shape), generator=generator).to(s.dtype).to(device) if s.dtype.is_floating_point
              else torch.zeros((1, *s.shape), dtype=s.dtype, device=device) for s in interface.inputs]
    initial = module.initial_state()
    state = [initial[s.name][None].to(device) for s in interface.state]
    module = module.to(device).eval()

    def eager_step():
        with torch.inference_mode():
            _, _, *new_state = module(*inputs, *state)
            for static, value in zip(state, new_state, strict=True):
                static.copy_(value)
    eager = {"gpu_ms": pct(time_calls(eager_step, reps, device, warmup=5), 1e3),
             "parameters": sum(p.numel() for p in module.parameters())}
    best = served.get("graph") or served["eager"]
    return {"bench": "step", "policy": "exported", "module": module_spec, **environment(device), "quick": quick,
            "program": {"sha256": report.sha256, "bytes": report.nbytes, "interface": interface.describe(),
                        "equals_module_bit_for_bit": report.mismatch is None},
            "eager_module": eager, "exported_graph": served.get("graph"), "exported_eager": served["eager"],
            "speedup": eager["gpu_ms"]["p50"] / best["gpu_ms"]["p50"]}


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


def table_exported(result: dict) -> None:
    rows = [[label, result[key]["gpu_ms"]["p50"], result[key]["gpu_ms"]["p99"]]
            for label, key in (("eager module", "eager_module"), ("exported, CUDA graph", "exported_graph"),
                               ("exported, eager plan", "exported_eager")) if result.get(key)]
    print_table(f"{result['module']} step on {result['device']} (ms): the served program is "
                f"{result['speedup']:.2f}x the eager module", ["variant", "step p50", "step p99"], rows)


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
    if args.policy == "exported":
        emit(run_exported(resolve_device(args.device), args.quick, args.module), args.json, table_exported)
    else:
        emit(run(args.device, args.quick), args.json, table)
    return 0
