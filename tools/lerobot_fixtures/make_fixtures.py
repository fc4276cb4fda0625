"""Make the LeRobot parity fixtures under test/fixtures/lerobot/<name>/ (see README.md).

Run once, in an environment with LeRobot (not the project's), from the repository root:

    PYTHONPATH=. /work/lerobot-venv/bin/python tools/lerobot_fixtures/make_fixtures.py

For each fixture: build the policy from a small seeded config, overwrite its random
weights with a low-entropy pattern (so the checkpoint compresses to kilobytes), save it
with LeRobot's own ``save_pretrained`` (model, config, pre/post-processors and their
normalisation stats), load it back the way LeRobot's eval/record do
(``from_pretrained`` + ``make_pre_post_processors(pretrained_path=...)``), and drive it with
``lerobot.utils.control_utils.predict_action`` over 3 episodes of 300 steps, with
``reset()`` between episodes. Diffusion's sampling noise is replaced by capsule_ros's
counter-based draws (``capsule_ros.runtime.rng.counter_normal``) so that both
implementations see the same noise.

Files written per fixture (no pickle anywhere):
- ``pretrained_model.tar.xz``: the ``pretrained_model/`` directory exactly as LeRobot wrote it;
- ``inputs.npz``: one array per input feature, [episodes, steps, *port shape] (images
  uint8 [H, W, 3] RGB, as a camera port delivers them), and ``seeds`` int64[episodes];
- ``outputs.npz``: ``action`` float32 [episodes, steps, action_dim] (LeRobot's
  postprocessed actions) and, for Diffusion, every noise draw: ``noise`` float32
  [draws, inference_steps + 1, horizon, action_dim] with ``noise_at`` int64 [draws, 2]
  (episode, step);
- ``meta.json``: the versions, the fixture's config overrides, the port map.
"""
from __future__ import annotations

import io
import json
import math
import platform
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import lerobot
import numpy as np
import torch
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.act.modeling_act import ACTPolicy
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
from lerobot.policies.factory import make_pre_post_processors

try:                                                   # LeRobot 0.5+
    from lerobot.common.control_utils import predict_action
except ImportError:                                    # LeRobot 0.4
    from lerobot.utils.control_utils import predict_action

