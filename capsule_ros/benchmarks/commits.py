"""`capsule-ros bench commits`: what commits cost the control loop, side by side in one run.

A control loop ticks the session every ``period`` (2 ms: faster than any robot's loop,
so every commit overlaps steps) with fresh inputs, in four phases: no commits, a
behaviour tree committing back to back in memory, and committing back to back with
``persist`` (each followed by a drop from memory and disk, so the store and the disk do
not fill), with the capsules' recipes (``capsules.recipe``, the default: the episode's
logged rows are copied under the boundary and written) and without. The episode runs on
through the phases, so a later commit's recipe is longer. The phases alternate over
five rounds and each phase's samples are pooled.
The figure is the tick's wall time as the control loop sees it (waiting at the boundary
included), its p50 / p99 / max, and the periods of a 50 Hz loop it would have missed.
Target: p99 with persisting commits within 1.5x of the p99 without commits.

On a CPU it runs the default policy; on a GPU the paper-scale reference state
(``config/reference_hybrid.yaml``, ~400 MiB per capsule) at the session level.
"""
from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from capsule_ros.benchmarks.common import config_path, emit, environment, paced_ticks, pct, print_table, resolve_device
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_session
from capsule_ros.serving.process import settle_after_start

TARGET_RATIO = 1.5
PERIOD_50HZ_S = 0.02
KINDS = ("none", "memory", "persist", "persist, no recipe")
ROUNDS = 5


def _config(device, directory: Path, quick: bool) -> ServingConfig:
    if device.type == "cuda" and not quick:
        config = ServingConfig.from_file(config_path("reference_hybrid.yaml"))
        capsules = dataclasses.replace(config.capsules, device_budget_mb=2048.0, host_budget_mb=0.0)
    else:
        config = ServingConfig.from_file(config_path("policy.yaml"))
        config = dataclasses.replace(config, policy=dataclasses.replace(config.policy, weights=""))
        capsules = config.capsules
    return dataclasses.replace(
        config, runtime=dataclasses.replace(config.runtime, device=str(device)),
        control=dataclasses.replace(config.control, deadline_ms=0.0, service_timeout_ms=60000.0),
        capsules=dataclasses.replace(capsules, directory=str(directory)))


def _phase(session, commits: str, seconds: float, period_s: float) -> dict:
    """Tick every ``period_s`` for ``seconds`` while ``commits`` (one of ``KINDS``) run back
    to back in another thread."""
    rng = np.random.default_rng(0)
    commit_s: list = []
    stop = threading.Event()
    persist = commits.startswith("persist")
    store = session.parts.store          # the recipe setting of this phase (read at each save)
    store.config = dataclasses.replace(store.config, recipe=commits != "persist, no recipe")

    def committer() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            capsule = session.verbs.commit("bench", persist=persist)
            commit_s.append(time.perf_counter() - start)
            session.verbs.drop(capsule.id, from_disk=persist)

    thread = threading.Thread(target=committer) if commits != "none" else None
    if thread is not None:
        thread.start()
    try:
        ticks = paced_ticks(session, seconds, rng, period_s)
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    return {"commits": commits, "samples": ticks, "commit_samples": commit_s}


def _pooled(parts) -> dict:
    """One phase's rounds together (rounds alternate the phases, so slow drifts of the
    machine fall on all of them alike)."""
    ticks = np.concatenate([p.pop("samples") for p in parts])
    commit_s = [x for p in parts for x in p.pop("commit_samples")]
    return {"commits": parts[0]["commits"], "ticks": len(ticks),
            "tick_ms": {**pct(ticks, 1e3), "max": float(ticks.max() * 1e3)},
            "missed_50hz_periods": int(np.sum(ticks > PERIOD_50HZ_S)), "commits_done": len(commit_s),
            "commit_ms_mean": float(np.mean(commit_s) * 1e3) if commit_s else None}


def run(device_name: str = "auto", quick: bool = False) -> dict:
    device = resolve_device(device_name)
    seconds = 3.0 if quick else (15.0 if device.type == "cuda" else 20.0)   # per phase, over the rounds
    with tempfile.TemporaryDirectory(prefix="capsule-bench-commits-") as tmp:
        session = build_session(_config(device, Path(tmp) / "capsules", quick))
        for _ in range(20):                       # warm: inputs staged, steps run
            for name, view in session.parts.runtime.staging.items():
                session.loop.write_input(name, np.zeros(view.shape, view.dtype))
            session.loop.tick()
        settle_after_start()                      # as policy_node does after start-up
        rounds = [[_phase(session, commits, seconds / ROUNDS, 0.002) for commits in KINDS] for _ in range(ROUNDS)]
        phases = [_pooled([r[i] for r in rounds]) for i in range(len(KINDS))]
        nbytes = session.parts.store.nbytes
    base = phases[0]["tick_ms"]["p99"]
    ratio = phases[2]["tick_ms"]["p99"] / base
    return {"bench": "commits", **environment(device), "quick": quick, "capsule_bytes": nbytes,
            "period_ms": 2.0, "seconds_per_phase": seconds, "rounds": ROUNDS, "phases": phases,
            "persist_vs_none_p99": ratio, "recipe_vs_no_recipe_p99": ratio * base / phases[3]["tick_ms"]["p99"],
            "target": TARGET_RATIO, "met": bool(ratio <= TARGET_RATIO)}


def table(result: dict) -> None:
    rows = [[p["commits"], p["ticks"], p["tick_ms"]["p50"], p["tick_ms"]["p99"], p["tick_ms"]["max"],
             p["missed_50hz_periods"], p["commits_done"],
             "-" if p["commit_ms_mean"] is None else f"{p['commit_ms_mean']:.1f}"] for p in result["phases"]]
    print_table(f"step latency during back-to-back commits on {result['device']}, "
                f"{result['capsule_bytes'] / 2**20:.1f} MiB capsules (ms)",
                ["commits", "ticks", "tick p50", "tick p99", "tick max", "missed 50 Hz", "commits", "commit mean"],
                rows)
    print(f"p99 with persisting commits / without: {result['persist_vs_none_p99']:.2f} "
          f"(target <= {result['target']}: {'met' if result['met'] else 'NOT met'}); with recipes / without: "
          f"{result['recipe_vs_no_recipe_p99']:.2f}")


def main(args) -> int:
    emit(run(args.device, args.quick), args.json, table)
    return 0
