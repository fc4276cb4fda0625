"""`capsule-ros bench chunking`: a chunking policy's step through capsule_ros (sync and async
chunking) against LeRobot's own loop, side by side in one run.

Cases (``--cases``): ``act100`` (ACT, chunk 100, 100 action steps, 30 Hz), ``act10`` (ACT,
chunk 100, 10 action steps, 30 Hz), ``diffusion`` (Diffusion Policy, 8 action steps, 10 Hz,
10 DDPM steps, the U-Net of DiffusionConfig's defaults), ``diffusion-small`` (the same with a
U-Net of (128, 256, 512) channels, about a tenth of the default's work: on a 2-core CPU the
default U-Net's refill takes longer than a chunk's rows last at 10 Hz, so no delay can hide
it, which the ``diffusion`` case reports); ``benchmarks/lerobot_act.py`` and ``lerobot_diffusion.py`` write the
checkpoints (LeRobot's default architectures, one camera: 240 x 320 on a CPU, ALOHA's
480 x 640 on a GPU; ``--quick``: small networks and a 96 x 128 camera). The VLA cases
``smolvla-tiny`` (30 Hz) and ``smolvla-mid`` (10 Hz) (SmolVLA, chunk 50 all executed, two cameras and a
task; ``benchmarks/lerobot_smolvla.py``) serve a checkpoint LeRobot itself writes, so they need
LeRobot's environment for every side (``--quick`` runs the tiny one only); ``pi0-tiny``,
``pi05-tiny`` and ``pi0-mid`` (π0 / π0.5, the same schedule and inputs;
``benchmarks/lerobot_pi.py`` writes the checkpoint, LeRobot loads it through
``tools/lerobot_fixtures/pi_scaled.load_pi``; ``--quick`` skips the mid one). Every side gets the
same checkpoint and the same seeded observations (joint positions as a random walk, a
panning textured camera), one torch thread each and the same CPU numerics level
(``runtime.numerics``) on a CPU.

Sides, each over ``--steps`` steps (default 3000) of one episode:

- ``lerobot``: LeRobot's ``predict_action`` loop (its record / eval loop's call), run by
  ``tools/lerobot_bench/select_action_loop.py`` in LeRobot's own environment
  (``tools/lerobot_bench/setup.sh``; ``--lerobot-python`` or ``CAPSULE_ROS_LEROBOT_PYTHON``
  names another). Without it that side is reported as not run, with the reason;
- ``sync``: ``control.chunking: sync`` through a ``PolicySession`` (what the node runs per
  control period: stage the inputs, tick = inputs in, step, outputs out and checked),
  back to back as LeRobot's loop runs;
- ``sync_paced``: ``sync`` again, paced as ``async`` is: the baseline of the consume
  ratio. A paced step starts after the machine sat idle for most of a period, and that
  costs by itself (a GPU's clocks and the host's caches are cold: ``gpu_wake_floor``), so
  only a paced sync step is a like-for-like baseline for a paced async one;
- ``async``: ``control.chunking: async`` with ``inference_delay_steps: auto`` (fixed at
  start from the refill's p99), paced at the case's rate with a deadline of one period,
  the refill worker on its own thread (CPU) or stream (GPU).

Pacing (``Pacer``): each step starts at the next period boundary not yet passed, as a
ROS timer fires; a step that overruns skips the boundaries it missed instead of letting
the next steps run back to back.

Figures per side: mean / p50 / p99 / max step (ms), deadline misses per 1000 steps
(a step longer than the period; async: the session's own count, and its late refills),
and the action jump at chunk seams: the largest |Δ action| between a step that starts a
new chunk and the step before, against the largest within a chunk. The episode's first
step plans the first chunk synchronously in every mode (nothing to overlap with): it is
counted in the figures and also reported alone (``first_step_ms``); ``misses_steady``
counts the misses after it. Ratios: sync mean and p99 over LeRobot's, async p99 over
LeRobot's; ``consume_ratio`` / ``consume_p99_ratio``: async's consume steps (p50 / p99)
over ``sync_paced``'s, the same programs under the same pacing (``consume_ratio_back_to_back``:
over the back-to-back ``sync`` side's, which no paced step can reach).
``actions_equal_lerobot``: sync's actions against LeRobot's, bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from capsule_ros.benchmarks import lerobot_pi, lerobot_smolvla
from capsule_ros.benchmarks.common import child_pythonpath, emit, environment, print_table, resolve_device
from capsule_ros.benchmarks.lerobot_act import CAMERA, PORTS, STATE, serving_config, write_act_checkpoint
from capsule_ros.benchmarks.lerobot_diffusion import write_diffusion_checkpoint
from capsule_ros.chunking.mode import TAKEOVERS, ChunkingMode, ChunkProgram
from capsule_ros.errors import ConfigError
from capsule_ros.runtime.numerics import FLOAT32_MATMUL_HIGHEST
from capsule_ros.serving.config import ServingConfig

REPO = Path(__file__).resolve().parents[2]
LEROBOT_SCRIPT = REPO / "tools" / "lerobot_bench" / "select_action_loop.py"
DEFAULT_LEROBOT_PYTHON = REPO / "tools" / "lerobot_bench" / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class Case:
    name: str
    kind: str                     # act | diffusion | smolvla | pi0 | pi05
    rate_hz: float
    chunk_size: int = 100         # ACT
    n_action_steps: int = 100
    down_dims: Optional[Sequence[int]] = None     # Diffusion: the U-Net's channels (None: DiffusionConfig's)
    size: str = ""                # SmolVLA: lerobot_smolvla.SPECS; π0: lerobot_pi.BENCH

    def write(self, directory: Path, camera, quick: bool, python: Optional[Path] = None) -> Path:
        if self.kind in ("pi0", "pi05"):             # capsule_ros writes it; LeRobot loads it scaled
            return lerobot_pi.write_pi_checkpoint(directory.parent, lerobot_pi.bench_spec(self.kind, self.size))[0]
        if self.kind == "smolvla":
            if python is None or not python.exists():
                raise ConfigError(f"the SmolVLA checkpoint is written by LeRobot, and there is no LeRobot environment "
                                  f"at {python} (run tools/lerobot_bench/setup.sh or pass --lerobot-python)")
            return lerobot_smolvla.write_smolvla_checkpoint(directory.parent, self.size, python)
        if self.kind == "act":
            features = {"chunk_size": self.chunk_size, "n_action_steps": self.n_action_steps,
                        "input_features": {STATE: {"type": "STATE", "shape": [14]},
                                           CAMERA: {"type": "VISUAL", "shape": [3, *camera]}}}
            return write_act_checkpoint(directory, quick=quick, features=features)
        overrides: Dict[str, Any] = {"down_dims": list(self.down_dims)} if self.down_dims and not quick else {}
        return write_diffusion_checkpoint(directory, camera, quick=quick, n_action_steps=self.n_action_steps,
                                          **overrides)


CASES = {c.name: c for c in (Case("act100", "act", 30.0, 100, 100), Case("act10", "act", 30.0, 100, 10),
                             Case("diffusion", "diffusion", 10.0, n_action_steps=8),
                             Case("diffusion-small", "diffusion", 10.0, n_action_steps=8, down_dims=(128, 256, 512)),
                             Case("smolvla-tiny", "smolvla", 30.0, 50, 50, size="tiny"),
                             Case("smolvla-mid", "smolvla", 10.0, 50, 50, size="mid"),
                             Case("pi0-tiny", "pi0", 30.0, 50, 50, size="tiny"),
                             Case("pi05-tiny", "pi05", 30.0, 50, 50, size="tiny"),
                             Case("pi0-mid", "pi0", 30.0, 50, 50, size="mid"))}
QUICK_SKIPS = ("smolvla-mid", "pi0-mid")     # --quick: minutes per chunk side on a CPU, not seconds


SIDES = ("lerobot", "sync", "sync_paced", "async")
FRAMES = 64    # distinct camera frames, cycled (3000 frames of 480 x 640 would take 2.7 GB)


def observations(steps: int, camera, seed: int = 0, joints: int = 14,
                 cameras: Sequence[str] = (CAMERA,)) -> Dict[str, np.ndarray]:
    """Joint positions [steps, joints] (a smooth random walk) and, per camera, ``FRAMES``
    frames [FRAMES, H, W, 3] (a random texture panned a pixel per frame; fewer for fewer
    steps); step t sees frame t % FRAMES (``at``)."""
    rng = np.random.default_rng(seed)
    out = {STATE: np.cumsum(rng.normal(0, 0.02, (steps, joints)), axis=0).astype(np.float32)}
    height, width = camera
    frames = min(FRAMES, steps)            # never more frames than steps: LeRobot's loop runs the longest array
    for key in cameras:
        scene = rng.integers(0, 256, (height, width + frames, 3), dtype=np.uint8)
        out[key] = np.stack([scene[:, t:t + width] for t in range(frames)])
    return out


def at(values: np.ndarray, t: int) -> np.ndarray:
    """The observation of step t (camera frames cycle)."""
    return values[t % len(values)]


def summary(seconds: Union[Sequence[float], np.ndarray], period: float, actions: np.ndarray,
            seams: Sequence[int]) -> Dict[str, Any]:
    ms = np.asarray(seconds) * 1e3
    jumps = np.abs(np.diff(actions, axis=0)).max(axis=1)              # |Δ action| from step t-1 to t, t >= 1
    at_seam = np.zeros(len(jumps), bool)
    at_seam[[s - 1 for s in seams if s >= 1]] = True
    misses = ms > period * 1e3
    planned = ms[[s for s in seams if s >= 1]]                          # the chunks after the first
    consume = np.delete(ms, list(seams))                                # the steps that plan nothing
    chunks = {"chunk_p50_ms": float(np.percentile(planned, 50)), "chunk_p99_ms": float(np.percentile(planned, 99)),
              "chunks_timed": len(planned)} if len(planned) else {"chunks_timed": 0}
    return {**chunks, "steps": len(ms), "mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()), "first_step_ms": float(ms[0]),
            "misses_per_1000": float(misses.sum() * 1000 / len(ms)), "misses_steady": int(misses[1:].sum()),
            "seam_jump": float(jumps[at_seam].max()) if at_seam.any() else 0.0,
            "within_chunk_jump": float(jumps[~at_seam].max()) if (~at_seam).any() else 0.0, "seams": len(seams),
            "consume_mean_ms": float(consume.mean()) if len(consume) else None,
            "consume_p50_ms": float(np.percentile(consume, 50)) if len(consume) else None,
            "consume_p99_ms": float(np.percentile(consume, 99)) if len(consume) else None}


def lerobot_side(python: Optional[Path], checkpoint: Path, obs: Dict[str, np.ndarray], period: float,
                 tmp: Path, level: str, extra: Sequence[str] = (), device: str = "cpu",
                 deterministic: bool = False, float32_matmul: str = FLOAT32_MATMUL_HIGHEST) -> Dict[str, Any]:
    """LeRobot's loop in its own environment, or why it did not run (``extra``: more
    arguments of the loop's script, a SmolVLA's VLM files and task; ``deterministic``:
    under the determinism settings capsule_ros's runtime sets, cuBLAS's fixed workspace
    and torch's deterministic algorithms, which choose a GPU's kernels; ``float32_matmul``:
    ``high`` turns TensorFloat-32 on for its float32 products, as ``runtime.float32_matmul``)."""
    if python is None or not python.exists():
        return {"ran": False, "reason": f"no LeRobot environment at {python} (run tools/lerobot_bench/setup.sh or "
                                        "pass --lerobot-python)"}
    inputs, out = tmp / "observations.npz", tmp / f"lerobot{'-deterministic' if deterministic else ''}.npz"
    arrays: Dict[str, Any] = {"seed": np.asarray(0), **obs}
    np.savez(inputs, **arrays)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(python), "CAPSULE_ROS_NUMERICS": level}
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:                  # one thread each side; on a GPU the host keeps torch's default, as a user's does
        env["OMP_NUM_THREADS"] = "1"
    if deterministic:
        env.update(CAPSULE_ROS_DETERMINISTIC="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    env["CAPSULE_ROS_FLOAT32_MATMUL"] = float32_matmul
    done = subprocess.run([str(python), str(LEROBOT_SCRIPT), "--checkpoint", str(checkpoint), "--observations",
                           str(inputs), "--out", str(out), "--device", device, "--threads", "1" if on_cpu else "0",
                           *extra], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"ran": False, "reason": f"the LeRobot loop failed: {done.stderr.strip()[-600:]}"}
    with np.load(out, allow_pickle=False) as data:
        seconds, actions = data["seconds"], data["action"]
        versions = {"lerobot": str(data["lerobot"]), "torch": str(data["torch"]), "numerics": str(data["numerics"]),
                    "gpu_peak_bytes": int(data["gpu_peak_bytes"]),
                    "phase_seconds": dict(zip(("imports", "load", "episode"), map(float, data["phase_seconds"]),
                                              strict=True))}
    refills = _lerobot_refills(checkpoint, len(seconds))
    return {"ran": True, **versions, **summary(seconds, period, actions, refills), "_actions": actions}


def _lerobot_refills(checkpoint: Path, steps: int) -> List[int]:
    n = json.loads((checkpoint / "config.json").read_text())["n_action_steps"]
    return list(range(0, steps, n))


class Pacer:
    """Control periods of ``period`` seconds: ``wait`` sleeps until the next period boundary
    not yet passed (a step that overran skips the boundaries it missed, as a ROS timer
    does, so no step runs back to back after it); with ``paced`` False it never sleeps."""

    def __init__(self, period: float, paced: bool = True):
        self.period, self.paced = period, paced
        self.next_at = time.perf_counter()

    def wait(self) -> None:
        if not self.paced:
            return
        now = time.perf_counter()
        self.next_at += self.period
        if self.next_at <= now:
            self.next_at += (int((now - self.next_at) / self.period) + 1) * self.period
        time.sleep(max(0.0, self.next_at - time.perf_counter()))


def side_session(base: ServingConfig, device: torch.device, chunking: str, rate: float, paced: bool, steps: int):
    """A ``PolicySession`` serving ``base`` as a side runs it: a timer at ``rate``, the
    episode's inputs logged as a node logs them, one CPU thread, seed 0, deadlines
    enforced when ``paced``."""
    from capsule_ros.serving.factory import build_session
    from capsule_ros.serving.options import SessionOptions
    control = dataclasses.replace(base.control, mode="timer", rate_hz=rate, deadline_ms=0.0, chunking=chunking,
                                  inference_delay_steps="auto", autostart=True,
                                  input_log_steps=steps,                 # the episode's inputs, as a node logs them
                                  input_log_max_mb=1e7)                  # (rows are touched only when logged)
    runtime = dataclasses.replace(base.runtime, device=str(device), cpu_threads=1, seed=0)
    session = build_session(dataclasses.replace(base, control=control, runtime=runtime),
                            options=SessionOptions(enforce_deadline=paced))
    assert isinstance(session.parts.runtime.mode, ChunkingMode), "a chunking policy"
    return session


def session_side(base: ServingConfig, ports_of: Dict[str, str], obs: Dict[str, np.ndarray], device: torch.device,
                 chunking: str, rate: float, paced: bool, wake_floor: bool = False) -> Dict[str, Any]:
    """The steps through a session serving ``base`` (see the module docstring); ``ports_of``:
    feature key -> the port that feeds it; ``wake_floor``: measure ``gpu_wake_floor`` after
    them (a paced side on a GPU)."""
    steps = len(obs[STATE])
    session = side_session(base, device, chunking, rate, paced, steps)
    mode = session.parts.runtime.mode
    schedule = mode.schedule
    start_refills = mode.counters.refills           # start-up (checks, rehearsal) planned some already
    period = 1.0 / rate
    seconds, actions, seams = np.zeros(steps), [], []
    ports = {ports_of[key]: value for key, value in obs.items()}
    pacer = Pacer(period, paced)
    for t in range(steps):
        for port, value in ports.items():
            session.loop.write_input(port, at(value, t))
        start = time.perf_counter()
        record = session.loop.tick()
        seconds[t] = time.perf_counter() - start
        assert record is not None
        actions.append(record.values)
        if mode.last.program in TAKEOVERS:
            seams.append(t)
        pacer.wait()
    counters, chunk = session.parts.loop.counters, mode.counters
    out = summary(seconds, period, np.stack(actions), seams)
    if wake_floor and paced and device.type == "cuda":
        out["gpu_wake_floor"] = gpu_wake_floor(session.parts.runtime, period)
    out.update(refills=chunk.refills - start_refills, late_refills=counters.late_refills,
               state_bytes=session.parts.runtime.layout.nbytes,
               session_deadline_misses=counters.deadline_misses if paced else None,
               schedule=schedule.describe(), delay=schedule.delay,
               refill_p99_ms=float(np.percentile(mode.setup.refill_seconds, 99) * 1e3)
               if mode.setup.refill_seconds else None, graphs=session.parts.runtime.graphs.captured,
               _actions=np.stack(actions))
    session.release()
    return out


def gpu_wake_floor(runtime, period: float, runs: int = 100) -> Dict[str, Any]:
    """What any step that touches the GPU pays at this rate, whatever the host does: the
    consume program's graph replayed and waited for, each time after the GPU sat idle for
    one control period (its clocks drop while idle), against back to back; ``by_idle_ms``:
    the p50 after other idle times. Run after the measured steps (it moves the cursor; the
    session is released next)."""
    def replays(idle_s: float) -> np.ndarray:
        ms = []
        for _ in range(runs):
            if idle_s:
                time.sleep(idle_s)
            start = time.perf_counter()
            runtime.graphs.step(ChunkProgram.CONSUME.value)          # its graph copies the outputs to the host too
            runtime.synchronize()
            ms.append((time.perf_counter() - start) * 1e3)
        return np.asarray(ms)
    after_idle, back_to_back = replays(period), replays(0.0)
    return {"after_idle_p50_ms": float(np.percentile(after_idle, 50)),
            "after_idle_p99_ms": float(np.percentile(after_idle, 99)),
            "back_to_back_p50_ms": float(np.percentile(back_to_back, 50)),
            "by_idle_ms": {str(idle): float(np.percentile(replays(idle / 1e3), 50)) for idle in (0.5, 2, 5, 10)}}


def run_case(case: Case, device: torch.device, quick: bool, steps: int, lerobot_python: Optional[Path]) -> dict:
    vla, pi = case.kind == "smolvla", case.kind in ("pi0", "pi05")
    camera = lerobot_smolvla.camera_of(case.size) if vla else lerobot_pi.BENCH[case.size].camera_shape if pi else \
        (96, 128) if quick else (480, 640) if device.type == "cuda" else (240, 320)
    period = 1.0 / (50.0 if device.type == "cuda" else case.rate_hz)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            checkpoint = case.write(tmp / "pretrained_model", camera, quick, lerobot_python)
        except (ConfigError, RuntimeError) as exc:
            return {"case": case.name, "camera": list(camera), "rate_hz": 1.0 / period, "steps": steps,
                    **{side: {"ran": False, "reason": str(exc)} for side in SIDES}}
        if vla:
            config, ports_of = lerobot_smolvla.serving_config(checkpoint), lerobot_smolvla.ports_of()
            obs = observations(steps, camera, joints=lerobot_smolvla.JOINTS,
                               cameras=lerobot_smolvla.camera_keys())
            extra: Sequence[str] = ("--vlm", str(checkpoint.parent / "vlm"), "--task", lerobot_smolvla.TASK)
        elif pi:
            tokenizer = checkpoint.parent / "paligemma_tokenizer"
            config = lerobot_pi.serving_config(checkpoint, tokenizer)
            spec = lerobot_pi.BENCH[case.size]
            ports_of = {STATE: "joints", **{key: lerobot_pi.port_of(key) for key in spec.camera_keys}}
            obs = observations(steps, camera, joints=spec.joints, cameras=spec.camera_keys)
            extra = ("--vlm", str(tokenizer), "--task", lerobot_pi.BENCH_TASK)
        else:
            config, ports_of, obs, extra = serving_config(checkpoint), PORTS, observations(steps, camera), ()
        level = config.runtime.numerics            # the session's: LeRobot runs at it too
        lerobot = lerobot_side(lerobot_python, checkpoint, obs, period, tmp, level, extra) \
            if device.type == "cpu" else \
            {"ran": False, "reason": "LeRobot's loop is measured on the CPU only (no LeRobot on the GPU machine)"}
        sync = refused_or(lambda: session_side(config, ports_of, obs, device, "sync", 1.0 / period, paced=False))
        sync_paced = refused_or(lambda: session_side(config, ports_of, obs, device, "sync", 1.0 / period,
                                                      paced=True))
        asynchronous = refused_or(lambda: session_side(config, ports_of, obs, device, "async", 1.0 / period,
                                                        paced=True, wake_floor=True))
    sides: Dict[str, Dict[str, Any]] = {"lerobot": lerobot, "sync": sync, "sync_paced": sync_paced,
                                        "async": asynchronous}
    actions = {side: values.pop("_actions", None) for side, values in sides.items()}
    result: Dict[str, Any] = {"case": case.name, "camera": list(camera), "rate_hz": 1.0 / period, "steps": steps,
                              **sides, **consume_ratios(sides)}
    if lerobot.get("ran"):
        for side, figure in (("sync", "mean_ms"), ("sync", "p99_ms"), ("async", "p99_ms")):
            if sides[side].get("ran", True):
                result[f"{side}_{figure[:-3]}_over_lerobot"] = sides[side][figure] / lerobot[figure]
        if actions["sync"] is not None:
            diff = np.abs(actions["sync"] - actions["lerobot"])
            result["actions_equal_lerobot"] = bool(np.array_equal(actions["sync"].view(np.uint32),
                                                                  actions["lerobot"].view(np.uint32)))
            result["actions_max_abs_diff"] = float(diff.max())
    print(f"bench chunking: case {case.name} done: " + json.dumps(_headline(result)), file=sys.stderr, flush=True)
    return result


def consume_ratios(sides: Mapping[str, Mapping[str, Any]]) -> Dict[str, float]:
    """Async's consume steps over sync's (see the module docstring), where both sides ran."""
    out: Dict[str, float] = {}
    asynchronous = sides["async"]
    for name, baseline, figure in (("consume_ratio", "sync_paced", "consume_p50_ms"),
                                   ("consume_p99_ratio", "sync_paced", "consume_p99_ms"),
                                   ("consume_ratio_back_to_back", "sync", "consume_p50_ms")):
        mine, theirs = asynchronous.get(figure), sides[baseline].get(figure)
        if mine is not None and theirs:
            out[name] = mine / theirs
    return out


def refused_or(side: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """A session side's figures, or (a schedule the configuration refuses, e.g. an auto
    delay the chunk cannot take) why it did not run, with the numbers of the refusal."""
    try:
        return side()
    except ConfigError as exc:
        return {"ran": False, "reason": f"refused at configure: {exc}"}


def _headline(result: Dict[str, Any]) -> Dict[str, Any]:
    """A case's main figures (progress on stderr: a long run's finished cases are not lost)."""
    out: Dict[str, Any] = {k: v for k, v in result.items()
                           if k.endswith("_over_lerobot") or k == "actions_equal_lerobot" or k.startswith("consume_")}
    for side in SIDES:
        r = result[side]
        out[side] = ({k: r[k] for k in ("mean_ms", "p99_ms", "consume_p50_ms", "misses_per_1000", "delay") if k in r}
                     if r.get("ran", True) else r["reason"][:300])
    return out


def run(device_name: str = "auto", quick: bool = False, steps: Optional[int] = None,
        cases: Sequence[str] = tuple(CASES), lerobot_python: Optional[str] = None) -> dict:
    device = resolve_device(device_name)
    python = Path(lerobot_python or os.environ.get("CAPSULE_ROS_LEROBOT_PYTHON") or DEFAULT_LEROBOT_PYTHON)
    steps = steps or (200 if quick else 3000)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"--cases {unknown}: not among {list(CASES)}")
    if quick:
        cases = [name for name in cases if name not in QUICK_SKIPS]
    return {"bench": "chunking", **environment(device), "quick": quick,
            "cases": [run_case(CASES[name], device, quick, steps, python) for name in cases]}


def table(result: dict) -> None:
    rows = []
    for case in result["cases"]:
        for side in SIDES:
            r = case[side]
            if not r.get("ran", True):
                rows.append([case["case"], side, r["reason"][:60], "", "", "", "", "", "", ""])
                continue
            rows.append([case["case"], side, r["mean_ms"], r["p50_ms"], r["p99_ms"], r["max_ms"],
                         r.get("consume_p50_ms", ""), r["misses_per_1000"], r["seam_jump"], r["within_chunk_jump"]])
    print_table(f"bench chunking ({result['device']})", ["case", "side", "mean ms", "p50 ms", "p99 ms", "max ms",
                                                         "consume p50 ms", "misses/1000", "seam |Δa|", "within |Δa|"],
                rows)
    for case in result["cases"]:
        ratios = {k: case[k] for k in ("consume_ratio", "consume_p99_ratio", "consume_ratio_back_to_back",
                                       "sync_mean_over_lerobot", "sync_p99_over_lerobot", "async_p99_over_lerobot",
                                       "actions_equal_lerobot") if k in case}
        print(case["case"], case["async"].get("schedule", case["async"].get("reason")), ratios)


def main(args) -> int:
    cases = tuple(args.cases.split(",")) if getattr(args, "cases", None) else tuple(CASES)
    emit(run(args.device, args.quick, getattr(args, "steps", None), cases, getattr(args, "lerobot_python", None)),
         args.json, table)
    return 0
