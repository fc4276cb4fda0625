"""LeRobot's own control loop over recorded observations, timed: the baseline of
``capsule-ros bench chunking``. Runs in LeRobot's environment (not the project's):

    PYTHONPATH=<repository root> tools/lerobot_bench/.venv/bin/python tools/lerobot_bench/select_action_loop.py \\
        --checkpoint DIR --observations IN.npz --out OUT.npz [--threads 1] [--device cuda]

For every step: ``predict_action`` (LeRobot's observation conversion, preprocessor,
``select_action``, postprocessor), as its record and eval loops call it, with the wall time
of that call (an input array shorter than the others, the camera frames, cycles).
Diffusion's, SmolVLA's and π0's noise comes from capsule_ros's counter-based RNG at each step
(``tools/lerobot_fixtures/make_fixtures.CounterNoise``, ``make_vla_fixtures.CounterFlowNoise``;
a SmolVLA checkpoint's VLM files or a π0 checkpoint's tokenizer from ``--vlm``, the task from
``--task``; a scaled-down π0 loads through ``pi_scaled.load_pi``), so both sides sample alike and
their actions can be compared bit for bit, at the CPU numerics level ``CAPSULE_ROS_NUMERICS``
(pinned before torch runs; the benchmark passes its own). ``--device cuda`` (``capsule-ros bench
vla``): the policy and the processors' device step on the GPU, as ``lerobot-eval`` puts them.
``CAPSULE_ROS_DETERMINISTIC=1`` (with ``CUBLAS_WORKSPACE_CONFIG`` in the environment): torch's
deterministic algorithms, as capsule_ros's runtime sets them (``runtime.deterministic``), so a GPU
side's kernels are chosen under the same settings as capsule_ros's. ``CAPSULE_ROS_FLOAT32_MATMUL=high``:
TensorFloat-32 for float32 matrix products on a GPU, as capsule_ros's ``runtime.float32_matmul: high``.
``IN.npz``: one array per input feature [steps, ...] and ``seed``; ``OUT.npz``: ``seconds``
[steps], ``action`` [steps, A], ``gpu_peak_bytes`` (the weights and the steps; 0 on a CPU) and
``phase_seconds`` [imports, load, episode]: where the process's time went (a 3B model's load
takes minutes on a GPU host, which is what a device call's time limit meets).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()             # the phases' origin: before the imports below

from capsule_ros.runtime import numerics  # noqa: E402

# the CPU numerics level capsule_ros's side runs at (the benchmark passes it), before torch runs
LEVEL = numerics.pin(os.environ.get("CAPSULE_ROS_NUMERICS", numerics.PORTABLE), cpu_threads=1)

import lerobot  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from lerobot.policies.act.modeling_act import ACTPolicy  # noqa: E402
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy  # noqa: E402
from lerobot.policies.factory import make_pre_post_processors  # noqa: E402

from tools.lerobot_fixtures.make_fixtures import CounterNoise, predict_action  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--observations", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's CPU threads; 0: its default (a GPU run: the host as a user's process has it, "
                             "and a 3B model built in seconds, not minutes)")
    parser.add_argument("--vlm", help="a VLA's hub files: SmolVLA's VLM (config, tokenizer, processor), π0's "
                                      "tokenizer")
    parser.add_argument("--task", default="", help="a VLA: the task instruction of every step")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    args = parser.parse_args()
    imported = time.perf_counter()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if os.environ.get("CAPSULE_ROS_DETERMINISTIC") == "1":           # as capsule_ros.runtime.engine.configure_torch
        torch._C._set_deterministic_algorithms(True, warn_only=False)
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = os.environ.get("CAPSULE_ROS_FLOAT32_MATMUL") == "high"
    with np.load(args.observations, allow_pickle=False) as data:
        inputs = {k: data[k] for k in data.files}
    seed = int(inputs.pop("seed"))
    kind = json.loads((Path(args.checkpoint) / "config.json").read_text())["type"]
    noise: Any = None
    if kind == "smolvla":
        from tools.lerobot_fixtures.make_vla_fixtures import CounterFlowNoise, load_policy
        policy, pre, post = load_policy(Path(args.checkpoint), Path(args.vlm), device=args.device)
        noise = CounterFlowNoise(policy)
    elif kind in ("pi0", "pi05"):
        from tools.lerobot_fixtures.make_vla_fixtures import CounterFlowNoise
        from tools.lerobot_fixtures.pi_scaled import load_pi
        policy, pre, post = load_pi(Path(args.checkpoint), Path(args.vlm), device=args.device)
        noise = CounterFlowNoise(policy)
    else:
        policy = (ACTPolicy if kind == "act" else DiffusionPolicy).from_pretrained(args.checkpoint)
        policy.config.device = args.device
        policy.to(args.device)
        pre, post = make_pre_post_processors(policy.config, pretrained_path=args.checkpoint,
                                             preprocessor_overrides={"device_processor": {"device": args.device}})
        noise = CounterNoise(policy) if isinstance(policy, DiffusionPolicy) else None
    loaded = time.perf_counter()
    steps = max(value.shape[0] for value in inputs.values())    # shorter arrays (camera frames) cycle
    seconds, actions = np.zeros(steps), []
    device = torch.device(args.device)
    policy.reset()
    pre.reset()
    post.reset()
    for t in range(steps):
        if noise is not None:
            noise.at(0, seed, t)
        observation = {key: value[t % len(value)] for key, value in inputs.items()}
        start = time.perf_counter()
        action = predict_action(observation, policy, device, pre, post, use_amp=False, task=args.task or None)
        seconds[t] = time.perf_counter() - start
        actions.append(action.reshape(-1).numpy().copy())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    phases = np.asarray([imported - STARTED, loaded - imported, time.perf_counter() - loaded])
    np.savez(args.out, seconds=seconds, phase_seconds=phases, action=np.stack(actions).astype(np.float32),
             gpu_peak_bytes=np.asarray(peak),
             lerobot=np.asarray(lerobot.__version__), torch=np.asarray(torch.__version__), numerics=np.asarray(LEVEL))


if __name__ == "__main__":
    main()
