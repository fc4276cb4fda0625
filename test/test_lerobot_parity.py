"""capsule_ros's own ACT and Diffusion Policy against LeRobot's recorded outputs.

The fixtures (``test/fixtures/lerobot/<name>/``, made by
``tools/lerobot_fixtures/make_fixtures.py`` with LeRobot 0.4.4) hold a LeRobot checkpoint
directory (as a tar.xz), 3 episodes x 300 steps of inputs, and LeRobot's actions for
them. Here every step goes through ``PolicyRuntime`` on CPU, the way the node drives it
(write the staging buffers, load, step, read), with ``runtime.reset`` between episodes,
and every action is compared. ROS-free: nothing here imports rclpy or LeRobot.
"""
from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from lerobot_fixtures import FIXTURES, NAMES, extract_checkpoint, feature_map, load_npz, reference_path

from capsule_ros.chunking.mode import mode_for
from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot import build_act, build_diffusion, build_policy
from capsule_ros.policies.lerobot.checkpoint import MODEL_FILE, read_checkpoint
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.runtime.rng import counter_normal

# The fixtures' outputs are LeRobot's own actions at the CPU numerics level the suite runs at,
# portable = avx2 (conftest.py; tools/lerobot_fixtures/make_references.py pins LeRobot's process
# the same way): every action must be the same bits. At another level (a native AVX512 run) a
# float32 pipeline sums in another order, up to 1.5e-5 here (docs/lerobot.md#how-close-to-lerobot).
TOLERANCE = 1e-5
SNAPSHOT_EPISODE, SNAPSHOT_STEP = 1, 253        # mid-queue for every fixture (253 % 5, % 4, % 8 != 0)


@dataclass
class Case:
    name: str
    checkpoint: Path
    inputs: Dict[str, np.ndarray]
    outputs: Dict[str, np.ndarray]
    ports: Dict[str, BufferSpec] = field(init=False)

    def __post_init__(self):
        self.ports = feature_map(self.inputs)

    def runtime(self, device: str = "cpu", **kw) -> PolicyRuntime:
        policy = build_policy(self.checkpoint, self.ports)
        return build_policy_runtime(policy, RuntimeConfig(device=device, **kw), mode=mode_for(policy))

    def seed(self, episode: int) -> int:
        return int(self.inputs["seeds"][episode])

    def feed(self, runtime: PolicyRuntime, episode: int, step: int) -> np.ndarray:
        """Stage one step's inputs, step, and return the action."""
        for key, spec in self.ports.items():
            runtime.staging[spec.name][...] = self.inputs[key][episode, step]
        runtime.load_inputs()
        runtime.step()
        return runtime.read_outputs().action


@dataclass
class Rollout:
    """Every action of the 3 episodes, plus a mid-episode snapshot of the arena."""

    actions: np.ndarray                       # [episodes, steps, A]
    chunks: List[np.ndarray]                  # the chunk output of each episode's first step
    snapshot: torch.Tensor                    # arena bytes before step SNAPSHOT_STEP of SNAPSHOT_EPISODE
    runtime: PolicyRuntime


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("lerobot")
    return {name: extract_checkpoint(FIXTURES / name / "pretrained_model.tar.xz", root / name) for name in NAMES}


@pytest.fixture(scope="module")
def cases(checkpoints) -> Dict[str, Case]:
    return {name: Case(name, checkpoints[name], load_npz(FIXTURES / name / "inputs.npz"),
                       load_npz(reference_path(name, "outputs.npz"))) for name in NAMES}


@pytest.fixture(scope="module")
def rollouts(cases) -> Dict[str, Rollout]:
    """Run each fixture once through one runtime (shared by the tests below: ~1 min of CPU)."""
    done = {}
    for name, case in cases.items():
        runtime = case.runtime()
        episodes, steps = case.outputs["action"].shape[:2]
        actions = np.zeros(case.outputs["action"].shape, np.float32)
        chunks, snapshot = [], None
        for e in range(episodes):
            runtime.reset(episode=e, seed=case.seed(e))
            for t in range(steps):
                if (e, t) == (SNAPSHOT_EPISODE, SNAPSHOT_STEP):
                    snapshot = runtime.arena.storage.clone()
                actions[e, t] = case.feed(runtime, e, t)
                if t == 0:
                    chunks.append(runtime.read_outputs().chunk)
        done[name] = Rollout(actions, chunks, snapshot, runtime)
    return done


