"""Make the π0 and π0.5 parity fixtures under test/fixtures/lerobot/<name>/ (see README.md).

Run in the LeRobot 0.6.1 environment (tools/lerobot_bench), from the repository root:

    PYTHONPATH=. tools/lerobot_bench/.venv/bin/python tools/lerobot_fixtures/make_pi_fixtures.py [NAME ...]

For each fixture, with LeRobot 0.6.1 itself (scaled down by ``pi_scaled.scaled_pi``):

1. build the policy from a seeded config, overwrite its weights with the low-entropy
   pattern of ``make_fixtures.pattern_weights_`` (the checkpoint compresses to kilobytes),
   and save it with LeRobot's ``save_pretrained`` plus its pre/post-processors (their
   normalisation statistics included). The processors name the tokenizer as a real π0
   checkpoint does, ``google/paligemma-3b-pt-224``: this script stages the fixtures' own
   tokenizer (``test/fixtures/lerobot/paligemma_tokenizer``, written by
   ``pi_scaled.build_tokenizer``) under that name in a temporary Hugging Face cache with
   the hub switched off, so nothing is downloaded;
2. load it back as LeRobot's eval does (``from_pretrained``,
   ``make_pre_post_processors(pretrained_path=...)``) and record, over 3 episodes with
   ``reset()`` and a task that changes mid-episode:

   - ``outputs.npz``: ``lerobot.common.control_utils.predict_action`` at every step
     (preprocessor, ``select_action``, postprocessor): the sync reference;
   - ``async.npz``: the fixed-delay loop of ``make_references.py`` (capsule_ros's
     ``control.chunking: async``) with ``predict_action_chunk``, for a few delays d, with
     real-time chunking off (``action_d<d>``) and on (``action_d<d>_rtc``). With RTC the
     request passes ``inference_delay=d`` and, as ``prev_chunk_left_over``, the rows of
     the current chunk from the request's own row on (normalised, as LeRobot's action
     queue keeps them), padded with zeros or truncated to the RTC execution horizon as
     LeRobot's RTC engine does (``rollout/inference/rtc.py``);

   The flow-matching noise is capsule_ros's counter-based draw
   ``counter_normal((seed, step), (chunk_size, max_action_dim))`` at the step that plans,
   injected by replacing ``model.sample_noise`` (``make_vla_fixtures.CounterFlowNoise``,
   shared with SmolVLA's fixtures; checked: one draw per chunk).

Files per fixture, no pickle anywhere: ``pretrained_model.tar.xz``, ``inputs.npz`` (state
float32 [3, S, n], cameras uint8 [3, S, H, W, 3], ``task`` unicode [3, S], ``seeds``),
``outputs.npz``, ``async.npz``, ``meta.json`` (versions, numerics level, the schedule,
the RTC settings, how far the task and camera move the actions).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from capsule_ros.runtime import numerics

LEVEL = numerics.pin(os.environ.get("CAPSULE_ROS_NUMERICS", numerics.PORTABLE), cpu_threads=1)  # before torch runs

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "test" / "fixtures" / "lerobot" / "paligemma_tokenizer"
HUB_NAME = "google/paligemma-3b-pt-224"
_HF_HOME = Path(tempfile.mkdtemp(prefix="pi-fixtures-hf-"))
os.environ.update(HF_HOME=str(_HF_HOME), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # before huggingface_hub loads

import json  # noqa: E402
import shutil  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Callable, Dict, List, Optional, Tuple  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lerobot.common.control_utils import predict_action  # noqa: E402
from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.policies.factory import make_pre_post_processors  # noqa: E402
from lerobot.policies.pi0.configuration_pi0 import PI0Config  # noqa: E402
from lerobot.policies.pi0.modeling_pi0 import PI0Policy  # noqa: E402
from lerobot.policies.pi05.configuration_pi05 import PI05Config  # noqa: E402
from lerobot.policies.pi05.modeling_pi05 import PI05Policy  # noqa: E402
from lerobot.policies.rtc.configuration_rtc import RTCConfig  # noqa: E402
from lerobot.policies.utils import prepare_observation_for_inference  # noqa: E402

from tools.lerobot_fixtures.make_fixtures import (  # noqa: E402
    camera_frames,
    pattern_weights_,
    random_walk,
    tar_xz,
)
from tools.lerobot_fixtures.make_vla_fixtures import CounterFlowNoise  # noqa: E402
from tools.lerobot_fixtures.pi_scaled import TINY, build_tokenizer, scaled_pi  # noqa: E402

OUT = ROOT / "test" / "fixtures" / "lerobot"
EPISODES, STEPS = 3, 120

LONG_TASK = ("move slowly toward the window, wait for the signal, grasp the handle firmly, rotate it by ninety "
             "degrees, pull gently, release it, and return home; ") * 2
# per episode: (first step, task) in order; each holds until the next
TASKS: Tuple[Tuple[Tuple[int, str], ...], ...] = (
    ((0, "pick up the red cube"), (29, "place the cube on the blue block"), (70, "stack it then open the drawer")),
    ((0, LONG_TASK), (45, ""), (83, "put the cube up \u2603 \u00fcn\u00efcode")),
    ((0, "  Pick_up the   green block\n"), (61, "close the drawer")),
)


@dataclass
class Fixture:
    """One π0 / π0.5 checkpoint and its rollouts."""

    name: str
    policy_cls: type
    config: Callable[[], object]
    stats: Dict[str, Dict[str, np.ndarray]]
    seed: int
    inputs: Dict[str, tuple]                 # key -> ("walk", n[, constant dims]) or ("camera", h, w)
    rtc: RTCConfig
    delays: Tuple[int, ...]
    extra: Dict[str, object] = field(default_factory=dict)


def _vec(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def _features(inputs: Dict[str, tuple], action_dim: int):
    feats = {}
    for key, spec in inputs.items():
        if spec[0] == "camera":
            feats[key] = PolicyFeature(FeatureType.VISUAL, (3, spec[1], spec[2]))
        else:
            feats[key] = PolicyFeature(FeatureType.STATE, (spec[1],))
    return feats, {"action": PolicyFeature(FeatureType.ACTION, (action_dim,))}


def _quantile_stats(low, high) -> Dict[str, np.ndarray]:
    low, high = _vec(low), _vec(high)
    return {"q01": low, "q99": high, "q10": low * 0.7, "q90": high * 0.7, "min": low * 1.3, "max": high * 1.3,
            "mean": (low + high) / 2, "std": (high - low) / 4}


IMAGE_STATS = {"mean": _vec([0.48, 0.45, 0.40]).reshape(3, 1, 1), "std": _vec([0.23, 0.22, 0.25]).reshape(3, 1, 1),
               "min": np.zeros((3, 1, 1), np.float32), "max": np.ones((3, 1, 1), np.float32)}


def pi0() -> Fixture:
    """π0: two cameras (one resized with padding to 32 x 32, one at it), MEAN_STD, RTC linear."""
    inputs = {"observation.state": ("walk", 6), "observation.images.front": ("camera", 48, 64),
              "observation.images.wrist": ("camera", 32, 32)}
    feats, outs = _features(inputs, 5)
    return Fixture(
        name="pi0", policy_cls=PI0Policy, seed=21, inputs=inputs, delays=(1, 4, 8),
        rtc=RTCConfig(enabled=True, prefix_attention_schedule="LINEAR", max_guidance_weight=10.0,
                      execution_horizon=10),
        config=lambda: PI0Config(
            input_features=feats, output_features=outs, paligemma_variant="scaled_vlm_64",
            action_expert_variant="scaled_expert_32", image_resolution=(32, 32), chunk_size=16, n_action_steps=8,
            device="cpu"),
        stats={"observation.state": {"mean": _vec([0.1, -0.2, 0.0, 0.3, -0.1, 0.05]),
                                     "std": _vec([0.8, 1.2, 0.5, 1.0, 0.9, 1.5])},
               "observation.images.front": IMAGE_STATS, "observation.images.wrist": IMAGE_STATS,
               "action": {"mean": _vec([0.2, -0.1, 0.0, 0.5, -0.3]), "std": _vec([0.5, 1.0, 2.0, 0.7, 1.3])}})


def pi05() -> Fixture:
    """π0.5: one camera and one empty camera, QUANTILES (a constant joint: q01 == q99), the
    discretised state in the prompt, RTC exp with a horizon shorter than the leftover."""
    inputs = {"observation.state": ("walk", 7, (6,)), "observation.images.front": ("camera", 48, 64)}
    feats, outs = _features(inputs, 6)
    return Fixture(
        name="pi05", policy_cls=PI05Policy, seed=22, inputs=inputs, delays=(1, 3, 6),
        rtc=RTCConfig(enabled=True, prefix_attention_schedule="EXP", max_guidance_weight=5.0, execution_horizon=6),
        config=lambda: PI05Config(
            input_features=feats, output_features=outs, paligemma_variant="scaled_vlm_64",
            action_expert_variant="scaled_expert_32", image_resolution=(32, 32), chunk_size=12, n_action_steps=6,
            empty_cameras=1, device="cpu"),
        stats={"observation.state": _quantile_stats([-1.2, -0.8, -1.5, -1.0, -0.6, -1.1, 0.25],
                                                    [1.0, 0.9, 1.2, 0.7, 0.8, 1.3, 0.25]),
               "observation.images.front": IMAGE_STATS,
               "action": _quantile_stats([-1.0, -2.0, 0.0, -0.5, -1.5, -0.2], [1.0, 2.0, 3.0, 0.5, 0.5, 0.9])})


def pi0_bf16() -> Fixture:
    """π0 at LeRobot's bfloat16 precision (its float32 exceptions: the vision tower, the
    projector, the norms; the buffers cast too): one camera at the model's size, RTC ones."""
    inputs = {"observation.state": ("walk", 4), "observation.images.top": ("camera", 32, 32)}
    feats, outs = _features(inputs, 4)
    return Fixture(
        name="pi0_bf16", policy_cls=PI0Policy, seed=23, inputs=inputs, delays=(2, 5),
        rtc=RTCConfig(enabled=True, prefix_attention_schedule="ONES", max_guidance_weight=8.0, execution_horizon=5),
        config=lambda: PI0Config(
            input_features=feats, output_features=outs, paligemma_variant="scaled_vlm_64",
            action_expert_variant="scaled_expert_32", image_resolution=(32, 32), chunk_size=10, n_action_steps=5,
            dtype="bfloat16", device="cpu"),
        stats={"observation.state": {"mean": _vec([0.0, 0.2, -0.3, 0.1]), "std": _vec([0.9, 1.1, 0.6, 1.4])},
               "observation.images.top": IMAGE_STATS,
               "action": {"mean": _vec([0.1, -0.2, 0.3, 0.0]), "std": _vec([0.6, 1.2, 0.8, 1.5])}})


