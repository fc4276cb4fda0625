"""`capsule-ros bench snapshot`: snapshot / restore time of the arena method against
per-buffer copies and torch.save / torch.load, and against the limit: one plain copy of
the same number of bytes, measured in the same run; and a restore from the store's HOST
tier (pinned host memory on a GPU), where a capsule goes when the device pool is full.

States: the default policy's (config/policy.yaml), and the reference hybrid's at 2k and
16k tokens of context (config/reference_hybrid.yaml), built from their buffer specs
(no weights needed) and filled with random bytes.
"""
from __future__ import annotations

import dataclasses
import io
from typing import Any, Dict, List, cast

import torch

from capsule_ros.benchmarks.common import (
    config_path,
    emit,
    environment,
    pct,
    print_table,
    random_arena,
    resolve_device,
    time_calls,
)
from capsule_ros.capsules.store import CapsuleStore, CapsuleStoreConfig, Tier
from capsule_ros.policies.hybrid import hybrid_state_spec
from capsule_ros.runtime.arena import ArenaLayout
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import input_specs

GPU_TARGET = (1.25, 15.0)   # snapshot / restore within 1.25 x limit_us + 15 us on the GPU
CPU_TARGET = 1.5            # the default policy's within 1.5 x limit_us on a CPU


def state_layouts() -> Dict[str, ArenaLayout]:
    default = ServingConfig.from_file(config_path("policy.yaml"))
    reference = ServingConfig.from_file(config_path("reference_hybrid.yaml"))
    hybrid: Any = reference.policy_settings                  # the configs' policy.kind is hybrid
    out = {"default": ArenaLayout(hybrid_state_spec(cast(Any, default.policy_settings), input_specs(default)))}
    for tokens in (2048, 16384):
        cfg = dataclasses.replace(hybrid, max_context=tokens)
        out[f"hybrid-{tokens // 1024}k"] = ArenaLayout(hybrid_state_spec(cfg, input_specs(reference)))
    return out


def bench_state(name: str, layout: ArenaLayout, device: torch.device, reps: int) -> dict:
    host = random_arena(layout, device)
    nbytes = layout.nbytes
    store = CapsuleStore(nbytes, host.fingerprint, device,
                         CapsuleStoreConfig(device_budget_mb=(2 * nbytes + 1) / 2**20,
                                            host_budget_mb=(nbytes + 1) / 2**20))
    capsule = store.snapshot(host, episode_id=0, step=0)
    store.drop(capsule.id)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def snapshot_once():
        c = store.snapshot(host, episode_id=0, step=0)
        sync()
        store.drop(c.id)

    keep = store.snapshot(host, episode_id=0, step=0)

    def restore_once():
        store.restore(keep.id, host)
        sync()

    wall_snap = time_calls(snapshot_once, reps, torch.device("cpu"))   # host: call until the copy is done
    wall_rest = time_calls(restore_once, reps, torch.device("cpu"))
    store.stats()                                                   # moves finished copy timings in
    copy_snap = store.snapshot_latency.samples()[-reps:]                   # the copy itself (events on GPU)
    copy_rest = store.restore_latency.samples()[-reps:]
    store.move(keep.id, Tier.HOST)                                  # the same capsule, from the host tier
    wall_host = time_calls(restore_once, reps, torch.device("cpu"))
    store.stats()
    copy_host = store.restore_latency.samples()[-reps:]

    views = host.arena.views
    copies = {n: torch.empty_like(v) for n, v in views.items()}

    def per_buffer_snapshot():
        for n, v in views.items():
            copies[n].copy_(v)

    def per_buffer_restore():
        for n, v in views.items():
            v.copy_(copies[n])

    # torch.save / torch.load: what a state kept as separate tensors would do (torch.save
    # refuses views of one storage with different dtypes, so it saves independent copies).
    separate = {n: v.clone() for n, v in views.items()}

    def torch_save_snapshot():
        buf = io.BytesIO()
        torch.save(separate, buf)
        return buf

    saved = torch_save_snapshot()

    def torch_load_restore():
        saved.seek(0)
        loaded = torch.load(saved, map_location=device, weights_only=True)
        for n, v in separate.items():
            v.copy_(loaded[n])

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    limit = time_calls(lambda: dst.copy_(src), reps, device)
    big_reps = max(3, reps // 10) if nbytes > 64 * 2**20 else reps
    methods = {
        "arena": {"snapshot": pct(copy_snap), "restore": pct(copy_rest),
                  "snapshot_wall": pct(wall_snap), "restore_wall": pct(wall_rest),
                  "restore_host_tier": pct(copy_host), "restore_host_tier_wall": pct(wall_host)},
        "per_buffer": {"snapshot": pct(time_calls(per_buffer_snapshot, reps, device)),
                       "restore": pct(time_calls(per_buffer_restore, reps, device))},
        "torch_save": {"snapshot": pct(time_calls(torch_save_snapshot, big_reps, device)),
                       "restore": pct(time_calls(torch_load_restore, big_reps, device))},
    }
    limit_us = pct(limit)["p50"]
    snapshot_us, restore_us = methods["arena"]["snapshot"]["p50"], methods["arena"]["restore"]["p50"]
    result: Dict[str, Any] = {"state": name, "bytes": nbytes, "mib": nbytes / 2**20, "buffers": len(layout),
              "snapshot_us": snapshot_us, "restore_us": restore_us, "limit_us": limit_us,
              "ratio_to_limit": max(snapshot_us, restore_us) / limit_us, "methods": methods}
    if device.type == "cuda":
        target = GPU_TARGET[0] * limit_us + GPU_TARGET[1]
        result.update(target_us=target, met=max(snapshot_us, restore_us) <= target,
                      target="1.25 x limit_us + 15 us")
    elif name == "default":
        result.update(target_us=CPU_TARGET * limit_us, met=result["ratio_to_limit"] <= CPU_TARGET,
                      target="1.5 x limit_us")
    return result


def run(device_name: str = "auto", quick: bool = False) -> dict:
    device = resolve_device(device_name)
    torch.manual_seed(0)
    states: List[dict] = []
    for name, layout in state_layouts().items():
        # many repetitions where a copy takes microseconds (timer noise), few where it takes 100 ms
        if layout.nbytes < 2**24:
            reps = 2000
        else:
            reps = 20 if quick or device.type == "cpu" else 200
        states.append(bench_state(name, layout, device, reps))
    return {"bench": "snapshot", **environment(device), "quick": quick, "states": states}


def table(result: dict) -> None:
    rows = []
    for s in result["states"]:
        m = s["methods"]
        rows.append([s["state"], f"{s['mib']:.2f}", s["buffers"], s["snapshot_us"], s["restore_us"],
                     m["arena"]["restore_host_tier"]["p50"], m["per_buffer"]["snapshot"]["p50"],
                     m["torch_save"]["snapshot"]["p50"],
                     m["torch_save"]["restore"]["p50"], s["limit_us"], f"{s['ratio_to_limit']:.2f}",
                     {True: "met", False: "NOT met"}.get(s.get("met"), "-")])
    print_table(f"snapshot / restore on {result['device']} (p50, us)",
                ["state", "MiB", "buffers", "arena snap", "arena restore", "host-tier restore", "per-buffer snap",
                 "torch.save",
                 "torch.load", "limit", "ratio", "target"], rows)


def main(args) -> int:
    emit(run(args.device, args.quick), args.json, table)
    return 0