@pytest.mark.parametrize("name", NAMES)
def test_every_action_matches_lerobot(name, cases, rollouts, record_property):
    expected, got = cases[name].outputs["action"], rollouts[name].actions
    diff = float(np.abs(got - expected).max())
    identical = bool(np.array_equal(got.view(np.uint32), expected.view(np.uint32)))
    record_property("max_abs_diff", diff)
    record_property("bit_identical", identical)
    print(f"{name}: {got.shape[0]}x{got.shape[1]} actions, max abs diff {diff:.3g}, bit-identical {identical}")
    assert identical, f"{name}: max abs diff {diff} (not bit-identical)"
    assert np.ptp(expected, axis=(0, 1)).min() > 0.1, "the fixture's actions should vary"


@pytest.mark.parametrize("name", NAMES)
def test_first_action_after_reset_equals_a_fresh_policy(name, cases, rollouts):
    case = cases[name]
    for e in range(case.outputs["action"].shape[0]):
        fresh = case.runtime()
        fresh.reset(episode=e, seed=case.seed(e))
        first = case.feed(fresh, e, 0)
        assert first.tobytes() == rollouts[name].actions[e, 0].tobytes(), f"{name} episode {e}"
        assert fresh.read_outputs().chunk.tobytes() == rollouts[name].chunks[e].tobytes()


@pytest.mark.parametrize("name", NAMES)
def test_snapshot_restore_replays_the_rest_of_the_episode_bit_identically(name, cases, rollouts):
    """The rollout's runtime has since run another episode; putting the arena bytes back
    must reproduce the rest of the snapshot's episode exactly: no state lives elsewhere."""
    case, rollout = cases[name], rollouts[name]
    runtime = rollout.runtime
    runtime.load_state(rollout.snapshot)
    steps = case.outputs["action"].shape[1]
    replay = np.stack([case.feed(runtime, SNAPSHOT_EPISODE, t) for t in range(SNAPSHOT_STEP, steps)])
    assert replay.tobytes() == rollout.actions[SNAPSHOT_EPISODE, SNAPSHOT_STEP:].tobytes()


def test_diffusion_noise_is_the_counter_based_draw(cases):
    """The noise LeRobot was fed is what the arena RNG draws at (episode seed, step)."""
    for name in ("diffusion", "diffusion_ddim_env"):
        case = cases[name]
        noise, at = case.outputs["noise"], case.outputs["noise_at"]
        assert len(noise) > 0
        for block, (episode, step) in zip(noise, at, strict=True):
            drawn = counter_normal(torch.tensor([case.seed(episode), step]), block.shape).numpy()
            assert drawn.tobytes() == block.tobytes()


def test_buffers_have_the_documented_kinds(cases):
    kinds = {}
    for name in NAMES:
        policy = build_policy(cases[name].checkpoint, cases[name].ports)
        kinds[name] = {s.name: s.kind for s in policy.state_spec()}
        assert kinds[name]["joints"] == BufferKind.INPUT
    for name in ("act_queue", "diffusion", "diffusion_ddim_env"):     # the chunk cadence's standard buffers
        assert kinds[name]["chunk.actions"] == BufferKind.CHUNK, name
        assert kinds[name]["chunk.cursor"] == kinds[name]["chunk.pending"] == BufferKind.META, name
    assert kinds["act_queue"]["chunk.request.joints"] == BufferKind.REQUEST    # an async request's copy of an input
    assert "chunk.actions" not in kinds["act_ensemble"]                       # ensembling: the network every step
    assert kinds["act_ensemble"]["act.ensemble"] == kinds["act_ensemble"]["act.ensemble_count"] == BufferKind.CHUNK
    assert kinds["diffusion"]["diffusion.obs.front_camera"] == BufferKind.CONV
    assert kinds["diffusion"]["chunk.request.diffusion.obs.front_camera"] == BufferKind.REQUEST
    assert kinds["diffusion_ddim_env"]["diffusion.obs.env_state"] == BufferKind.CONV


class _HostSyncDetector:
    """Records the aten ops a step runs that need the host to see a tensor's value
    (``.item()``, ``bool(t)``, data-dependent shapes): none may run in a capturable step."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "is_nonzero")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        calls = self.calls = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                if name in _HostSyncDetector.SYNCING:
                    calls.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


@pytest.mark.parametrize("name", NAMES)
def test_step_never_needs_a_host_sync(name, cases):
    """A CPU proxy for CUDA-graph capturability: across a refill and the steps after it,
    the step runs no op that reads a tensor's value on the host."""
    case = cases[name]
    runtime = case.runtime()
    runtime.reset(episode=0, seed=case.seed(0))
    detector = _HostSyncDetector()
    with detector.mode:
        for t in range(3):
            case.feed(runtime, 0, t)
    assert detector.calls == []


