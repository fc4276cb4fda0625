"""`capsule-ros bench regenerate`: what a model update costs, side by side in one run.

For each policy kind (the default policy, ACT from a LeRobot checkpoint with a camera and
a 100-action chunk, and the hybrid reference: ``config/reference_hybrid.yaml``, scaled down
and float32 on a CPU as ``bench reenter --quick`` is), a session runs one episode of
random inputs and commits a persisted capsule at its end: its recipe's bytes per step.
The weights are then perturbed in memory (a new fingerprint, the same architecture) and
``Regeneration`` rebuilds that capsule for them: steps per second, and the regeneration
time against the episode's own length at ``control.rate_hz`` (below 1: regenerating an
episode takes less time than living it).

Then, on the default policy: ``check`` over a directory of 1,000 capsules (headers only;
the deployment's load, its weights digest, is timed apart), and the control loop's tick
(every 2 ms, as ``bench commits`` ticks) with and without a background regeneration
(``capsules.regenerate_stale``'s ``BackgroundRegeneration``: a child process) running,
the phases alternating over three rounds (each with-phase lasts until the regeneration is
done): p50 / p99 / max and the ratio of the p99s.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from capsule_ros.benchmarks.common import config_path, emit, environment, paced_ticks, pct, print_table, resolve_device
from capsule_ros.benchmarks.lerobot_act import serving_config, write_act_checkpoint
from capsule_ros.benchmarks.reenter import QUICK as REFERENCE_QUICK
from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.store import Capsule
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy, build_session, port_bindings
from capsule_ros.serving.process import settle_after_start
from capsule_ros.updates.assessment import check
from capsule_ros.updates.background import BackgroundRegeneration
from capsule_ros.updates.deployment import Deployment, load_deployment
from capsule_ros.updates.regeneration import Regeneration, Status

ROUNDS = 3
TARGET_TICK_RATIO = 1.5           # p99 with a background regeneration / without


def _with(config: ServingConfig, device: torch.device, directory: Path, steps: int) -> ServingConfig:
    """``config`` on ``device``, its capsules in ``directory``, an input log that holds the episode."""
    return dataclasses.replace(
        config, runtime=dataclasses.replace(config.runtime, device=str(device)),
        control=dataclasses.replace(config.control, deadline_ms=0.0, service_timeout_ms=60000.0,
                                    input_log_steps=steps),
        capsules=dataclasses.replace(config.capsules, directory=str(directory), recipe_max_mb=4096.0))


def _policies(device: torch.device, quick: bool, tmp: Path) -> List[Tuple[str, ServingConfig, int]]:
    """(name, config, episode steps) of each policy kind."""
    default = ServingConfig.from_file(config_path("policy.yaml"))
    act = serving_config(write_act_checkpoint(tmp / "act", quick=quick))
    reference = ServingConfig.from_file(config_path("reference_hybrid.yaml"))
    if quick or device.type != "cuda":
        reference = dataclasses.replace(reference, policy_settings=dataclasses.replace(
            reference.policy_settings, **REFERENCE_QUICK))
    return [("default", default, 200 if quick else 2000), ("act", act, 200 if quick else 1000),
            ("reference", reference, 50 if quick else 500)]


def _feed(session, rng: np.random.Generator, steps: int) -> None:
    for _ in range(steps):
        for name, view in session.parts.runtime.staging.items():
            values = rng.integers(0, 256, size=view.shape) if view.dtype == np.uint8 else rng.normal(size=view.shape)
            session.loop.write_input(name, values.astype(view.dtype))
        session.loop.tick()


def _perturbed(config: ServingConfig, device: torch.device) -> Deployment:
    """The same architecture with every floating-point weight nudged: a new fingerprint."""
    policy = build_policy(config, device=device)
    noise = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for param in policy.parameters():
            if param.is_floating_point():
                param.add_(1e-3 * torch.randn(param.shape, generator=noise).to(param.device, param.dtype))
    return Deployment.of_policy(config, policy, port_bindings(config))


def _one_policy(name: str, config: ServingConfig, steps: int, device: torch.device, tmp: Path) -> Dict[str, Any]:
    """An episode, its capsule's recipe, and its regeneration for perturbed weights."""
    source = tmp / name / "src"
    config = _with(config, device, source, steps)
    session = build_session(config)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    _feed(session, rng, steps)
    episode_s = time.perf_counter() - start
    capsule = session.verbs.commit(f"{name} after {steps} steps", persist=True)
    info = CapsuleDirectory(source, max_file_bytes=1 << 40, read_only=True).header(capsule.id).recipe
    assert info is not None and info.regenerable, info
    arena = session.parts.runtime.layout.nbytes
    session.release()
    deployment = _perturbed(config, device)
    regeneration = Regeneration(CapsuleDirectory(source, max_file_bytes=1 << 40, read_only=True),
                                CapsuleDirectory(tmp / name / "dst", max_file_bytes=1 << 40), deployment)
    try:
        outcome = regeneration.run()[0]
    finally:
        deployment.close()
    assert outcome.status == Status.REGENERATED, outcome
    rate = config.control.rate_hz
    return {"policy": name, "steps": steps, "arena_bytes": arena, "recipe_bytes": info.nbytes,
            "recipe_rows": info.rows, "row_bytes": info.row_bytes, "recipe_bytes_per_step": info.nbytes / steps,
            "episode_live_s": episode_s, "regenerate_s": outcome.seconds,
            "regenerate_steps_per_s": steps / outcome.seconds, "rate_hz": rate,
            "regenerate_vs_episode_at_rate": outcome.seconds / (steps / rate), "drift": outcome.drift}


