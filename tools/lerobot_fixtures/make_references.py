"""Asynchronous-chunking references for the LeRobot fixtures, from LeRobot's own code.

Run in an environment with LeRobot (not the project's), from the repository root:

    PYTHONPATH=. <lerobot venv>/bin/python tools/lerobot_fixtures/make_references.py [NAME ...]

For each chunking fixture (``act_queue``, ``diffusion``, ``diffusion_ddim_env``) it loads the
committed checkpoint and inputs, checks that this LeRobot's ``select_action`` loop still
gives the committed actions (``outputs.npz``), and writes ``async.npz``: the actions of the
fixed-delay loop below for a few delays d, as ``action_d<d>`` [episodes, steps, A], with
``delays`` and ``horizons`` (rows executed per chunk for each d). ``async.json`` holds the
versions.

The loop (capsule_ros's ``control.chunking: async``, docs/chunking.md), built only from
LeRobot's preprocessor, ``predict_action_chunk`` and postprocessor, with L the rows a chunk
holds (ACT: ``chunk_size``; Diffusion: ``horizon - n_obs_steps + 1``, the trajectory from the
current observation step on, which ``predict_action_chunk`` returns when ``n_action_steps``
is set to it), e = min(n_action_steps, L - d) and end E = e + d:

- the first step of an episode predicts a chunk from its own observation and executes
  its row 0 (nothing to overlap with);
- the step that executes row e of the current chunk also predicts the next chunk from its
  own observation (the request); it takes over d steps later at its row d (its first d
  rows count as executed);
- every other step executes the next row.

Diffusion's observation history is appended at every step (as ``select_action`` does) and
its noise is drawn at each prediction from the counter-based RNG of that step
(``make_fixtures.CounterNoise``). With d = 0 the loop is ``select_action``'s, which the
script checks against the committed actions first.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from capsule_ros.runtime import numerics

LEVEL = numerics.pin(os.environ.get("CAPSULE_ROS_NUMERICS", numerics.PORTABLE), cpu_threads=1)  # before torch runs

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy  # noqa: E402
from lerobot.policies.utils import populate_queues, prepare_observation_for_inference  # noqa: E402

from tools.lerobot_fixtures.make_fixtures import (  # noqa: E402
    FIXTURES,
    OUT,
    CounterNoise,
    make_pre_post_processors,
    rollout,
    versions,
)

CHUNKING = ("act_queue", "diffusion", "diffusion_ddim_env")
ALL = ("act_queue", "act_ensemble", "diffusion", "diffusion_ddim_env")
OBS_IMAGES = "observation.images"


def load(name: str):
    import tarfile
    target = OUT / name
    with np.load(target / "inputs.npz", allow_pickle=False) as data:
        inputs = {k: data[k] for k in data.files}
    with np.load(target / "outputs.npz", allow_pickle=False) as data:
        outputs = {k: data[k] for k in data.files}
    tmp = Path(tempfile.mkdtemp())
    with tarfile.open(target / "pretrained_model.tar.xz", "r:xz") as tar:
        tar.extractall(tmp, filter="data")
    return tmp / "pretrained_model", inputs, outputs


def lengths(policy) -> int:
    cfg = policy.config
    return cfg.horizon - cfg.n_obs_steps + 1 if isinstance(policy, DiffusionPolicy) else cfg.chunk_size


def delays_for(policy) -> List[int]:
    """0 (sync) and every d from 1 with d <= e = min(n_action_steps, L - d), at most four."""
    length, steps = lengths(policy), policy.config.n_action_steps
    valid = [d for d in range(1, length) if d <= min(steps, length - d)]
    picked = sorted({valid[0], valid[len(valid) // 2], valid[-1]}) if valid else []
    return [0, *picked]


def loop(fx, directory: Path, inputs, seeds, delay: int) -> np.ndarray:
    policy = fx.policy_cls.from_pretrained(directory)          # a fresh policy: CounterNoise wraps its sampler
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(directory))
    cfg = policy.config
    length = lengths(policy)
    horizon = cfg.n_action_steps if delay == 0 else min(cfg.n_action_steps, length - delay)
    end = horizon + delay
    diffusion = isinstance(policy, DiffusionPolicy)
    noise = CounterNoise(policy) if diffusion else None
    n_action_steps = cfg.n_action_steps
    episodes, steps = inputs["seeds"].shape[0], next(v for k, v in inputs.items() if k != "seeds").shape[1]
    actions = np.zeros((episodes, steps, cfg.output_features["action"].shape[0]), np.float32)
    device = torch.device("cpu")

    def predict(batch):
        if diffusion:
            cfg.n_action_steps = length          # generate_actions returns rows start .. start + L
            try:
                return policy.predict_action_chunk(batch)
            finally:
                cfg.n_action_steps = n_action_steps
        return policy.predict_action_chunk(batch)

    for e in range(episodes):
        policy.reset()
        pre.reset()
        post.reset()
        cursor, chunk, pending = end, None, None
        for t in range(steps):
            if noise is not None:
                noise.at(e, int(seeds[e]), t)
            observation = {key: inputs[key][e, t].copy() for key in fx.inputs}
            with torch.inference_mode():
                batch = pre(prepare_observation_for_inference(observation, device, None, None))
                if diffusion:                     # select_action's bookkeeping: the observation history
                    batch = dict(batch)
                    batch.pop("action", None)
                    if cfg.image_features:
                        batch[OBS_IMAGES] = torch.stack([batch[key] for key in cfg.image_features], dim=-4)
                    policy._queues = populate_queues(policy._queues, batch)
                if cursor == end:
                    if pending is None:
                        chunk, cursor = predict(batch), 0
                    else:
                        chunk, pending, cursor = pending, None, delay
                if delay and cursor == horizon:
                    pending = predict(batch)
                action = post(chunk[:, cursor])
                cursor += 1
            actions[e, t] = action.reshape(-1).numpy()
    return actions


def make(name: str) -> None:
    fx = next(f() for f in FIXTURES if f().name == name)
    directory, inputs, outputs = load(name)
    seeds = inputs["seeds"]
    committed = outputs["action"]
    select, extra = rollout(fx, directory, inputs, seeds)
    unchanged = bool(np.array_equal(select.view(np.uint32), committed.view(np.uint32)))
    np.savez_compressed(OUT / name / "outputs.npz", action=select, **extra)
    meta = {"versions": versions(), "numerics": LEVEL,
            "select_action_equals_the_previous_outputs": unchanged,
            "max_abs_diff_to_the_previous_outputs": float(np.abs(select - committed).max())}
    if name in CHUNKING:
        policy = fx.policy_cls.from_pretrained(directory)
        out: Dict[str, np.ndarray] = {}
        delays, horizons = delays_for(policy), []
        for delay in delays:
            got = loop(fx, directory, inputs, seeds, delay)
            horizons.append(policy.config.n_action_steps if delay == 0 else min(policy.config.n_action_steps,
                                                                                lengths(policy) - delay))
            if delay == 0:
                assert np.array_equal(got.view(np.uint32), select.view(np.uint32)), \
                    f"{name}: the d = 0 loop is not select_action's"
                continue
            out[f"action_d{delay}"] = got
        np.savez_compressed(OUT / name / "async.npz", delays=np.asarray(delays[1:], np.int64),
                            horizons=np.asarray(horizons[1:], np.int64), **out)
        meta.update(delays=delays[1:], horizons=horizons[1:], chunk_length=lengths(policy))
    (OUT / name / "references.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"{name} at {LEVEL}: select_action {'unchanged' if unchanged else 'changed'} (max abs diff "
          f"{meta['max_abs_diff_to_the_previous_outputs']:.3g}); async delays {meta.get('delays', [])}")


def main(argv: List[str]) -> None:
    torch.set_num_threads(1)
    for name in argv or ALL:
        make(name)


if __name__ == "__main__":
    main(sys.argv[1:])
