"""The policy kinds lerobot_act and lerobot_diffusion, configured as the node configures
them (ServingConfig from parameters, then the factory): the port-to-feature map is checked
against config.json and the port types before any weights are read, the checkpoint is in
the capsule fingerprint, and camera frames are resized as torchvision's Resize does.
ROS-free: the node serving them is test_lerobot_node.py."""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torch
from lerobot_fixtures import PORTS, Fixture

from capsule_ros.chunking.mode import mode_for
from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot import build_policy
from capsule_ros.policies.lerobot.checkpoint import MODEL_FILE
from capsule_ros.policies.lerobot.common import resize_image
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.runtime.weights import read_weights, save_weights
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_runtime

STEPS = 12
TOLERANCE = 1e-5          # as test_lerobot_parity.py


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Dict[str, Fixture]:
    root = tmp_path_factory.mktemp("lerobot_kinds")
    return {name: Fixture.load(name, root) for name in ("act_queue", "act_ensemble", "diffusion")}


def serve(fixture: Fixture, params: Dict[str, Any]) -> PolicyRuntime:
    return build_runtime(ServingConfig.from_params(params))


def run_steps(runtime: PolicyRuntime, fixture: Fixture, steps: int, episode: int = 0) -> np.ndarray:
    runtime.reset(episode=episode, seed=fixture.seed(episode))
    out = []
    for t in range(steps):
        for key, value in fixture.features.items():
            runtime.staging[PORTS[key]][...] = value[episode, t]
        runtime.load_inputs()
        runtime.step()
        out.append(runtime.read_outputs().action)
    return np.stack(out)


@pytest.mark.parametrize("name", ["act_queue", "act_ensemble", "diffusion"])
def test_a_configured_kind_serves_lerobots_actions(name, fixtures):
    fixture = fixtures[name]
    config = ServingConfig.from_params(fixture.serving_params())
    assert config.policy.kind == fixture.kind
    got = run_steps(build_runtime(config), fixture, STEPS)
    diff = float(np.abs(got - fixture.outputs["action"][0, :STEPS]).max())
    assert diff <= TOLERANCE, f"{name}: max abs diff {diff}"


# --- validation before weights -----------------------------------------------------------------


@pytest.fixture(scope="module")
def garbage_weights(fixtures, tmp_path_factory) -> Dict[str, Path]:
    """The camera checkpoints with every .safetensors file replaced by garbage: an error that
    names a feature or port proves the check came before reading them."""
    out = {}
    for name in ("act_queue", "diffusion"):
        directory = tmp_path_factory.mktemp(f"{name}_garbage") / "pretrained_model"
        shutil.copytree(fixtures[name].checkpoint, directory)
        for path in directory.glob("*.safetensors"):
            path.write_bytes(b"not a safetensors file")
        out[name] = directory
    return out


def _swap_port(params, port, **changes):
    params["ports"][port] = {**params["ports"][port], **changes}
    return params


def _image_as_joints(params):
    return _swap_port(params, "front_camera", type="sensor_msgs/msg/JointState", fields=["position"], dtype="uint8")


def _joints_as_image(params):
    return _swap_port(params, "joints", type="sensor_msgs/msg/Image", fields=["data"], names=[])


def _extra_port(params):
    params["ports"]["names"].append("wrist")
    params["ports"]["wrist"] = dict(params["ports"]["front_camera"], topic="robot/wrist")
    return params


def _features(*entries):
    def change(params):
        params["policy"][next(k for k in params["policy"] if k.startswith("lerobot"))]["features"] = list(entries)
        return params
    return change


CAMERA, STATE = "observation.images.front", "observation.state"
BAD_CONFIGS = {
    "camera not mapped": (_features(f"{STATE}:joints"), "'front_camera' feeds no feature"),
    "camera key unknown": (_features(f"{STATE}:joints", "observation.images.top:front_camera"),
                           "'observation.images.top'"),
    "camera from a JointState port": (_image_as_joints, f"'front_camera' (sensor_msgs/msg/JointState) cannot feed "
                                                        f"'{CAMERA}'"),
    "state from an Image port": (_joints_as_image, f"'joints' (sensor_msgs/msg/Image) cannot feed '{STATE}'"),
    "camera of another size": (lambda p: _swap_port(p, "front_camera", shape=[96, 128, 3]),
                               f"cannot feed '{CAMERA}'"),
    "state as float64": (lambda p: _swap_port(p, "joints", dtype="float64"), f"cannot feed '{STATE}'"),
    "state of another length": (lambda p: _swap_port(p, "joints", shape=[7], names=[]), f"cannot feed '{STATE}'"),
    "port not declared": (_features(f"{STATE}:joints", f"{CAMERA}:top_camera"), "'top_camera'"),
    "port without a feature": (_extra_port, "'wrist' feeds no feature"),
    "entry without a port": (_features(STATE, f"{CAMERA}:front_camera"), "'observation.state'"),
    "key mapped twice": (_features(f"{STATE}:joints", f"{STATE}:front_camera"), "mapped twice"),
    "weights file given": (lambda p: {**p, "policy": {**p["policy"], "weights": "builtin:arm_reach"}},
                           "set policy.weights to ''"),
}