# --- validation ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unreadable_weights(checkpoints, tmp_path_factory) -> Dict[str, Path]:
    """The camera checkpoints' JSON files, with every .safetensors file (weights and
    statistics) replaced by garbage: an error that names a feature proves validation came
    before reading them."""
    out = {}
    for name in ("act_queue", "diffusion"):
        directory = tmp_path_factory.mktemp(name)
        for path in checkpoints[name].iterdir():
            if path.suffix == ".safetensors":
                (directory / path.name).write_bytes(b"not a safetensors file")
            else:
                shutil.copy(path, directory / path.name)
        out[name] = directory
    return out


def _camera(shape=(48, 64, 3), dtype=torch.uint8) -> BufferSpec:
    return BufferSpec("front_camera", shape, dtype, BufferKind.INPUT)


STATE = {"act_queue": BufferSpec("joints", (6,), torch.float32, BufferKind.INPUT),
         "diffusion": BufferSpec("joints", (5,), torch.float32, BufferKind.INPUT)}
BAD_MAPS = {
    "missing camera": (lambda s: {"observation.state": s}, "observation.images.front"),
    "wrong-size camera": (lambda s: {"observation.state": s, "observation.images.front": _camera((64, 64, 3))},
                          "observation.images.front"),
    "camera as float": (lambda s: {"observation.state": s,
                                   "observation.images.front": _camera(dtype=torch.float32)},
                        "observation.images.front"),
    "unknown feature key": (lambda s: {"observation.state": s, "observation.images.front": _camera(),
                                       "observation.images.wrist": BufferSpec("wrist", (48, 64, 3), torch.uint8,
                                                                              BufferKind.INPUT)},
                            "observation.images.wrist"),
    "wrong state length": (lambda s: {"observation.state": BufferSpec("joints", (7,), torch.float32,
                                                                      BufferKind.INPUT),
                                      "observation.images.front": _camera()}, "observation.state"),
}


@pytest.mark.parametrize("name", ["act_queue", "diffusion"])
@pytest.mark.parametrize("case", sorted(BAD_MAPS))
def test_bad_feature_map_fails_fast_naming_the_key(name, case, unreadable_weights):
    make_map, key = BAD_MAPS[case]
    build = build_act if name == "act_queue" else build_diffusion
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        build(unreadable_weights[name], make_map(STATE[name]))
    elapsed = time.perf_counter() - start
    assert repr(key) in str(err.value), str(err.value)
    assert MODEL_FILE not in str(err.value)
    assert elapsed < 0.5, f"validation took {elapsed:.2f} s"


def test_wrong_policy_type_and_reserved_port_names(checkpoints, cases):
    with pytest.raises(ConfigError, match="'diffusion'"):
        build_act(checkpoints["diffusion"], cases["diffusion"].ports)
    ports = dict(cases["act_queue"].ports)
    ports["observation.state"] = BufferSpec("action", (6,), torch.float32, BufferKind.INPUT)
    with pytest.raises(ConfigError, match="'action'"):
        build_act(checkpoints["act_queue"], ports)


def test_weights_load_strictly_by_lerobot_names(checkpoints, cases, tmp_path):
    """A renamed tensor is reported twice: missing under its name, unexpected under the new one."""
    from safetensors.torch import load_file, save_file
    directory = shutil.copytree(checkpoints["act_ensemble"], tmp_path / "ck")
    tensors = load_file(str(directory / MODEL_FILE))
    tensors["model.action_head.weight_renamed"] = tensors.pop("model.action_head.weight")
    save_file(tensors, str(directory / MODEL_FILE))
    with pytest.raises(ConfigError) as err:
        build_act(directory, cases["act_ensemble"].ports)
    assert "1 missing (model.action_head.weight)" in str(err.value)
    assert "1 unexpected (model.action_head.weight_renamed)" in str(err.value)


