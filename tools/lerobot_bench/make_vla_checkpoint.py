"""A SmolVLA checkpoint for ``capsule-ros bench chunking`` (its VLA cases), made by LeRobot 0.6.1 itself.

Runs in LeRobot's environment (``tools/lerobot_bench/.venv``), offline:

    PYTHONPATH=<repository root> tools/lerobot_bench/.venv/bin/python tools/lerobot_bench/make_vla_checkpoint.py \\
        --out DIR --spec JSON

``--spec``: the VLM's dimensions (``make_vla_fixtures.VLMSpec`` fields), the input features and
the SmolVLAConfig options, as JSON. Writes ``DIR/vlm`` (the staged VLM: config, tokenizer,
processor files) and ``DIR/pretrained_model`` (``save_pretrained`` with its processors), as
``tools/lerobot_fixtures/make_vla_fixtures.py`` makes the parity fixtures, with LeRobot's
random initialisation from a fixed seed instead of the fixtures' weight pattern: a chunk's
time does not depend on the weight values.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from tools.lerobot_fixtures.make_vla_fixtures import (
    SmolVLAPolicy,
    VLAFixture,
    VLMSpec,
    make_pre_post_processors,
    policy_config,
    rename_vlm,
    stage_vlm,
)


def statistics(features: dict, action_dim: int) -> dict:
    """Mean / std statistics for the state and the action (the images stay IDENTITY, SmolVLA's default)."""
    state = int(features["observation.state"][1])
    ramp = np.linspace(0.5, 1.5, max(state, action_dim)).astype(np.float32)
    return {"observation.state": {"mean": 0.1 * ramp[:state], "std": ramp[:state]},
            "action": {"mean": -0.1 * ramp[:action_dim], "std": ramp[:action_dim]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--spec", required=True, help="JSON: {vlm: {...}, inputs: {...}, action_dim, options: {...}}")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    root = Path(args.out)
    fx = VLAFixture(name="bench", seed=0, vlm=VLMSpec(**spec["vlm"]),
                    inputs={k: tuple(v) for k, v in spec["inputs"].items()}, action_dim=int(spec["action_dim"]),
                    options=dict(spec["options"]), stats={})
    fx.stats = statistics(fx.inputs, fx.action_dim)
    stage_vlm(fx.vlm, root / "vlm")
    torch.manual_seed(0)
    cfg = policy_config(fx, root / "vlm")
    policy = SmolVLAPolicy(cfg)
    stats = {k: {s: torch.from_numpy(v) for s, v in d.items()} for k, d in fx.stats.items()}
    pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
    directory = root / "pretrained_model"
    policy.save_pretrained(directory)
    pre.save_pretrained(directory)
    post.save_pretrained(directory)
    rename_vlm(directory, "capsule-ros-bench/smolvla-vlm")


if __name__ == "__main__":
    main()