FIXTURES = (pi0, pi05, pi0_bf16)


# --- inputs -------------------------------------------------------------------------------------

def task_schedule(steps: int) -> np.ndarray:
    """``task`` unicode [EPISODES, steps] from TASKS."""
    rows = []
    for changes in TASKS:
        row, current = [], changes[0][1]
        starts = dict(changes)
        for t in range(steps):
            current = starts.get(t, current)
            row.append(current)
        rows.append(row)
    return np.asarray(rows, dtype=np.str_)


def make_inputs(fx: Fixture) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(fx.seed)
    out: Dict[str, np.ndarray] = {}
    for key, spec in fx.inputs.items():
        if spec[0] == "camera":
            out[key] = np.stack([camera_frames(rng, STEPS, spec[1], spec[2]) for _ in range(EPISODES)])
        else:
            constant = spec[2] if len(spec) > 2 else ()
            out[key] = np.stack([1.3 * random_walk(rng, STEPS, spec[1], constant) for _ in range(EPISODES)])
            if constant:
                out[key][..., list(constant)] = 0.25
    out["task"] = task_schedule(STEPS)
    return out


# --- the tokenizer, staged as the hub name ------------------------------------------------------

def stage_tokenizer() -> int:
    """Write the fixtures' tokenizer and put it in the temporary Hugging Face cache under
    ``HUB_NAME`` (the layout ``huggingface_hub`` resolves offline, with the repository's
    model config as a stub); its vocabulary size."""
    size = build_tokenizer(TOKENIZER_DIR)
    repo = _HF_HOME / "hub" / ("models--" + HUB_NAME.replace("/", "--"))
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in TOKENIZER_DIR.iterdir():
        shutil.copy(path, snapshot / path.name)
    # AutoTokenizer also reads the repository's model config (for its model type) and,
    # offline, refuses a hub name whose cache lacks it; the tokenizer class comes from
    # tokenizer_config.json all the same
    (snapshot / "config.json").write_text(json.dumps({"model_type": "paligemma"}) + "\n")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return size


