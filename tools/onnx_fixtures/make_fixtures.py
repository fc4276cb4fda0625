"""Make the ONNX fixtures under test/fixtures/onnx/<name>/ (see README.md).

Run once, in an environment with rsl_rl and sb3-contrib (not the project's), from the
repository root:

    /work/onnx-fixtures-venv/bin/python tools/onnx_fixtures/make_fixtures.py [NAME ...]

Fixtures:

- ``rsl_rl_lstm``: an rsl_rl (rsl-rl-lib) recurrent actor-critic for a 12-joint quadruped
  (actor and critic ``RNNModel``, LSTM, Gaussian output, an empirical observation
  normaliser with statistics learnt from seeded batches), weights perturbed from their
  seeded initialisation, exported as Isaac Lab's ``export_policy_as_onnx`` does: the
  actor's normaliser, its LSTM and its MLP head in one module taking
  ``(obs, h_in, c_in)`` and returning ``(actions, h_out, c_out)``, ``torch.onnx.export``
  with ``opset_version=11``, ``dynamic_axes={}`` and the TorchScript exporter (what that
  call ran on the torch versions Isaac Lab releases pin; torch 2.13's default exporter
  writes opset 18 with an external data file instead: ``rsl_rl_lstm_dynamo``).
- ``rsl_rl_lstm_dynamo``: the same module exported by that call as torch 2.13 runs it
  (``dynamo=True``): opset 18, the weights in ``policy.onnx.data`` beside the model.
- ``sb3_lstm``: an sb3-contrib ``RecurrentPPO`` ``MlpLstmPolicy`` on a 48-dimensional
  observation and 12 actions, its actor exported with the inputs sb3 keeps for a
  recurrent policy, ``(obs, lstm_h, lstm_c, episode_starts)`` -> ``(actions, lstm_h_out,
  lstm_c_out)``, the state reset by ``(1 - episode_starts)`` as sb3-contrib's
  ``_process_sequence`` does.

Each fixture holds ``policy.onnx`` (and its data file), ``trace.npz`` and ``meta.json``.
``trace.npz``: 2 episodes of 40 steps of sensor values as a robot would send them
(``joint_position`` / ``joint_velocity`` [E, T, 12] in the robot's URDF joint order,
``imu_orientation`` [E, T, 4] (x, y, z, w), ``imu_angular_velocity`` [E, T, 3],
``command`` [E, T, 3] (Twist linear.x, linear.y, angular.z), ``base_linear_velocity``
[E, T, 3] (TwistStamped twist.linear)), the observation Isaac Lab's terms make of them
(``obs`` [E, T, 48], float32, computed here in numpy from the term definitions below),
and what a plain ``onnxruntime.InferenceSession.run`` loop answers, feeding h, c and the
last action back (``actions``, ``h``, ``c``), plus the torch module's own actions
(``torch_actions``) for the export's accuracy. The observation terms, scales and defaults
are those of ``config/onnx_quadruped.yaml``; meta.json repeats them with the versions.
"""
from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path
from typing import Callable, Dict

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "test" / "fixtures" / "onnx"
EPISODES, STEPS = 2, 40
SEED = 20261201
OBS_DIM, ACTIONS = 48, 12

# Isaac Lab's joint order for a Go2-like quadruped (its articulation's breadth-first order)
POLICY_JOINTS = [f"{leg}_{part}_joint" for part in ("hip", "thigh", "calf") for leg in ("FL", "FR", "RL", "RR")]
# the order the robot's joint_state_broadcaster publishes (URDF order, leg by leg)
ROBOT_JOINTS = [f"{leg}_{part}_joint" for leg in ("FL", "FR", "RL", "RR") for part in ("hip", "thigh", "calf")]
DEFAULT_JOINT_POS = np.array([0.1, -0.1, 0.1, -0.1, 0.8, 0.8, 1.0, 1.0, -1.5, -1.5, -1.5, -1.5], np.float32)
# the observation terms (Isaac Lab's velocity-tracking PolicyCfg order) and their modifiers
SCALES = {"base_lin_vel": 2.0, "base_ang_vel": 0.25, "projected_gravity": 1.0,
          "velocity_commands": np.array([2.0, 2.0, 0.25], np.float32), "joint_pos": 1.0, "joint_vel": 0.05,
          "actions": 1.0}
CLIPS = {"base_lin_vel": (-5.0, 5.0), "actions": (-10.0, 10.0)}
ACTION_SCALE = 0.25


def to_policy_order(values: np.ndarray) -> np.ndarray:
    return values[..., [ROBOT_JOINTS.index(name) for name in POLICY_JOINTS]]


