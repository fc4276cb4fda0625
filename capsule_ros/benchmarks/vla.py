"""`capsule-ros bench vla`: a vision-language-action policy's chunk as capsule_ros's captured
programs against LeRobot 0.6.1's own eager policy, side by side in one run on one device.

Cases (``--cases``, default all nine): ``smolvla``, ``pi0`` and ``pi05`` with 1, 2 or 3
cameras (``smolvla-1cam`` ... ``pi05-3cam``). Sizes: the real architectures' dimensions,
seeded weights, in the dtype LeRobot gives them: SmolVLA with SmolVLM2-500M's text and
vision dimensions (``lerobot_smolvla.SPECS["real"]``, written by LeRobot's own code), π0 and
π0.5 with PaliGemma-3B's (``lerobot_pi.PALIGEMMA_3B``, bfloat16; written by capsule_ros,
loaded strictly by LeRobot); 480 x 640 rgb8 cameras, six joints, six actions, LeRobot's chunk
of 50 all executed, 10 denoising steps. ``--quick``: the parity fixtures' tiny sizes (a
CPU's CI, not the targets' figures).

Sides, over one episode each, the same checkpoint directory, observations (joint positions
as a random walk, panning textured cameras) and counter-based noise:

- ``lerobot``: LeRobot's ``predict_action`` loop (``tools/lerobot_bench/select_action_loop.py``
  with ``--device``): its observation conversion, preprocessor, ``select_action`` and
  postprocessor every step, eager, as its record and eval loops call it (one torch thread on
  a CPU, as capsule_ros's side; torch's default on a GPU, as a user's process). LeRobot's
  environment: ``--lerobot-python``, ``CAPSULE_ROS_LEROBOT_PYTHON``, the one
  ``tools/lerobot_bench/setup.sh`` makes, or this interpreter where LeRobot imports (the GPU
  machine: LeRobot travels there as wheels). Without it the side reports why;
- ``graph``: ``control.chunking: sync`` through a ``PolicySession``, back to back: on a GPU
  every program is a captured CUDA graph (the refill: prefix, unrolled denoise and the write
  into the chunk; the consume: one row out), on a CPU the same plan eagerly;
- ``sync_paced``: sync steps paced at 30 Hz over the async side's episode (``--async-steps``
  of them, or ``--steps`` when that is 0): what a consume step costs when the GPU and the
  host idled a period before it (``bench chunking``'s paced floor), the baseline of async's
  consume steps (``consume_ratio``);
- ``async``: ``control.chunking: async`` paced at 30 Hz over ``--async-steps`` (default 3000),
  the delay fixed at start from the refill's p99 (``inference_delay_steps: auto``), a
  deadline of one period, the refill on its own stream.

``--sides`` picks some of the five (default all; the others are reported as not chosen): a π
case's LeRobot side builds and loads a 3B model before its first step, minutes on a GPU
machine, and each paced side lasts ``--async-steps`` periods at 30 Hz (100 s at the default).
On a GPU LeRobot's loop runs twice: ``lerobot`` with torch's defaults (the timing baseline, as
a user runs it) and ``lerobot_deterministic`` under the settings capsule_ros's runtime makes
(``runtime.deterministic``: cuBLAS's fixed workspace, torch's deterministic algorithms), which
choose which GPU kernels run: the two show how far LeRobot's own bits move with the kernels a
GPU picks, beside how far capsule_ros's are from each. ``--float32-matmul high``: every side's
float32 matrix products on TensorFloat-32 (capsule_ros's ``runtime.float32_matmul: high``, and
LeRobot's process the same, as a user who turns it on there): other bits, compared alike.

Figures: ``chunk_p50_ms`` / ``chunk_p99_ms``: the steps that plan a chunk, after the
episode's first (a cold first call is reported alone as ``first_step_ms``; on the async side
the steps that take over a chunk planned in the background, not a chunk's time);
``consume_p50_ms`` / ``consume_p99_ms``: the other steps; ``gpu_peak_bytes``: the side's
peak allocation, weights included; ``state_bytes``: a capsule's state. Against the targets
(``TARGETS``): ``chunk_ratio`` (graph over LeRobot, p50), the consume step, async's misses
after the first step, ``consume_ratio`` / ``consume_p99_ratio`` (async's consume steps over
``sync_paced``'s; ``consume_ratio_back_to_back``: over the graph side's);
``actions_equal_<side>`` (the graph's actions against that LeRobot side, bit for bit),
``actions_max_abs_diff_<side>`` and the first step that differs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from capsule_ros.benchmarks import lerobot_pi, lerobot_smolvla
from capsule_ros.benchmarks.chunking import (
    DEFAULT_LEROBOT_PYTHON,
    consume_ratios,
    lerobot_side,
    observations,
    refused_or,
    session_side,
)
from capsule_ros.benchmarks.common import chosen, emit, environment, print_table, resolve_device
from capsule_ros.errors import ConfigError
from capsule_ros.runtime.numerics import FLOAT32_MATMUL_HIGHEST
from capsule_ros.serving.config import ServingConfig

KINDS = ("smolvla", "pi0", "pi05")
SIDES = ("lerobot", "lerobot_deterministic", "graph", "sync_paced", "async")
CAMERA = (480, 640)
ASYNC_RATE_HZ = 30.0
# the targets: per chunk, capsule_ros's graph over LeRobot's eager policy (p50); the consume
# step (p50); async's deadline misses after the first step
CHUNK_RATIO_TARGET: Dict[str, float] = {"smolvla": 1 / 8, "pi0": 1 / 3, "pi05": 1 / 3}
CONSUME_TARGET_MS = 0.1
ASYNC_MISSES_TARGET = 0
CONSUME_RATIO_TARGET = 1.2           # async's consume step over sync's, paced alike
TARGETS: Dict[str, Any] = {"chunk_ratio": CHUNK_RATIO_TARGET, "consume_ms": CONSUME_TARGET_MS,
                           "async_misses": ASYNC_MISSES_TARGET, "consume_ratio": CONSUME_RATIO_TARGET}


@dataclass(frozen=True)
class Case:
    kind: str          # smolvla | pi0 | pi05
    cameras: int       # 1 to 3

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.cameras}cam"


CASES = {c.name: c for c in (Case(kind, n) for kind in KINDS for n in (1, 2, 3))}


@dataclass(frozen=True)
class Written:
    """A case's checkpoint as both sides serve it."""

    checkpoint: Path
    config: ServingConfig
    ports_of: Dict[str, str]          # feature key -> port
    camera_keys: Tuple[str, ...]
    camera: Tuple[int, int]
    extra: Tuple[str, ...]            # LeRobot loop's arguments: the hub files and the task