def _check_1000(config: ServingConfig, device: torch.device, tmp: Path, count: int) -> Dict[str, Any]:
    """``check`` over ``count`` capsule files (each the state and a 100-step recipe)."""
    config = _with(config, device, tmp / "one", 100)
    session = build_session(config)
    _feed(session, np.random.default_rng(1), 100)
    capsule = session.verbs.commit("one", persist=True)
    _, recipe = CapsuleDirectory(tmp / "one", max_file_bytes=1 << 40, read_only=True).recipe(capsule.id, 1 << 30)
    data = session.parts.runtime.arena.storage.detach().to("cpu", copy=True)
    parts = session.parts.runtime.fingerprint_parts
    schema = session.parts.runtime.layout.schema()
    session.release()
    many = CapsuleDirectory(tmp / "many", max_file_bytes=1 << 40)
    for k in range(count):
        copy = Capsule(f"e1.s{100}.{k:06x}", f"copy {k}", "", 1, 100, capsule.nbytes, capsule.fingerprint,
                       capsule.stamp_ns + k, numerics=capsule.numerics, mark=capsule.mark)
        many.save(copy, data, schema, recipe=recipe, parts=parts)
    start = time.perf_counter()
    deployment = _perturbed(config, device)
    load_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        report = check(CapsuleDirectory(tmp / "many", max_file_bytes=1 << 40, read_only=True), deployment, 1000.0)
        check_s = time.perf_counter() - start
    finally:
        deployment.close()
    assert report.invalidated == count and report.lost == 0, report
    return {"capsules": count, "deployment_load_s": load_s, "check_s": check_s, "per_capsule_ms": check_s / count * 1e3}