# --- rollouts -----------------------------------------------------------------------------------

def observation(fx: Fixture, inputs: Dict[str, np.ndarray], e: int, t: int) -> Dict[str, np.ndarray]:
    return {key: inputs[key][e, t].copy() for key in fx.inputs}


def load(fx: Fixture, directory: Path, rtc: Optional[RTCConfig] = None):
    policy = fx.policy_cls.from_pretrained(directory)
    if rtc is not None:
        policy.config.rtc_config = rtc
        policy.init_rtc_processor()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(directory))
    return policy, pre, post, CounterFlowNoise(policy)


def select_action_rollout(fx: Fixture, directory: Path, inputs: Dict[str, np.ndarray], seeds: np.ndarray):
    """``predict_action`` at every step, ``reset()`` between episodes (LeRobot's eval loop)."""
    policy, pre, post, noise = load(fx, directory)
    device = torch.device("cpu")
    actions = np.zeros((EPISODES, STEPS, policy.config.output_features["action"].shape[0]), np.float32)
    for e in range(EPISODES):
        policy.reset()
        pre.reset()
        post.reset()
        for t in range(STEPS):
            noise.at(e, int(seeds[e]), t)
            before = len(noise.draws)
            action = predict_action(observation(fx, inputs, e, t), policy, device, pre, post, use_amp=False,
                                    task=str(inputs["task"][e, t]))
            assert len(noise.draws) - before == (1 if t % policy.config.n_action_steps == 0 else 0), (e, t)
            actions[e, t] = action.reshape(-1).numpy()
    return actions