def pi_spec(case: Case, quick: bool) -> lerobot_pi.PiSpec:
    base = lerobot_pi.BENCH["tiny"] if quick else replace(lerobot_pi.PALIGEMMA_3B, camera_shape=CAMERA, joints=6,
                                                          actions=6)
    return replace(base, kind=case.kind, cameras=case.cameras)


def write_case(case: Case, root: Path, quick: bool, device: torch.device, python: Optional[Path],
               weights_from: Optional[Path]) -> Written:
    """Write the case's checkpoint under ``root`` (``weights_from``: a π checkpoint of the same
    model whose weights are linked). ConfigError / RuntimeError: why it could not be written."""
    if case.kind == "smolvla":
        if python is None:
            raise ConfigError("the SmolVLA checkpoint is written by LeRobot, and there is no LeRobot environment "
                              "(run tools/lerobot_bench/setup.sh or pass --lerobot-python)")
        size = "tiny" if quick else "real"
        checkpoint = lerobot_smolvla.write_smolvla_checkpoint(root, size, python, case.cameras)
        keys = lerobot_smolvla.camera_keys(case.cameras)
        return Written(checkpoint, lerobot_smolvla.serving_config(checkpoint), lerobot_smolvla.ports_of(case.cameras),
                       keys, lerobot_smolvla.camera_of(size),
                       ("--vlm", str(root / "vlm"), "--task", lerobot_smolvla.TASK))
    spec = pi_spec(case, quick)
    checkpoint, tokenizer = lerobot_pi.write_pi_checkpoint(root, spec, device=device.type, weights_from=weights_from)
    ports = {lerobot_pi.STATE: "joints", **{key: lerobot_pi.port_of(key) for key in spec.camera_keys}}
    return Written(checkpoint, lerobot_pi.serving_config(checkpoint, tokenizer), ports, tuple(spec.camera_keys),
                   spec.camera_shape, ("--vlm", str(tokenizer), "--task", lerobot_pi.BENCH_TASK))