def projected_gravity(q_xyzw: np.ndarray) -> np.ndarray:
    """Isaac Lab's ``quat_apply_inverse(q, (0, 0, -1))`` written out for the gravity vector:
    (2(wy - xz), -2(wx + yz), 2(x^2 + y^2) - 1), float32, in this operation order."""
    x, y, z, w = (q_xyzw[..., i] for i in range(4))
    two = np.float32(2.0)
    return np.stack([two * (w * y - x * z), -two * (w * x + y * z), two * (x * x + y * y) - np.float32(1.0)], axis=-1)


def term(values: np.ndarray, name: str, offset=None) -> np.ndarray:
    """(values - offset), clipped, then scaled: Isaac Lab's order (clip before scale)."""
    out = values.astype(np.float32)
    if offset is not None:
        out = out - offset
    if name in CLIPS:
        out = np.clip(out, np.float32(CLIPS[name][0]), np.float32(CLIPS[name][1]))
    return out * np.float32(SCALES[name]) if np.ndim(SCALES[name]) == 0 else out * SCALES[name]


def observation(sensors: Dict[str, np.ndarray], t: int, e: int, last_action: np.ndarray) -> np.ndarray:
    at = {k: v[e, t] for k, v in sensors.items()}
    return np.concatenate([
        term(at["base_linear_velocity"], "base_lin_vel"),
        term(at["imu_angular_velocity"], "base_ang_vel"),
        term(projected_gravity(at["imu_orientation"]), "projected_gravity"),
        term(at["command"], "velocity_commands"),
        term(to_policy_order(at["joint_position"]), "joint_pos", DEFAULT_JOINT_POS),
        term(to_policy_order(at["joint_velocity"]), "joint_vel"),
        term(last_action, "actions"),
    ]).astype(np.float32)