def test_a_diffusion_checkpoint_trained_with_compile_model_is_served(checkpoints, cases, tmp_path):
    """LeRobot's ``compile_model: true`` saves the U-Net under ``diffusion.unet._orig_mod.*``
    (torch.compile's wrapper); LeRobot serves such a file, and so does capsule_ros, with the
    same actions. A file that still does not fit is refused in one short line."""
    import json

    from safetensors.torch import load_file, save_file
    directory = shutil.copytree(checkpoints["diffusion"], tmp_path / "compiled")
    tensors = load_file(str(directory / MODEL_FILE))
    save_file({k.replace("diffusion.unet.", "diffusion.unet._orig_mod."): v for k, v in tensors.items()},
              str(directory / MODEL_FILE))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "compile_model": True}))
    case = cases["diffusion"]
    policy = build_policy(directory, case.ports)
    runtime = build_policy_runtime(policy, RuntimeConfig(device="cpu"), mode=mode_for(policy))
    runtime.reset(episode=0, seed=case.seed(0))
    got = np.stack([case.feed(runtime, 0, t) for t in range(20)])
    assert got.tobytes() == case.outputs["action"][0, :20].tobytes()
    both = load_file(str(directory / MODEL_FILE))
    both["diffusion.unet.final_conv.1.bias"] = both["diffusion.unet._orig_mod.final_conv.1.bias"].clone()
    save_file(both, str(directory / MODEL_FILE))
    with pytest.raises(ConfigError, match=r"holds both 'diffusion.unet.final_conv.1.bias' and its torch.compile "
                                          r"name .* compile_model: false"):
        build_policy(directory, case.ports)
    removed = {k: v for k, v in tensors.items() if not k.startswith("diffusion.unet.down_modules")}
    save_file({k.replace("diffusion.unet.", "diffusion.unet._orig_mod."): v for k, v in removed.items()},
              str(directory / MODEL_FILE))
    with pytest.raises(ConfigError) as err:
        build_policy(directory, case.ports)
    message = str(err.value)
    assert "\n" not in message and len(message) < 600, message
    assert re.search(r"\d+ missing \(diffusion\.unet\.down_modules\.0\.\S+, .* and \d+ more\)", message), message


def test_config_is_all_validation_reads(checkpoints):
    """read_checkpoint parses config.json only, and refuses a directory without one."""
    assert read_checkpoint(checkpoints["diffusion"]).action_dim == 4
    with pytest.raises(ConfigError, match="config.json"):
        read_checkpoint(checkpoints["diffusion"].parent)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_camera_frame_becomes_the_floats_lerobot_makes_on_the_cpu(device):
    """Every uint8 value, converted on ``device``, equals LeRobot's conversion bit for bit:
    ``/ 255`` on the CPU, a true division. A multiplication by the reciprocal (what torch's
    CUDA kernel makes of a division by a Python number) rounds 126 of the 256 values the other
    way, which made every camera policy's image on a GPU differ from LeRobot's."""
    from capsule_ros.policies.lerobot.common import camera_to_float
    frame = torch.arange(256, dtype=torch.uint8).reshape(16, 16, 1).expand(16, 16, 3)
    want = torch.movedim(frame.to(torch.float32) / 255, -1, -3).contiguous()        # LeRobot's, on the CPU
    got = camera_to_float(frame.to(device)).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    reciprocal = torch.movedim(frame.to(torch.float32) * (1 / 255), -1, -3)
    assert int((reciprocal != want).sum()) == 126 * 3                            # what the test tells apart


# --- CUDA ----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", NAMES)
def test_cuda_graph_step_matches_eager_and_lerobot(name, cases):
    """The step captured as a CUDA graph replays like the eager CUDA step (bit for bit) and
    stays close to LeRobot's CPU actions: other kernels, and cuDNN convolutions in TF32 (torch's
    default), so not bit-identical (H200, 2026-11-30: ACT 2.5e-3, Diffusion 6.7e-3 at most)."""
    case = cases[name]
    graphed, eager = case.runtime("cuda", cuda_graphs=True), case.runtime("cuda", cuda_graphs=False)
    assert graphed.graphs.captured
    steps = 40
    got = {}
    for key, runtime in (("graph", graphed), ("eager", eager)):
        runtime.reset(episode=0, seed=case.seed(0))
        got[key] = np.stack([case.feed(runtime, 0, t) for t in range(steps)])
    assert got["graph"].tobytes() == got["eager"].tobytes()
    diff = float(np.abs(got["graph"] - case.outputs["action"][0, :steps]).max())
    print(f"{name}: CUDA graph vs LeRobot CPU, max abs diff {diff:.3g}")
    assert diff < 2e-2