def _background(config: ServingConfig, device: torch.device, tmp: Path, seconds: float) -> Dict[str, Any]:
    """The control loop's tick with and without a background regeneration running."""
    stale = tmp / "stale"
    other_weights = dataclasses.replace(config, policy=dataclasses.replace(config.policy, weights="", init_seed=1))
    old = build_session(_with(other_weights, device, stale, 500))
    ids: List[str] = []
    for _ in range(8):                                     # 8 capsules of other weights, 60 to 480 steps
        _feed(old, np.random.default_rng(len(ids)), 60)
        ids.append(old.verbs.commit("stale", persist=True).id)
    old.release()
    live_dir = tmp / "live"
    live = _with(config, device, live_dir, 500)
    session = build_session(live)
    _feed(session, np.random.default_rng(2), 20)
    settle_after_start()
    rng = np.random.default_rng(3)
    samples: Dict[str, List[np.ndarray]] = {"without": [], "with": []}
    regenerated = 0
    for _ in range(ROUNDS):
        samples["without"].append(paced_ticks(session, seconds / ROUNDS, rng))
        for capsule_id in ids:                             # the stale files again (the last round replaced them)
            shutil.copy(stale / f"{capsule_id}.capsule", live_dir / f"{capsule_id}.capsule")
        assert session.parts.directory is not None
        background = BackgroundRegeneration(live, session.parts.directory, ids, session.parts.runtime.fingerprint,
                                            load_deployment)
        background.start()           # tick until it is done (at nice 19 it is slower on a busy machine)
        samples["with"].append(paced_ticks(session, 20 * seconds / ROUNDS, rng,
                                      until=lambda b=background: b.finished))   # type: ignore[misc]
        background.close()
        regenerated += background.progress()[0]
    session.release()
    phases = {}
    for name, parts in samples.items():
        ticks_all = np.concatenate(parts)
        phases[name] = {"ticks": len(ticks_all), **pct(ticks_all, 1e3), "max": float(ticks_all.max() * 1e3)}
    ratio = phases["with"]["p99"] / phases["without"]["p99"]
    return {"phases": phases, "regenerated": regenerated, "of": ROUNDS * len(ids),
            "with_vs_without_p99": ratio, "target": TARGET_TICK_RATIO, "met": bool(ratio <= TARGET_TICK_RATIO)}


def run(device_name: str = "auto", quick: bool = False) -> dict:
    device = resolve_device(device_name)
    with tempfile.TemporaryDirectory(prefix="capsule-bench-regenerate-") as name:
        tmp = Path(name)
        policies = [_one_policy(n, c, s, device, tmp) for n, c, s in _policies(device, quick, tmp)]
        default = ServingConfig.from_file(config_path("policy.yaml"))
        checked = _check_1000(default, device, tmp, 100 if quick else 1000)
        background = _background(default, device, tmp, 3.0 if quick else 15.0)
    return {"bench": "regenerate", **environment(device), "quick": quick, "policies": policies, "check": checked,
            "background": background}


def table(result: dict) -> None:
    rows = [[p["policy"], p["steps"], f"{p['arena_bytes']:,}", f"{p['recipe_bytes_per_step']:,.0f}",
             f"{p['recipe_rows']} x {p['row_bytes']:,}", f"{p['regenerate_steps_per_s']:,.0f}",
             f"{p['regenerate_vs_episode_at_rate']:.3f}", f"{p['drift']:.3g}"] for p in result["policies"]]
    print_table(f"regeneration on {result['device']} (episode -> perturbed weights -> regenerate)",
                ["policy", "steps", "arena B", "recipe B/step", "rows x bytes", "regen steps/s",
                 "regen / episode at rate", "drift"], rows)
    c = result["check"]
    print(f"check of {c['capsules']} capsules: {c['check_s'] * 1e3:.0f} ms ({c['per_capsule_ms']:.3f} ms each), "
          f"after loading the deployment in {c['deployment_load_s'] * 1e3:.0f} ms")
    b = result["background"]
    print_table("control loop tick with and without a background regeneration (ms)",
                ["phase", "ticks", "p50", "p99", "max"],
                [[k, v["ticks"], v["p50"], v["p99"], v["max"]] for k, v in b["phases"].items()])
    print(f"p99 with / without: {b['with_vs_without_p99']:.2f} (target <= {b['target']}: "
          f"{'met' if b['met'] else 'NOT met'}; {b['regenerated']} of {b['of']} capsules regenerated meanwhile)")


def main(args) -> int:
    emit(run(args.device, args.quick), args.json, table)
    return 0