def normalize_leftover(rows: torch.Tensor, target_steps: int) -> torch.Tensor:
    """LeRobot 0.6.1's ``rollout/inference/rtc.py:_normalize_prev_actions_length`` (copied:
    importing ``lerobot.rollout`` needs LeRobot's dataset extra): pad [T, A] with zero rows
    or truncate it to ``target_steps`` rows."""
    steps, action_dim = rows.shape
    if steps == target_steps:
        return rows
    if steps > target_steps:
        return rows[:target_steps]
    padded = torch.zeros((target_steps, action_dim), dtype=rows.dtype, device=rows.device)
    padded[:steps] = rows
    return padded


def async_rollout(fx: Fixture, directory: Path, inputs: Dict[str, np.ndarray], seeds: np.ndarray, delay: int,
                  rtc: bool) -> Tuple[np.ndarray, int]:
    """The fixed-delay loop (module docstring; ``make_references.loop``), its actions and
    the rows executed per chunk. Outside inference mode, as LeRobot's RTC engine calls
    ``predict_action_chunk`` (RTC's guidance enables grad inside it)."""
    policy, pre, post, noise = load(fx, directory, fx.rtc if rtc else None)
    cfg = policy.config
    length = cfg.chunk_size
    horizon = cfg.n_action_steps if delay == 0 else min(cfg.n_action_steps, length - delay)
    end = horizon + delay
    device = torch.device("cpu")
    actions = np.zeros((EPISODES, STEPS, cfg.output_features["action"].shape[0]), np.float32)

    def predict(batch, leftover: Optional[torch.Tensor]) -> torch.Tensor:
        if not rtc:
            return policy.predict_action_chunk(batch)
        return policy.predict_action_chunk(batch, inference_delay=delay, prev_chunk_left_over=leftover)

    for e in range(EPISODES):
        policy.reset()
        pre.reset()
        post.reset()
        cursor, chunk, pending = end, None, None
        for t in range(STEPS):
            noise.at(e, int(seeds[e]), t)
            batch = pre(prepare_observation_for_inference(observation(fx, inputs, e, t), device,
                                                          str(inputs["task"][e, t]), None))
            if cursor == end:
                if pending is None:
                    chunk, cursor = predict(batch, None), 0
                else:
                    chunk, pending, cursor = pending, None, delay
            if delay and cursor == horizon:
                leftover = None
                if rtc:
                    leftover = normalize_leftover(chunk[0, horizon:], target_steps=fx.rtc.execution_horizon)
                pending = predict(batch, leftover)
            with torch.no_grad():
                action = post(chunk[:, cursor])
            cursor += 1
            actions[e, t] = action.reshape(-1).numpy()
    return actions, horizon


# --- files ----------------------------------------------------------------------------------------

def save_checkpoint(fx: Fixture, directory: Path) -> None:
    torch.manual_seed(fx.seed)
    cfg = fx.config()
    policy = fx.policy_cls(cfg)
    pattern_weights_(policy, fx.seed)
    stats = {k: {s: torch.from_numpy(v) for s, v in d.items()} for k, d in fx.stats.items()}
    pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
    policy.save_pretrained(directory)
    pre.save_pretrained(directory)
    post.save_pretrained(directory)


def versions() -> Dict[str, str]:
    import platform

    import lerobot
    import tokenizers
    import transformers
    return {"lerobot": lerobot.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "numpy": np.__version__, "python": platform.python_version()}