@pytest.mark.parametrize("name", ["act_queue", "diffusion"])
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_map_fails_fast_naming_the_key_before_any_weights(name, case, fixtures, garbage_weights):
    change, expect = BAD_CONFIGS[case]
    fixture = fixtures[name]
    params = change(fixture.serving_params(pretrained_model=str(garbage_weights[name])))
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        serve(fixture, params)
    elapsed = time.perf_counter() - start
    assert expect in str(err.value), str(err.value)
    assert "not a valid safetensors file" not in str(err.value)        # nothing was read
    assert elapsed < 1.0, f"{case}: failed after {elapsed:.2f} s"


def test_kind_and_checkpoint_type_must_agree(fixtures):
    params = fixtures["act_queue"].serving_params()
    settings = params["policy"].pop("lerobot_act")
    params["policy"]["kind"], params["policy"]["lerobot_diffusion"] = "lerobot_diffusion", settings
    with pytest.raises(ConfigError, match="type is 'act', expected 'diffusion'"):
        serve(fixtures["act_queue"], params)


def test_settings_are_required_and_read_only_parameters(fixtures, tmp_path):
    params = fixtures["act_queue"].serving_params()
    params["policy"]["lerobot_act"]["pretrained_model"] = ""
    with pytest.raises(ConfigError, match="policy.lerobot_act.pretrained_model"):
        ServingConfig.from_params(params)
    params["policy"]["lerobot_act"]["pretrained_model"] = str(tmp_path)
    with pytest.raises(ConfigError, match="config.json"):
        serve(fixtures["act_queue"], params)
    from capsule_ros.policies.registry import policy_kind
    for kind in ("lerobot_act", "lerobot_diffusion"):
        assert all(f.metadata["read_only"] for f in policy_kind(kind).settings.settings())


# --- the fingerprint covers the checkpoint ------------------------------------------------------


def test_fingerprint_covers_weights_statistics_and_config_not_the_path(fixtures, tmp_path):
    fixture = fixtures["act_ensemble"]

    def fingerprint_of(directory: Path) -> str:
        return serve(fixture, fixture.serving_params(pretrained_model=str(directory))).fingerprint

    original = fingerprint_of(fixture.checkpoint)
    copies = {}
    for change in ("moved", "weight", "statistic", "config"):
        copies[change] = shutil.copytree(fixture.checkpoint, tmp_path / change / "pretrained_model")
    assert fingerprint_of(copies["moved"]) == original

    def nudge(path: Path, name: str) -> None:
        tensors, metadata = read_weights(path)
        flat = tensors[name].reshape(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf))         # one ulp
        save_weights(path, tensors, metadata)

    nudge(copies["weight"] / MODEL_FILE, "model.action_head.bias")
    stats = next(copies["statistic"].glob("policy_preprocessor_*normalizer_processor.safetensors"))
    nudge(stats, "observation.state.mean")
    config_path = copies["config"] / "config.json"
    config = json.loads(config_path.read_text())
    config["temporal_ensemble_coeff"] = 0.02
    config_path.write_text(json.dumps(config))
    changed = {change: fingerprint_of(copies[change]) for change in ("weight", "statistic", "config")}
    assert all(fp != original for fp in changed.values()), changed
    assert len(set(changed.values())) == 3


# --- camera resizing ----------------------------------------------------------------------------


def reference_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Antialiased bilinear resampling from its definition (float64, [C, H, W]): each output
    pixel is the normalised triangle-weighted sum of the input pixels within one output
    pixel's width (at least one input pixel) of its centre."""
    def weights(n_in: int, n_out: int) -> np.ndarray:
        scale = n_in / n_out
        support = max(scale, 1.0)
        w = np.zeros((n_out, n_in))
        for i in range(n_out):
            centre = (i + 0.5) * scale
            for j in range(max(0, math.floor(centre - support)), min(n_in, math.ceil(centre + support))):
                w[i, j] = max(0.0, 1.0 - abs((j + 0.5 - centre) / support))
            w[i] /= w[i].sum()
        return w
    rows, cols = weights(image.shape[1], height), weights(image.shape[2], width)
    return np.einsum("ih,chw,jw->cij", rows, image.astype(np.float64), cols)


