"""docs/lerobot.md works as written: its parameter file serves a checkpoint with its
config.json features (built here without LeRobot, the benchmark's writer, small network,
the guide's shapes), its outputs take the action, its controller configuration names the
same joints, its error examples are the node's messages, its Python tree compiles and
imports what exists. ROS-free but for that import check; the tree itself runs through a
node in test/test_lerobot_node.py."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
from pathlib import Path
from typing import List

import numpy as np
import pytest
import yaml

from capsule_ros.benchmarks.lerobot_act import write_act_checkpoint
from capsule_ros.errors import ConfigError
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_session
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.outputs import OutputAdapter
from capsule_ros.serving.records import ActionSource

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "lerobot.md"
GUIDE_PATH = "/home/robot/policies/so101_act/pretrained_model"


def blocks(language: str) -> List[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def guide(tmp_path_factory):
    """The guide's checkpoint features and parameter file, the file pointing at a
    checkpoint written with those features, and its ServingConfig on this CPU."""
    tmp = tmp_path_factory.mktemp("guide")
    (features_json,) = blocks("json")
    features = json.loads(features_json)
    checkpoint = write_act_checkpoint(tmp / "pretrained_model", quick=True,
                                      features={k: features[k] for k in ("input_features", "output_features")})
    (params_text,) = [b for b in blocks("yaml") if "lerobot_act:" in b]
    assert GUIDE_PATH in params_text
    params_file = tmp / "so101_act.yaml"
    params_file.write_text(params_text.replace(GUIDE_PATH, str(checkpoint)))
    config = ServingConfig.from_file(params_file)
    config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device="cpu"),
                                 capsules=dataclasses.replace(config.capsules, directory=""))
    return features, yaml.safe_load(params_text), config


def test_the_guides_parameter_file_serves_its_checkpoint_and_feeds_its_outputs(guide):
    features, _, config = guide
    assert config.policy.kind == "lerobot_act"
    # the guide's 30 ms is for its GPU; this checks the function
    session = build_session(config, options=SessionOptions(enforce_deadline=False))
    rng = np.random.default_rng(0)
    for name, port in config.ports.items():
        values = (rng.integers(0, 256, port.shape) if port.dtype == "uint8" else rng.normal(size=port.shape))
        session.loop.write_input(name, values.astype(port.dtype))
    record = session.loop.tick(1)
    assert record is not None and record.source == ActionSource.POLICY
    (action_dim,) = features["output_features"]["action"]["shape"]
    assert record.values.shape == (action_dim,) and np.isfinite(record.values).all()
    period = 1.0 / config.control.rate_hz
    commands = {name: OutputAdapter(name, out, action_dim, period).command(record, 1)
                for name, out in config.outputs.items()}
    arm, gripper = commands["arm"], commands["gripper"]
    assert arm is not None and gripper is not None
    assert arm.rows.shape[1] == 5 and arm.rows.shape[0] == record.chunk.shape[0] > 1     # the chunk as points
    assert np.array_equal(arm.rows[0], record.values[:5]) and np.array_equal(gripper.rows[0], record.values[5:])


def test_the_guides_controllers_and_ports_name_the_same_joints(guide):
    _, params, config = guide
    (controllers_text,) = [b for b in blocks("yaml") if "controller_manager:" in b]
    controllers = yaml.safe_load(controllers_text)
    joint_port = config.ports["joints"]
    assert list(config.outputs["arm"].joints) == controllers["arm_controller"]["ros__parameters"]["joints"]
    assert controllers["gripper_controller"]["ros__parameters"]["joints"] == [joint_port.names[5]]
    assert list(config.outputs["arm"].joints) == list(joint_port.names[:5])
    assert config.policy_settings.feature_ports() == {
        "observation.state": "joints", "observation.images.front": "front_camera",
        "observation.images.wrist": "wrist_camera"}


@pytest.mark.parametrize("features, port_change", [
    (["observation.state:joints", "observation.images.front:front_camera"], None),
    (["observation.state:joints", "observation.images.front:front_camera", "observation.images.top:wrist_camera"],
     None),
    (["observation.state:wrist_camera", "observation.images.front:front_camera", "observation.images.wrist:joints"],
     None),
    (None, [240, 320, 3]),
])
def test_the_guides_error_examples_are_the_nodes_messages(guide, features, port_change):
    _, _, config = guide
    settings = config.policy_settings
    if features is not None:
        settings = dataclasses.replace(settings, features=tuple(features))
    ports = dict(config.ports)
    if port_change is not None:
        ports["wrist_camera"] = dataclasses.replace(ports["wrist_camera"], shape=tuple(port_change))
    with pytest.raises(ConfigError) as err:
        build_session(dataclasses.replace(config, policy_settings=settings, ports=ports))
    message = str(err.value).replace(str(Path(settings.pretrained_model)), ".../pretrained_model")
    (examples,) = [b for b in blocks("text") if "cannot feed" in b]
    assert message in examples.splitlines(), message


@pytest.mark.ros
def test_the_guides_tree_compiles_and_imports_what_exists():
    pytest.importorskip("rclpy", reason="capsule_ros.bt is an rclpy client (this run has no ROS 2)")
    (code,) = [b for b in blocks("python") if "interrupt_then_resume" in b]
    tree = ast.parse(code)
    compile(tree, "docs/lerobot.md", "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("capsule_ros"):
            module = importlib.import_module(node.module)
            assert all(hasattr(module, alias.name) for alias in node.names), node.module
