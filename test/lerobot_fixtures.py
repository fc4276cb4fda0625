"""The LeRobot fixtures (test/fixtures/lerobot/, made by tools/lerobot_fixtures/) as the
tests use them: unpacked checkpoints, recorded inputs and LeRobot's actions, and the
ports and parameters that serve them from policy_node."""
from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch
from cpu_references import recorded

from capsule_ros.runtime.arena import BufferKind, BufferSpec

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "test" / "fixtures" / "lerobot"
NAMES = ["act_queue", "act_ensemble", "diffusion", "diffusion_ddim_env"]
# feature key -> the port that feeds it in every test
PORTS = {"observation.state": "joints", "observation.environment_state": "env_state",
         "observation.images.front": "front_camera"}
KIND_OF = {"act": "lerobot_act", "diffusion": "lerobot_diffusion"}


def load_npz(path: Path) -> Dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def reference_path(name: str, file: str) -> Path:
    """``file`` of LeRobot's recorded actions for fixture ``name``, for this CPU's class
    (``cpu_references.recorded``; tools/lerobot_fixtures/README.md)."""
    return recorded(FIXTURES / name, file)


def extract_checkpoint(archive: Path, target: Path) -> Path:
    """Unpack ``pretrained_model/*`` regular files only (no links, no paths outside)."""
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) != 2 or parts[0] != "pretrained_model" or parts[1] in ("..", "."):
                raise ValueError(f"{archive}: unexpected member {member.name!r}")
            out = target / "pretrained_model" / parts[1]
            out.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            out.write_bytes(source.read())
    return target / "pretrained_model"


def feature_map(inputs: Dict[str, np.ndarray]) -> Dict[str, BufferSpec]:
    """One port per recorded input feature, shaped as the node's port would be."""
    return {key: BufferSpec(PORTS[key], value.shape[2:], torch.uint8 if value.dtype == np.uint8 else torch.float32,
                            BufferKind.INPUT)
            for key, value in inputs.items() if key != "seeds"}


def joint_names(n: int) -> list:
    return [f"j{i}" for i in range(n)]


def port_params(key: str, value: np.ndarray) -> Dict[str, Any]:
    """The ports.<name> parameters that feed ``key`` from a real message type: JointState
    positions for the state, Float32MultiArray for the environment state, an rgb8 Image
    for a camera. Reliable, deep queues: a test must lose no message."""
    shape = [int(d) for d in value.shape[2:]]
    common = {"topic": f"robot/{PORTS[key]}", "shape": shape, "qos": "reliable", "depth": 100}
    if value.dtype == np.uint8:
        return {**common, "type": "sensor_msgs/msg/Image", "fields": ["data"], "dtype": "uint8",
                "encodings": ["rgb8"]}
    if key == "observation.state":
        return {**common, "type": "sensor_msgs/msg/JointState", "fields": ["position"],
                "names": joint_names(shape[0]), "dtype": "float32"}
    return {**common, "type": "std_msgs/msg/Float32MultiArray", "fields": ["data"], "dtype": "float32"}


@dataclass
class Fixture:
    """One fixture: its checkpoint directory, inputs [episodes, steps, ...], LeRobot's outputs."""

    name: str
    checkpoint: Path
    inputs: Dict[str, np.ndarray]
    outputs: Dict[str, np.ndarray]

    @classmethod
    def load(cls, name: str, root: Path) -> Fixture:
        return cls(name, extract_checkpoint(FIXTURES / name / "pretrained_model.tar.xz", root / name),
                   load_npz(FIXTURES / name / "inputs.npz"), load_npz(reference_path(name, "outputs.npz")))

    @property
    def features(self) -> Dict[str, np.ndarray]:
        return {k: v for k, v in self.inputs.items() if k != "seeds"}

    @property
    def kind(self) -> str:
        return KIND_OF["act" if self.name.startswith("act") else "diffusion"]

    def seed(self, episode: int) -> int:
        return int(self.inputs["seeds"][episode])

    def node_params(self, episode: int = 0) -> Dict[str, Any]:
        """policy_node parameters (an overlay on config/policy.yaml) serving this fixture in
        trigger mode on the joint-state port, seeded like ``episode``'s recording."""
        features = self.features
        ports = {PORTS[k]: port_params(k, v) for k, v in features.items()}
        return {
            "ports": {"names": list(ports), **ports},
            "control": {"mode": "trigger", "trigger_port": "joints", "deadline_ms": 10000.0, "status_rate_hz": 50.0},
            "policy": {"kind": self.kind, "weights": "",
                       self.kind: {"pretrained_model": str(self.checkpoint),
                                   "features": [f"{k}:{PORTS[k]}" for k in features]}},
            "runtime": {"seed": self.seed(episode)},
        }

    def serving_params(self, **policy_settings: Any) -> Dict[str, Any]:
        """The full parameter mapping (config/policy.yaml with this fixture's ports and
        policy) that ServingConfig.from_params takes; ``policy_settings`` override the kind's."""
        from capsule_ros.config import load_params_file
        params = load_params_file(REPO / "config" / "policy.yaml")
        overlay = self.node_params()
        overlay["policy"][self.kind].update(policy_settings)
        params["ports"], params["policy"] = overlay["ports"], overlay["policy"]
        params["control"].update(overlay["control"])
        params["runtime"].update(overlay["runtime"], device="cpu")
        params["capsules"]["directory"] = ""
        return params