from capsule_ros.runtime.rng import counter_normal

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "test" / "fixtures" / "lerobot"
EPISODES, STEPS = 3, 300
PATTERN_PERIOD = 1021          # prime: each output filter of a tiled tensor sees a different shift
PATTERN_LEVELS = np.array([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25)   # zero mean, unit variance
DERIVED_BUFFERS = ("vae_encoder_pos_enc", "pos_grid")                   # fixed functions of the shape


@dataclass
class Fixture:
    """One checkpoint and its rollout."""

    name: str
    policy_cls: type
    config: Callable[[], object]
    stats: Dict[str, Dict[str, np.ndarray]]
    seed: int
    # per input feature: ("walk", n[, constant dims]) or ("camera", h, w)
    inputs: Dict[str, tuple] = field(default_factory=dict)


# --- inputs ------------------------------------------------------------------------------------

def random_walk(rng: np.random.Generator, steps: int, dim: int, constant: Tuple[int, ...] = ()) -> np.ndarray:
    """A smooth float32 walk [steps, dim]: momentum-driven, mean-reverting; ``constant``
    dims hold 0.25 (a joint that never moves: exercises min == max statistics)."""
    x = np.zeros((steps, dim))
    pos, vel = rng.normal(0, 0.5, dim), np.zeros(dim)
    for t in range(steps):
        vel = 0.8 * vel + rng.normal(0, 0.05, dim) - 0.02 * pos
        pos = pos + vel
        x[t] = pos
    x[:, list(constant)] = 0.25
    return x.astype(np.float32)


def camera_frames(rng: np.random.Generator, steps: int, h: int, w: int) -> np.ndarray:
    """uint8 RGB frames [steps, h, w, 3]: a textured scene panned by a random walk, with a
    bright object moving over it (real variation that still compresses: rows repeat)."""
    low = rng.uniform(0, 255, (h // 4 + 8, w // 4 + 8, 3))
    scene = np.kron(low, np.ones((4, 4, 1)))                         # blocky base
    scene = (scene + np.roll(scene, 1, 0) + np.roll(scene, 1, 1) + np.roll(scene, (1, 1), (0, 1))) / 4
    scene += rng.normal(0, 12, scene.shape)                          # fine texture
    scene = np.clip(scene, 0, 255).astype(np.uint8)
    max_dy, max_dx = scene.shape[0] - h, scene.shape[1] - w
    cam = np.array([max_dy // 2, max_dx // 2])
    obj = np.array([h / 2, w / 2])
    obj_vel = np.zeros(2)
    colour = rng.integers(150, 256, 3).astype(np.uint8)
    frames = np.empty((steps, h, w, 3), np.uint8)
    for t in range(steps):
        cam = np.clip(cam + rng.integers(-1, 2, 2), 0, [max_dy, max_dx])
        obj_vel = 0.9 * obj_vel + rng.normal(0, 0.4, 2)
        obj = np.clip(obj + obj_vel, [4, 4], [h - 12, w - 12])
        frame = scene[cam[0]:cam[0] + h, cam[1]:cam[1] + w].copy()
        y, x = int(obj[0]), int(obj[1])
        frame[y:y + 8, x:x + 8] = colour
        frames[t] = frame
    return frames


def make_inputs(fx: Fixture) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(fx.seed)
    out: Dict[str, np.ndarray] = {}
    for key, spec in fx.inputs.items():
        if spec[0] == "camera":
            out[key] = np.stack([camera_frames(rng, STEPS, spec[1], spec[2]) for _ in range(EPISODES)])
        else:
            constant = spec[2] if len(spec) > 2 else ()
            out[key] = np.stack([random_walk(rng, STEPS, spec[1], constant) for _ in range(EPISODES)])
    return out


# --- weights ------------------------------------------------------------------------------------

def pattern_weights_(policy: torch.nn.Module, seed: int) -> None:
    """Overwrite every float parameter and buffer with a low-entropy pattern at its own scale.

    Each tensor becomes ``offset + scale * L[p]``: ``L`` four unit-variance levels, ``p`` a
    random sequence of period ``PATTERN_PERIOD`` tiled over the flattened tensor. ``scale``
    is the tensor's random-init std (so activations keep their usual magnitudes); tensors
    initialised to a constant c (norm weights and biases, batch-norm statistics) become
    ``c + 0.1 * L[p]``. Buffers that are fixed functions of the shape (positional grids)
    are kept. The result varies per element and per output channel, but a tar.xz of the
    checkpoint is tens of kilobytes instead of ~45 MB for a resnet18.
    """
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, tensor in sorted(policy.state_dict(keep_vars=True).items()):
            if not tensor.is_floating_point() or name.split(".")[-1] in DERIVED_BUFFERS:
                continue
            flat = tensor.detach().reshape(-1)
            n = flat.numel()
            period = rng.choice(PATTERN_LEVELS, size=min(n, PATTERN_PERIOD))
            tiled = torch.from_numpy(np.resize(period, n)).to(tensor.dtype)
            std = float(flat.std()) if n > 1 else 0.0
            if std > 0:
                value = float(flat.mean()) + std * tiled
            else:
                value = float(flat[0]) + 0.1 * tiled
            tensor.data.copy_(value.reshape(tensor.shape))


# --- noise injection ------------------------------------------------------------------------------

class CounterNoise:
    """Feeds Diffusion's sampling from capsule_ros's counter-based RNG.

    capsule_ros draws, at the step that refills the action queue, ONE block
    ``counter_normal((seed, step), (inference_steps + 1, horizon, action_dim))``: row 0 is
    the initial sample, row k + 1 the variance noise of denoising step k (the row of the
    last step, t = 0, is drawn but unused by DDPM; DDIM with eta = 0 uses row 0 only).
    This wraps ``DiffusionModel.conditional_sample`` to pass row 0 as ``noise`` and
    replaces the scheduler module's ``randn_tensor`` with the following rows, in order.
    """

    def __init__(self, policy: DiffusionPolicy):
        import diffusers.schedulers.scheduling_ddpm as ddpm
        self.policy = policy
        self.model = policy.diffusion
        self.ddpm = ddpm
        self.rng_state = torch.zeros(2, dtype=torch.int64)
        self.draws: List[np.ndarray] = []
        self.draw_at: List[Tuple[int, int]] = []
        self.episode = 0
        self._rows: List[torch.Tensor] = []
        original = self.model.conditional_sample
        ddpm.randn_tensor = self._variance_noise

        def conditional_sample(batch_size, global_cond=None, generator=None, noise=None):
            assert noise is None and batch_size == 1
            cfg = self.model.config
            block = counter_normal(self.rng_state, (self.model.num_inference_steps + 1, cfg.horizon,
                                                    cfg.action_feature.shape[0]))
            self.draws.append(block.numpy().copy())
            self.draw_at.append((self.episode, int(self.rng_state[1])))
            self._rows = [row[None] for row in block[1:]]
            sample = original(batch_size, global_cond=global_cond, generator=generator, noise=block[0][None].clone())
            used = self.model.num_inference_steps - len(self._rows)
            expected = self.model.num_inference_steps - 1 if cfg.noise_scheduler_type == "DDPM" else 0
            assert used == expected, f"scheduler drew {used} noise tensors, expected {expected}"
            return sample

        self.model.conditional_sample = conditional_sample

    def _variance_noise(self, shape, generator=None, device=None, dtype=None, layout=None):
        row = self._rows.pop(0)
        assert tuple(row.shape) == tuple(shape), (row.shape, shape)
        return row.to(device=device, dtype=dtype)

    def at(self, episode: int, seed: int, step: int) -> None:
        """The arena's rng buffer at this step: (seed, counter = steps since reset)."""
        self.episode = episode
        self.rng_state = torch.tensor([seed & 0xFFFFFFFF, step], dtype=torch.int64)


# --- fixtures -------------------------------------------------------------------------------------

def _features(inputs: Dict[str, tuple], action_dim: int):
    feats = {}
    for key, spec in inputs.items():
        if spec[0] == "camera":
            feats[key] = PolicyFeature(FeatureType.VISUAL, (3, spec[1], spec[2]))
        elif key == "observation.environment_state":
            feats[key] = PolicyFeature(FeatureType.ENV, (spec[1],))
        else:
            feats[key] = PolicyFeature(FeatureType.STATE, (spec[1],))
    return feats, {"action": PolicyFeature(FeatureType.ACTION, (action_dim,))}


def _vec(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


IMAGE_STATS = {"mean": _vec([0.48, 0.45, 0.40]).reshape(3, 1, 1), "std": _vec([0.23, 0.22, 0.25]).reshape(3, 1, 1),
               "min": np.zeros((3, 1, 1), np.float32), "max": np.ones((3, 1, 1), np.float32)}


def act_queue() -> Fixture:
    inputs = {"observation.state": ("walk", 6), "observation.images.front": ("camera", 48, 64)}
    feats, outs = _features(inputs, 5)
    return Fixture(
        name="act_queue", policy_cls=ACTPolicy, seed=11, inputs=inputs,
        config=lambda: ACTConfig(
            input_features=feats, output_features=outs, chunk_size=10, n_action_steps=5, dim_model=64, n_heads=4,
            dim_feedforward=128, n_encoder_layers=1, n_decoder_layers=1, n_vae_encoder_layers=1, latent_dim=8,
            pretrained_backbone_weights=None, device="cpu"),
        stats={"observation.state": {"mean": _vec([0.1, -0.2, 0.0, 0.3, -0.1, 0.05]),
                                     "std": _vec([0.8, 1.2, 0.5, 1.0, 0.9, 1.5])},
               "observation.images.front": IMAGE_STATS,
               "action": {"mean": _vec([0.2, -0.1, 0.0, 0.5, -0.3]), "std": _vec([0.5, 1.0, 2.0, 0.7, 1.3])}})


def act_ensemble() -> Fixture:
    inputs = {"observation.state": ("walk", 4), "observation.environment_state": ("walk", 7)}
    feats, outs = _features(inputs, 3)
    return Fixture(
        name="act_ensemble", policy_cls=ACTPolicy, seed=12, inputs=inputs,
        config=lambda: ACTConfig(
            input_features=feats, output_features=outs, chunk_size=8, n_action_steps=1, temporal_ensemble_coeff=0.01,
            dim_model=64, n_heads=4, dim_feedforward=128, n_encoder_layers=1, n_decoder_layers=1,
            n_vae_encoder_layers=1, latent_dim=8, pretrained_backbone_weights=None, device="cpu"),
        stats={"observation.state": {"mean": _vec([0.0, 0.1, -0.1, 0.2]), "std": _vec([1.0, 0.7, 1.1, 0.9])},
               "observation.environment_state": {"mean": _vec([0.05] * 7),
                                                 "std": _vec([0.6, 0.8, 1.0, 1.2, 0.9, 1.1, 0.7])},
               "action": {"mean": _vec([0.3, -0.2, 0.1]), "std": _vec([0.9, 1.4, 0.6])}})


def diffusion_ddpm() -> Fixture:
    inputs = {"observation.state": ("walk", 5, (4,)), "observation.images.front": ("camera", 48, 64)}
    feats, outs = _features(inputs, 4)
    return Fixture(
        name="diffusion", policy_cls=DiffusionPolicy, seed=13, inputs=inputs,
        config=lambda: DiffusionConfig(
            input_features=feats, output_features=outs, n_obs_steps=2, horizon=16, n_action_steps=8,
            crop_shape=(42, 57), down_dims=(32, 64, 128), kernel_size=5, n_groups=8, diffusion_step_embed_dim=32,
            spatial_softmax_num_keypoints=16, noise_scheduler_type="DDPM", num_inference_steps=10, device="cpu"),
        stats={"observation.state": {"min": _vec([-1.5, -1.0, -2.0, -1.2, 0.25]),
                                     "max": _vec([1.5, 1.2, 2.0, 0.8, 0.25])},
               "observation.images.front": IMAGE_STATS,
               "action": {"min": _vec([-1.0, -2.0, 0.0, -0.5]), "max": _vec([1.0, 2.0, 3.0, 0.5])}})


def diffusion_ddim_env() -> Fixture:
    """Diffusion without a camera: DDIM, sample prediction, no clipping, 3 observation steps."""
    inputs = {"observation.state": ("walk", 3), "observation.environment_state": ("walk", 4)}
    feats, outs = _features(inputs, 2)
    return Fixture(
        name="diffusion_ddim_env", policy_cls=DiffusionPolicy, seed=14, inputs=inputs,
        config=lambda: DiffusionConfig(
            input_features=feats, output_features=outs, n_obs_steps=3, horizon=8, n_action_steps=4,
            down_dims=(16, 32), kernel_size=3, n_groups=4, diffusion_step_embed_dim=16,
            noise_scheduler_type="DDIM", num_inference_steps=5, prediction_type="sample", clip_sample=False,
            beta_schedule="linear", device="cpu"),
        stats={"observation.state": {"min": _vec([-1.0, -1.5, -2.0]), "max": _vec([1.0, 1.5, 2.0])},
               "observation.environment_state": {"min": _vec([-2.0] * 4), "max": _vec([2.0, 1.0, 2.5, 1.5])},
               "action": {"min": _vec([-1.0, 0.0]), "max": _vec([1.0, 4.0])}})


FIXTURES = (act_queue, act_ensemble, diffusion_ddpm, diffusion_ddim_env)


# --- rollout and files ------------------------------------------------------------------------

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


def rollout(fx: Fixture, directory: Path, inputs: Dict[str, np.ndarray], seeds: np.ndarray):
    """LeRobot's actions for every step (and the noise draws, for Diffusion)."""
    policy = fx.policy_cls.from_pretrained(directory)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(directory))
    noise = CounterNoise(policy) if isinstance(policy, DiffusionPolicy) else None
    device = torch.device("cpu")
    actions = np.zeros((EPISODES, STEPS, policy.config.output_features["action"].shape[0]), np.float32)
    for e in range(EPISODES):
        policy.reset()
        pre.reset()
        post.reset()
        for t in range(STEPS):
            if noise is not None:
                noise.at(e, int(seeds[e]), t)
            observation = {key: inputs[key][e, t].copy() for key in fx.inputs}
            action = predict_action(observation, policy, device, pre, post, use_amp=False)
            actions[e, t] = action.reshape(-1).numpy()
    extra = {}
    if noise is not None:
        extra = {"noise": np.stack(noise.draws).astype(np.float32), "noise_at": np.asarray(noise.draw_at, np.int64)}
    return actions, extra


def tar_xz(directory: Path, target: Path) -> None:
    """A reproducible tar.xz of ``directory`` as ``pretrained_model/`` (sorted, no owners or times)."""
    tar_xz_files([(f"pretrained_model/{path.name}", path) for path in sorted(directory.iterdir())], target)


def tar_xz_tree(root: Path, folders: Tuple[str, ...], target: Path) -> None:
    """A reproducible tar.xz of the files directly in ``root/<folder>`` for each folder, as ``<folder>/<file>``."""
    tar_xz_files([(f"{folder}/{path.name}", path) for folder in folders
                  for path in sorted((root / folder).iterdir())], target)


def tar_xz_files(members: List[Tuple[str, Path]], target: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in members:
            info = tarfile.TarInfo(name)
            data = path.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    import lzma
    target.write_bytes(lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME))


def versions() -> Dict[str, str]:
    import diffusers
    import torchvision
    return {"lerobot": lerobot.__version__, "torch": torch.__version__, "torchvision": torchvision.__version__,
            "diffusers": diffusers.__version__, "numpy": np.__version__, "python": platform.python_version()}


def make(fx: Fixture) -> None:
    target = OUT / fx.name
    target.mkdir(parents=True, exist_ok=True)
    inputs = make_inputs(fx)
    seeds = np.asarray([1000 * fx.seed + e for e in range(EPISODES)], np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "pretrained_model"
        save_checkpoint(fx, directory)
        actions, extra = rollout(fx, directory, inputs, seeds)
        tar_xz(directory, target / "pretrained_model.tar.xz")
    np.savez_compressed(target / "inputs.npz", seeds=seeds, **inputs)
    np.savez_compressed(target / "outputs.npz", action=actions, **extra)
    meta = {"versions": versions(), "episodes": EPISODES, "steps": STEPS, "policy": fx.policy_cls.name,
            "inputs": {k: list(v) for k, v in fx.inputs.items()},
            "noise": ("counter_normal((seed, step), (num_inference_steps + 1, horizon, action_dim)) at each "
                      "refill" if extra else None)}
    (target / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    spread = float(actions.std(axis=(0, 1)).min())
    print(f"{fx.name}: actions {actions.shape}, min per-dim std {spread:.3f}, "
          f"files {sorted(p.name for p in target.iterdir())}")


def main(argv: List[str]) -> None:
    torch.set_num_threads(1)          # the project's runtime default: the closest CPU arithmetic
    wanted = set(argv)
    for factory in FIXTURES:
        fx = factory()
        if not wanted or fx.name in wanted:
            make(fx)


if __name__ == "__main__":
    main(sys.argv[1:])