def at_float32_matmul(written: Written, float32_matmul: str) -> Written:
    """``written`` with its config's ``runtime.float32_matmul`` set (what ``--float32-matmul`` names)."""
    return replace(written, config=replace(written.config,
                                           runtime=replace(written.config.runtime, float32_matmul=float32_matmul)))


def lerobot_python(named: Optional[str]) -> Optional[Path]:
    """LeRobot's interpreter (see the module docstring), or None where there is none."""
    for candidate in (named, os.environ.get("CAPSULE_ROS_LEROBOT_PYTHON"), str(DEFAULT_LEROBOT_PYTHON)):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return Path(sys.executable) if importlib.util.find_spec("lerobot") is not None else None


def graph_side(written: Written, obs: Dict[str, np.ndarray], device: torch.device, chunking: str, rate: float,
               paced: bool) -> Dict[str, Any]:
    """A session side (``chunking.session_side``) with its peak GPU allocation."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    out = refused_or(lambda: session_side(written.config, written.ports_of, obs, device, chunking, rate, paced=paced))
    if out.get("ran", True):
        out["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0
    return out


def run_case(case: Case, written: Written, device: torch.device, steps: int, async_steps: int,
             python: Optional[Path], tmp: Path, chosen_sides: Sequence[str] = SIDES,
             float32_matmul: str = FLOAT32_MATMUL_HIGHEST) -> Dict[str, Any]:
    """The case's ``chosen_sides`` (the others are reported as not chosen), then its verdicts
    (``float32_matmul``: ``runtime.float32_matmul`` of the graph sides, and LeRobot's the same)."""
    written = at_float32_matmul(written, float32_matmul)
    joints = int(written.config.ports[written.ports_of[lerobot_pi.STATE]].shape[0])
    obs = observations(steps, written.camera, joints=joints, cameras=written.camera_keys)
    period = 1.0 / ASYNC_RATE_HZ
    level = written.config.runtime.numerics
    lerobot: Dict[str, Any] = {"ran": False, "reason": "no LeRobot environment (run tools/lerobot_bench/setup.sh, "
                                                       "pass --lerobot-python, or install LeRobot here)"}
    pinned: Dict[str, Any] = {"ran": False, "reason": "GPU only: on a CPU the lerobot side runs at the runtime's "
                                                      "numerics level already"}
    started = time.monotonic()

    def side(name: str, measure: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
        """A chosen side's figures, with progress on stderr (a run stopped by a time limit
        still says how far it got); a side not chosen is reported as such."""
        if name not in chosen_sides:
            return {"ran": False, "reason": "not chosen (--sides)"}
        out = measure()
        print(f"bench vla: {case.name} {name} side finished at {time.monotonic() - started:.0f} s", file=sys.stderr,
              flush=True)
        return out

    if python is not None:
        lerobot = side("lerobot", lambda: lerobot_side(python, written.checkpoint, obs, period, tmp, level,
                                                       written.extra, device=str(device),
                                                       float32_matmul=float32_matmul))
        if device.type == "cuda" and written.config.runtime.deterministic:
            pinned = side("lerobot_deterministic",
                          lambda: lerobot_side(python, written.checkpoint, obs, period, tmp, level, written.extra,
                                               device=str(device), deterministic=True,
                                               float32_matmul=float32_matmul))
    graph = side("graph", lambda: graph_side(written, obs, device, "sync", ASYNC_RATE_HZ, paced=False))
    # the two paced sides run the same episode, as long: a GPU's clocks after minutes of
    # paced steps are not those of the first seconds after a busy start
    paced_obs = observations(async_steps, written.camera, joints=joints, cameras=written.camera_keys) \
        if async_steps else obs
    paced = side("sync_paced", lambda: graph_side(written, paced_obs, device, "sync", ASYNC_RATE_HZ, paced=True))
    asynchronous: Dict[str, Any] = {"ran": False, "reason": "--async-steps 0"}
    if async_steps:
        asynchronous = side("async", lambda: graph_side(written, paced_obs, device, "async", ASYNC_RATE_HZ,
                                                        paced=True))
    sides: Dict[str, Dict[str, Any]] = {"lerobot": lerobot, "lerobot_deterministic": pinned, "graph": graph,
                                        "sync_paced": paced, "async": asynchronous}
    actions: Dict[str, Optional[np.ndarray]] = {side: values.pop("_actions", None) for side, values in sides.items()}
    result: Dict[str, Any] = {"case": case.name, "kind": case.kind, "cameras": case.cameras,
                              "camera": list(written.camera), "steps": steps, "async_steps": async_steps, **sides}
    result.update(verdicts(case, sides, actions))
    print(f"bench vla: case {case.name} done: " + json.dumps(headline(result)), file=sys.stderr, flush=True)
    return result


def verdicts(case: Case, sides: Dict[str, Dict[str, Any]], actions: Dict[str, Optional[np.ndarray]]) -> Dict[str, Any]:
    """The figures against ``TARGETS`` and the bits against LeRobot's, where the sides ran."""
    lerobot, graph, asynchronous = sides["lerobot"], sides["graph"], sides["async"]
    out: Dict[str, Any] = {}
    if graph.get("ran", True):
        consume = graph["consume_p50_ms"]
        out["consume_met"] = bool(consume is not None and consume <= CONSUME_TARGET_MS)
    if asynchronous.get("ran", True):
        out["async_misses_after_first"] = asynchronous["misses_steady"]
        out["async_met"] = asynchronous["misses_steady"] <= ASYNC_MISSES_TARGET
        out.update(consume_ratios({"async": asynchronous, "sync_paced": sides["sync_paced"], "sync": graph}))
        if "consume_ratio" in out:
            out["consume_ratio_met"] = out["consume_ratio"] <= CONSUME_RATIO_TARGET
    if lerobot.get("ran") and graph.get("ran", True):
        target = CHUNK_RATIO_TARGET[case.kind]
        if "chunk_p50_ms" in graph and "chunk_p50_ms" in lerobot:
            out["chunk_ratio"] = graph["chunk_p50_ms"] / lerobot["chunk_p50_ms"]
            out["chunk_p99_ratio"] = graph["chunk_p99_ms"] / lerobot["chunk_p99_ms"]
            out["chunk_target"] = target
            out["chunk_met"] = out["chunk_ratio"] <= target
        for name, (a, b) in {"lerobot": ("graph", "lerobot"),
                             "lerobot_deterministic": ("graph", "lerobot_deterministic"),
                             "lerobot_deterministic_vs_lerobot": ("lerobot_deterministic", "lerobot")}.items():
            out.update(compare_actions(actions.get(a), actions.get(b), name))
    return out


def compare_actions(mine: Optional[np.ndarray], theirs: Optional[np.ndarray], name: str) -> Dict[str, Any]:
    """``actions_equal_<name>`` (bit for bit), the largest difference and the first step
    that differs, where both sides ran."""
    if mine is None or theirs is None:
        return {}
    equal = bool(np.array_equal(mine.view(np.uint32), theirs.view(np.uint32)))
    return {f"actions_equal_{name}": equal, f"actions_max_abs_diff_{name}": float(np.abs(mine - theirs).max()),
            f"actions_first_unequal_step_{name}": None if equal else
            int(np.flatnonzero((mine != theirs).any(axis=1))[0])}


def headline(result: Dict[str, Any]) -> Dict[str, Any]:
    """A case's main figures (progress on stderr: a long run's finished cases are not lost)."""
    out: Dict[str, Any] = {k: v for k, v in result.items() if k.startswith("actions_")
                           or k in ("chunk_ratio", "consume_met", "async_misses_after_first", "consume_ratio",
                                    "consume_p99_ratio")}
    for side in SIDES:
        r = result[side]
        out[side] = ({k: r[k] for k in ("chunk_p50_ms", "chunk_p99_ms", "consume_p50_ms", "first_step_ms",
                                        "gpu_peak_bytes", "misses_steady") if k in r}
                     if r.get("ran", True) else r["reason"][:300])
    return out


def run(device_name: str = "auto", quick: bool = False, steps: Optional[int] = None,
        cases: Sequence[str] = tuple(CASES), named_python: Optional[str] = None,
        async_steps: Optional[int] = None, sides: Sequence[str] = SIDES,
        float32_matmul: str = FLOAT32_MATMUL_HIGHEST) -> dict:
    device = resolve_device(device_name)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"--cases {unknown}: not among {list(CASES)}")
    python = lerobot_python(named_python)
    steps = steps or (100 if quick else 1000)
    async_steps = (100 if quick else 3000) if async_steps is None else async_steps
    results: List[Dict[str, Any]] = []
    for kind in KINDS:
        chosen = [CASES[name] for name in cases if CASES[name].kind == kind]
        with tempfile.TemporaryDirectory() as tmp_name:          # one per kind: π's weights are written once
            weights_from: Optional[Path] = None
            for case in chosen:
                root = Path(tmp_name) / case.name
                try:
                    written = write_case(case, root, quick, device, python, weights_from)
                except (ConfigError, RuntimeError) as exc:
                    results.append({"case": case.name, "kind": case.kind, "cameras": case.cameras,
                                    **{side: {"ran": False, "reason": str(exc)} for side in SIDES}})
                    continue
                if case.kind != "smolvla":
                    weights_from = weights_from or written.checkpoint
                results.append(run_case(case, written, device, steps, async_steps, python, root, sides,
                                        float32_matmul))
    return {"bench": "vla", **environment(device), "quick": quick, "targets": TARGETS, "sides": list(sides),
            "float32_matmul": float32_matmul,
            "lerobot_python": str(python) if python else None, "cases": results}


def table(result: dict) -> None:
    rows = []
    for case in result["cases"]:
        for side in SIDES:
            r = case[side]
            if not r.get("ran", True):
                rows.append([case["case"], side, r["reason"][:60], "", "", "", "", ""])
                continue
            rows.append([case["case"], side, r.get("chunk_p50_ms", ""), r.get("chunk_p99_ms", ""),
                         r.get("consume_p50_ms", ""), r.get("first_step_ms", ""),
                         f"{r.get('gpu_peak_bytes', 0) / 2**30:.2f}", r.get("misses_steady", "")])
    print_table(f"bench vla ({result['device']})", ["case", "side", "chunk p50 ms", "chunk p99 ms", "consume p50 ms",
                                                   "first step ms", "GPU peak GiB", "misses after first"], rows)
    for case in result["cases"]:
        print(case["case"], {k: case[k] for k in ("chunk_ratio", "chunk_target", "chunk_met", "consume_met",
                                                  "async_met", "consume_ratio", "consume_ratio_met",
                                                  "actions_equal_lerobot",
                                                  "actions_equal_lerobot_deterministic") if k in case})


def main(args) -> int:
    cases = tuple(args.cases.split(",")) if getattr(args, "cases", None) else tuple(CASES)
    sides = chosen(getattr(args, "sides", None), SIDES, "sides", "vla")
    emit(run(args.device, args.quick, getattr(args, "steps", None), cases, getattr(args, "lerobot_python", None),
             getattr(args, "async_steps", None), sides, getattr(args, "float32_matmul", FLOAT32_MATMUL_HIGHEST)),
         args.json, table)
    return 0
