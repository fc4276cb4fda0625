"""`capsule-ros bench reenter`: time to the first action after re-entering a long prefix.

Two paths to the same state, timed from the same starting point in one run:
- cold: prefill the prefix (the runtime's fastest path: chunked scan, flash attention,
  compiled kernels and a CUDA graph per length on a GPU) then the first step;
- capsule: restore the capsule taken after that prefill, then the first step.
``identical`` compares the two first actions bit for bit.

Default: the paper-scale reference (config/reference_hybrid.yaml) at 2k..16k tokens.
``--quick``: a scaled-down float32 variant at 256..2048 tokens (under a minute on a CPU).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device, time_calls
from capsule_ros.capsules.store import CapsuleStore, CapsuleStoreConfig
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy

TARGETS = {2048: 5.0, 16384: 40.0}       # minimum speedups (the targets docs/benchmarks.md reports against)
QUICK = dict(d_model=256, layers="RRRARRRA", n_heads=4, n_kv_heads=2, head_dim=64, rec_heads=8, rec_head_dim=32,
             d_state=32, mlp_ratio=2.0, vocab_size=1024, dtype="float32", max_context=2048, scan_chunk=64)


def build(device: torch.device, quick: bool) -> PolicyRuntime:
    config = ServingConfig.from_file(config_path("reference_hybrid.yaml"))
    hybrid = dataclasses.replace(config.policy_settings, **QUICK) if quick else config.policy_settings
    runtime_cfg = dataclasses.replace(config.runtime, device=str(device))
    config = dataclasses.replace(config, policy_settings=hybrid, runtime=runtime_cfg)
    return build_policy_runtime(build_policy(config, device=device), runtime_cfg)


def run(device_name: str = "auto", quick: bool = False, prefixes: Sequence[int] = ()) -> dict:
    device = resolve_device(device_name)
    runtime = build(device, quick)
    policy: Any = runtime.policy                     # the reference hybrid (its cfg and kernels)
    params = sum(p.numel() for p in policy.parameters())
    prefixes = list(prefixes) or ([256, 512, 1024, 2048] if quick else [2048, 4096, 8192, 16384])
    store = CapsuleStore(runtime.layout.nbytes, runtime.fingerprint, device,
                         CapsuleStoreConfig(device_budget_mb=(len(prefixes) + 1) * runtime.layout.nbytes / 2**20
                                            + 1, host_budget_mb=0))
    reps = 3 if quick else 5
    rng = np.random.default_rng(0)
    obs = {name: rng.normal(size=view.shape).astype(view.dtype) for name, view in runtime.staging.items()}
    results = []
    for tokens_n in prefixes:
        tokens = torch.from_numpy(rng.integers(0, policy.cfg.vocab_size, size=tokens_n))

        def first_action():
            for name, value in obs.items():
                runtime.staging[name][...] = value
            runtime.load_inputs()
            runtime.step()

        # warm-up (captures the prefill graph for this length), then the capsule of the prefix
        runtime.reset(episode=0)
        runtime.prefill(tokens)
        capsule = store.snapshot(runtime, episode_id=0, step=0, label=f"prefix {tokens_n}")
        cold_samples, capsule_samples = [], []
        for _ in range(reps):
            runtime.reset(episode=0)
            def cold(t: torch.Tensor = tokens) -> None:
                runtime.prefill(t)
                first_action()

            def from_capsule(c: Any = capsule) -> None:
                store.restore(c.id, runtime)
                first_action()
            cold_samples.append(time_calls(cold, 1, device, warmup=0, stream=runtime.stream)[0])
            cold_action = runtime.read_outputs().action
            runtime.reset(episode=0)          # dirty the live state: the restore must bring it all back
            capsule_samples.append(time_calls(from_capsule, 1, device, warmup=0, stream=runtime.stream)[0])
            capsule_action = runtime.read_outputs().action
        identical = cold_action.tobytes() == capsule_action.tobytes()
        cold_ms, capsule_ms = pct(cold_samples, 1e3)["p50"], pct(capsule_samples, 1e3)["p50"]
        row = {"prefix_tokens": tokens_n, "cold_ms": cold_ms, "capsule_ms": capsule_ms,
               "speedup": cold_ms / capsule_ms, "identical": identical, "state_mib": runtime.layout.nbytes / 2**20}
        if not quick and tokens_n in TARGETS and device.type == "cuda":
            row.update(target_speedup=TARGETS[tokens_n], met=identical and row["speedup"] >= TARGETS[tokens_n])
        results.append(row)
        store.drop(capsule.id)
    return {"bench": "reenter", **environment(device), "quick": quick, "parameters": params,
            "dtype": policy.cfg.dtype, "layers": policy.cfg.layers, "compiled": policy.kernels.compiled,
            "graphs": runtime.graphs.captured, "results": results}


def table(result: dict) -> None:
    rows = [[r["prefix_tokens"], r["cold_ms"], r["capsule_ms"], f"{r['speedup']:.1f}x", r["identical"],
             {True: "met", False: "NOT met"}.get(r.get("met"), "-")] for r in result["results"]]
    print_table(f"time to first action after re-entering a prefix on {result['device']} "
                f"({result['parameters'] / 1e6:.0f} M params, {result['dtype']})",
                ["prefix tokens", "cold prefill ms", "capsule ms", "speedup", "identical", "target"], rows)


def main(args) -> int:
    emit(run(args.device, args.quick, args.prefixes or []), args.json, table)
    return 0