def sensitivity(fx: Fixture, directory: Path, inputs: Dict[str, np.ndarray], seeds: np.ndarray) -> Dict[str, float]:
    """How far the first chunk moves (max abs, normalised) when the task, a camera or the
    state changes: the fixture must not be blind to any input."""
    policy, pre, _, noise = load(fx, directory)

    def chunk(obs: Dict[str, np.ndarray], task: str) -> torch.Tensor:
        noise.at(0, int(seeds[0]), 0)
        with torch.inference_mode():
            batch = pre(prepare_observation_for_inference(dict(obs), torch.device("cpu"), task, None))
            return policy.predict_action_chunk(batch)

    obs = observation(fx, inputs, 0, 0)
    base = chunk(obs, "pick up the red cube")
    out = {"task": float((chunk(obs, "close the drawer") - base).abs().max())}
    for key in fx.inputs:
        moved = dict(obs)
        moved[key] = observation(fx, inputs, 1, 50)[key]
        out[key] = float((chunk(moved, "pick up the red cube") - base).abs().max())
    return out


def make(fx: Fixture, vocab_size: int) -> None:
    target = OUT / fx.name
    target.mkdir(parents=True, exist_ok=True)
    inputs = make_inputs(fx)
    seeds = np.asarray([1000 * fx.seed + e for e in range(EPISODES)], np.int64)
    with tempfile.TemporaryDirectory() as tmp, scaled_pi(TINY):
        directory = Path(tmp) / "pretrained_model"
        save_checkpoint(fx, directory)
        actions = select_action_rollout(fx, directory, inputs, seeds)
        moved = sensitivity(fx, directory, inputs, seeds)
        async_out: Dict[str, np.ndarray] = {}
        horizons: List[int] = []
        for delay in fx.delays:
            plain, horizon = async_rollout(fx, directory, inputs, seeds, delay, rtc=False)
            guided, _ = async_rollout(fx, directory, inputs, seeds, delay, rtc=True)
            async_out[f"action_d{delay}"], async_out[f"action_d{delay}_rtc"] = plain, guided
            horizons.append(horizon)
            print(f"{fx.name} d={delay}: e={horizon}, RTC moves the actions by up to "
                  f"{float(np.abs(guided - plain).max()):.3g}")
        sync_check, _ = async_rollout(fx, directory, inputs, seeds, 0, rtc=False)
        assert np.array_equal(sync_check.view(np.uint32), actions.view(np.uint32)), \
            f"{fx.name}: the d = 0 loop is not select_action's"
        tar_xz(directory, target / "pretrained_model.tar.xz")
        cfg = fx.config()
    np.savez_compressed(target / "inputs.npz", seeds=seeds, **inputs)
    np.savez_compressed(target / "outputs.npz", action=actions)
    np.savez_compressed(target / "async.npz", delays=np.asarray(fx.delays, np.int64),
                        horizons=np.asarray(horizons, np.int64), **async_out)
    meta = {"versions": versions(), "numerics": LEVEL, "episodes": EPISODES, "steps": STEPS,
            "policy": fx.policy_cls.name, "inputs": {k: list(v) for k, v in fx.inputs.items()},
            "tasks": [[list(change) for change in episode] for episode in TASKS],
            "scaled": {"variants": {k: asdict(v) for k, v in TINY.variants.items()}, "vision": asdict(TINY.vision),
                       "vocab_size": TINY.vocab_size, "tokenizer_vocab": vocab_size},
            "chunk_size": cfg.chunk_size, "n_action_steps": cfg.n_action_steps,
            "delays": list(fx.delays), "horizons": horizons,
            "rtc": {"prefix_attention_schedule": str(fx.rtc.prefix_attention_schedule),
                    "max_guidance_weight": fx.rtc.max_guidance_weight,
                    "execution_horizon": fx.rtc.execution_horizon},
            "noise": "counter_normal((seed, step), (chunk_size, max_action_dim)) at each step that plans",
            "first_chunk_moved_by": moved}
    (target / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"{fx.name}: actions {actions.shape}, per-dim std min {float(actions.std(axis=(0, 1)).min()):.3f}, "
          f"first chunk moved by {moved}")


def main(argv: List[str]) -> None:
    torch.set_num_threads(1)
    vocab_size = stage_tokenizer()
    wanted = set(argv)
    try:
        for factory in FIXTURES:
            fx = factory()
            if not wanted or fx.name in wanted:
                make(fx, vocab_size)
    finally:
        shutil.rmtree(_HF_HOME, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