@pytest.mark.parametrize("size_in", [(96, 128), (60, 80), (40, 50)])
def test_resize_is_antialiased_bilinear(size_in):
    image = np.random.default_rng(0).random((3, *size_in), dtype=np.float32)
    got = resize_image(torch.from_numpy(image)[None], (48, 64))[0].numpy()
    assert got.shape == (3, 48, 64)
    # float32 weights against float64: a few ulps; a filter without antialiasing is off by ~0.1
    assert np.abs(got - reference_resize(image, 48, 64)).max() < 1e-5
    same = torch.from_numpy(image)
    assert resize_image(same, size_in) is same


def test_a_resized_camera_port_reaches_the_model_resized_then_normalised(fixtures):
    fixture = fixtures["act_queue"]
    params = _swap_port(fixture.serving_params(resize_cameras=True), "front_camera", shape=[96, 128, 3])
    runtime = serve(fixture, params)
    frame = np.repeat(np.repeat(fixture.inputs[CAMERA][0, 0], 2, axis=0), 2, axis=1)       # [96, 128, 3]
    camera = runtime.policy.cameras[0]
    assert camera.port.shape == (96, 128, 3) and camera.image_size == (48, 64)
    seen = runtime.policy.normalized(camera, torch.from_numpy(frame)).numpy()
    norm = runtime.policy.input_norms[runtime.policy.inputs.index(camera)]
    expected = (reference_resize(np.moveaxis(frame, -1, 0) / 255.0, 48, 64) - norm.low.numpy()) / norm.denom.numpy()
    assert seen.shape == (3, 48, 64) and np.abs(seen - expected).max() < 1e-5
    runtime.reset(episode=0, seed=0)
    runtime.staging["joints"][...] = fixture.inputs[STATE][0, 0]
    runtime.staging["front_camera"][...] = frame
    runtime.load_inputs()
    runtime.step()
    assert np.isfinite(runtime.read_outputs().action).all()


def _with_config(fixture: Fixture, directory: Path, **fields) -> Path:
    target = shutil.copytree(fixture.checkpoint, directory / "pretrained_model")
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_diffusion_resize_shape_is_applied_and_checked(fixtures, tmp_path):
    """resize_shape to the camera's own size is the identity (torchvision returns the
    image): LeRobot's actions still; a crop that does not fit the resized image is refused."""
    fixture = fixtures["diffusion"]
    same = _with_config(fixture, tmp_path / "same", resize_shape=[48, 64])
    got = run_steps(serve(fixture, fixture.serving_params(pretrained_model=str(same))), fixture, 3)
    assert np.abs(got - fixture.outputs["action"][0, :3]).max() <= TOLERANCE
    small = _with_config(fixture, tmp_path / "small", resize_shape=[24, 32])
    with pytest.raises(ConfigError, match=r"crop_shape = \[42, 57\] does not fit the camera images resized to"):
        serve(fixture, fixture.serving_params(pretrained_model=str(small)))
    bad = _with_config(fixture, tmp_path / "bad", resize_shape=[24])
    with pytest.raises(ConfigError, match="resize_shape"):
        build_policy(bad, {"observation.state": BufferSpec("joints", (5,), torch.float32, BufferKind.INPUT),
                           CAMERA: BufferSpec("front_camera", (48, 64, 3), torch.uint8, BufferKind.INPUT)})


def test_in_process_runtime_of_the_kind_matches_build_policy(fixtures):
    """The kind adds checks, nothing else: the same policy as build_policy, bit for bit."""
    fixture = fixtures["act_ensemble"]
    policy = build_policy(fixture.checkpoint, {k: BufferSpec(PORTS[k], v.shape[2:], torch.float32, BufferKind.INPUT)
                                               for k, v in fixture.features.items()})
    direct = build_policy_runtime(policy, RuntimeConfig(device="cpu"), mode=mode_for(policy))
    via_kind = serve(fixture, fixture.serving_params())
    assert run_steps(direct, fixture, STEPS).tobytes() == run_steps(via_kind, fixture, STEPS).tobytes()