def sensors(seed: int) -> Dict[str, np.ndarray]:
    """Seeded sensor streams: joints wander around the default pose, the base tilts a
    little (unit quaternions), commands hold for 10 steps."""
    rng = np.random.default_rng(seed)
    shape = (EPISODES, STEPS)
    robot_default = DEFAULT_JOINT_POS[[POLICY_JOINTS.index(n) for n in ROBOT_JOINTS]]
    walk = np.cumsum(rng.normal(0.0, 0.03, size=(*shape, 12)), axis=1)
    axis = rng.normal(size=(*shape, 3))
    axis /= np.linalg.norm(axis, axis=-1, keepdims=True)
    angle = 0.2 * np.tanh(np.cumsum(rng.normal(0.0, 0.05, size=shape), axis=1))[..., None]
    quat = np.concatenate([axis * np.sin(angle / 2), np.cos(angle / 2)], axis=-1)
    command = np.repeat(rng.uniform([-1.0, -0.5, -1.0], [1.0, 0.5, 1.0], size=(EPISODES, STEPS // 10, 3)), 10, axis=1)
    return {"joint_position": (robot_default + walk).astype(np.float32),
            "joint_velocity": rng.normal(0.0, 2.0, size=(*shape, 12)).astype(np.float32),
            "imu_orientation": quat.astype(np.float32),
            "imu_angular_velocity": rng.normal(0.0, 0.5, size=(*shape, 3)).astype(np.float32),
            "command": command.astype(np.float32),
            "base_linear_velocity": (command * 0.8 + rng.normal(0.0, 0.1, size=(*shape, 3))).astype(np.float32)}


def perturb(module: nn.Module, generator: torch.Generator) -> None:
    """Every float parameter moved off its initialisation by noise of its own scale, so
    that no layer is the identity or zero (biases start at zero, log-std at a constant)."""
    with torch.no_grad():
        for p in module.parameters():
            scale = float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 0.1
            p.add_(torch.randn(p.shape, generator=generator) * 0.5 * scale)


# --- rsl_rl ----------------------------------------------------------------------------------------

def rsl_rl_actor() -> nn.Module:
    """The actor of an rsl_rl recurrent actor-critic (rsl-rl-lib 5: actor and critic
    ``RNNModel``s, as its PPO runner builds them), normaliser statistics learnt from seeded
    batches, weights perturbed."""
    from rsl_rl.models import RNNModel
    from tensordict import TensorDict
    torch.manual_seed(SEED)
    obs = TensorDict({"policy": torch.zeros(8, OBS_DIM), "critic": torch.zeros(8, OBS_DIM + 3)}, batch_size=[8])
    groups = {"actor": ["policy"], "critic": ["critic"]}
    common = dict(hidden_dims=[64, 64], activation="elu", obs_normalization=True, rnn_type="lstm",
                  rnn_hidden_dim=64, rnn_num_layers=1)
    actor = RNNModel(obs, groups, "actor", ACTIONS, distribution_cfg={"class_name": "GaussianDistribution",
                                                                       "init_std": 1.0}, **common)
    critic = RNNModel(obs, groups, "critic", 1, **common)
    generator = torch.Generator().manual_seed(SEED + 1)
    for model in (actor, critic):
        perturb(model, generator)
        model.train()
        for _ in range(20):          # the normaliser learns mean / variance as in training
            batch = torch.randn(256, model.obs_dim, generator=generator) * 1.5 + 0.3
            model.update_normalization(TensorDict({"policy": batch[:, :OBS_DIM], "critic": batch}, batch_size=[256]))
        model.eval()
    return actor


class IsaacLabOnnxExporter(nn.Module):
    """What Isaac Lab's ``_OnnxPolicyExporter`` holds for a recurrent policy: copies of
    the normaliser, the LSTM and the actor head; ``forward_lstm`` as it writes it."""

    def __init__(self, actor: nn.Module):
        super().__init__()
        import copy
        self.normalizer = copy.deepcopy(actor.obs_normalizer)
        self.rnn = copy.deepcopy(actor.rnn.rnn)
        self.actor = copy.deepcopy(actor.mlp)

    def forward(self, x_in, h_in, c_in):
        x_in = self.normalizer(x_in)
        x, (h, c) = self.rnn(x_in.unsqueeze(0), (h_in, c_in))
        x = x.squeeze(0)
        return self.actor(x), h, c

    def export(self, path: Path, dynamo: bool) -> None:
        self.to("cpu").eval()
        obs = torch.zeros(1, self.rnn.input_size)
        h_in = torch.zeros(self.rnn.num_layers, 1, self.rnn.hidden_size)
        c_in = torch.zeros(self.rnn.num_layers, 1, self.rnn.hidden_size)
        torch.onnx.export(self, (obs, h_in, c_in), str(path), export_params=True, opset_version=11, verbose=False,
                          input_names=["obs", "h_in", "c_in"], output_names=["actions", "h_out", "c_out"],
                          dynamic_axes={}, dynamo=dynamo)


# --- sb3-contrib -------------------------------------------------------------------------------------

class Sb3RecurrentActor(nn.Module):
    """The actor of a RecurrentPPO MlpLstmPolicy with its state made explicit, as
    sb3-contrib's ``_process_sequence`` runs one step: the state is multiplied by
    ``1 - episode_starts`` before the LSTM; the deterministic action is the action net's mean."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, obs, lstm_h, lstm_c, episode_starts):
        policy = self.policy
        features = policy.extract_features(obs, policy.pi_features_extractor)
        keep = (1.0 - episode_starts).view(1, 1, 1)
        latent, (h, c) = policy.lstm_actor(features.unsqueeze(0), (keep * lstm_h, keep * lstm_c))
        latent = policy.mlp_extractor.forward_actor(latent.squeeze(0))
        return policy.action_net(latent), h, c


def sb3_actor() -> nn.Module:
    import gymnasium as gym
    from sb3_contrib import RecurrentPPO

    class Quadruped(gym.Env):
        observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
        action_space = gym.spaces.Box(-1.0, 1.0, (ACTIONS,), np.float32)

    model = RecurrentPPO("MlpLstmPolicy", Quadruped(), seed=SEED, device="cpu",
                         policy_kwargs={"lstm_hidden_size": 32, "net_arch": [64, 64]})
    perturb(model.policy, torch.Generator().manual_seed(SEED + 2))
    return Sb3RecurrentActor(model.policy.eval()).eval()


# --- running and writing ---------------------------------------------------------------------------

def ort_loop(path: Path, stream: Dict[str, np.ndarray], state_names, episode_start: bool):
    """A plain InferenceSession.run loop: the observation from the sensors and the last
    action, h and c fed back, the state zero at each episode's start."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    rows = {"obs": [], "actions": [], "h": [], "c": []}
    for e in range(EPISODES):
        h = np.zeros(shapes[state_names[0]], np.float32)
        c = np.zeros(shapes[state_names[1]], np.float32)
        last = np.zeros(ACTIONS, np.float32)
        for t in range(STEPS):
            obs = observation(stream, t, e, last)
            feeds = {"obs": obs[None], state_names[0]: h, state_names[1]: c}
            if episode_start:
                feeds["episode_starts"] = np.array([1.0 if t == 0 else 0.0], np.float32)
            actions, h, c = session.run(None, feeds)
            last = actions[0]
            for key, value in (("obs", obs), ("actions", last), ("h", h), ("c", c)):
                rows[key].append(value)
    return {k: np.stack(v).reshape(EPISODES, STEPS, *v[0].shape) for k, v in rows.items()}


def torch_loop(module: nn.Module, obs: np.ndarray, hidden: int, layers: int, episode_start: bool) -> np.ndarray:
    out = []
    with torch.inference_mode():
        for e in range(EPISODES):
            h = torch.zeros(layers, 1, hidden)
            c = torch.zeros(layers, 1, hidden)
            for t in range(STEPS):
                args = [torch.from_numpy(obs[e, t][None]), h, c]
                if episode_start:
                    args.append(torch.tensor([1.0 if t == 0 else 0.0]))
                actions, h, c = module(*args)
                out.append(actions[0].numpy())
    return np.stack(out).reshape(EPISODES, STEPS, ACTIONS)


def write(name: str, export: Callable[[Path], None], module: nn.Module, state_names, hidden: int, layers: int,
          episode_start: bool, source: dict) -> None:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("policy.onnx*"):
        old.unlink()
    path = folder / "policy.onnx"
    export(path)
    stream = sensors(SEED)
    trace = ort_loop(path, stream, state_names, episode_start)
    torch_actions = torch_loop(module, trace["obs"], hidden, layers, episode_start)
    np.savez_compressed(folder / "trace.npz", **stream, **trace, torch_actions=torch_actions)
    model = onnx.load(str(path))
    files = sorted(p.name for p in folder.glob("policy.onnx*"))
    meta = {"fixture": name, "source": source, "episodes": EPISODES, "steps": STEPS, "seed": SEED,
            "files": {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in files},
            "opset": [{"domain": o.domain, "version": o.version} for o in model.opset_import],
            "inputs": [i.name for i in model.graph.input], "outputs": [o.name for o in model.graph.output],
            "ops": sorted({n.op_type for n in model.graph.node}),
            "torch_vs_onnxruntime_max_abs": float(np.abs(torch_actions - trace["actions"]).max()),
            "policy_joints": POLICY_JOINTS, "robot_joints": ROBOT_JOINTS,
            "default_joint_pos": DEFAULT_JOINT_POS.tolist(), "action_scale": ACTION_SCALE,
            "scales": {k: np.asarray(v).tolist() for k, v in SCALES.items()}, "clips": CLIPS,
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
                         "onnxruntime": ort.__version__, "numpy": np.__version__, **source.get("versions", {})}}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{name}: {', '.join(f'{f} {(folder / f).stat().st_size} B' for f in files)}; torch vs ORT max |diff| "
          f"{meta['torch_vs_onnxruntime_max_abs']:.3g}")


def main(names) -> int:
    import importlib.metadata as md
    torch.set_num_threads(1)
    actor = rsl_rl_actor()
    exporter = IsaacLabOnnxExporter(actor).eval()
    rsl = {"library": "rsl-rl-lib", "model": "RNNModel (lstm 64, mlp [64, 64], elu, obs_normalization)",
           "exporter": "Isaac Lab export_policy_as_onnx (opset 11, dynamic_axes {})",
           "versions": {"rsl-rl-lib": md.version("rsl-rl-lib")}}
    fixtures = {
        "rsl_rl_lstm": lambda: write("rsl_rl_lstm", lambda p: exporter.export(p, dynamo=False), exporter,
                                     ("h_in", "c_in"), 64, 1, False, {**rsl, "torch_onnx_exporter": "torchscript"}),
        "rsl_rl_lstm_dynamo": lambda: write("rsl_rl_lstm_dynamo", lambda p: exporter.export(p, dynamo=True), exporter,
                                            ("h_in", "c_in"), 64, 1, False, {**rsl, "torch_onnx_exporter": "dynamo"}),
        "sb3_lstm": lambda: _sb3(),
    }

    def _sb3():
        module = sb3_actor()
        source = {"library": "sb3-contrib", "model": "RecurrentPPO MlpLstmPolicy (lstm 32, net_arch [64, 64])",
                  "exporter": "torch.onnx.export of the actor with explicit state (opset 17, TorchScript exporter)",
                  "versions": {"sb3-contrib": md.version("sb3-contrib"),
                               "stable-baselines3": md.version("stable-baselines3")}}

        def export(path: Path) -> None:
            dummy = (torch.zeros(1, OBS_DIM), torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), torch.zeros(1))
            torch.onnx.export(module, dummy, str(path), opset_version=17, dynamo=False,
                              input_names=["obs", "lstm_h", "lstm_c", "episode_starts"],
                              output_names=["actions", "lstm_h_out", "lstm_c_out"])
        write("sb3_lstm", export, module, ("lstm_h", "lstm_c"), 32, 1, True, source)

    for name in names or fixtures:
        fixtures[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
