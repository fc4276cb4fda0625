"""The package's layers import downward only (docs/architecture.md has the diagram).

Every import of a capsule_ros module, at the top of a file or inside a function, is
checked against the layer order below: a module may import its own subpackage and any
lower layer, never a higher one. The ROS-free layers (up to ``bag``) therefore never
reach rclpy through the package, and model code never depends on the serving stack.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "capsule_ros"

# Lowest first. Generated interfaces (msg / srv / action) sit just below the ROS layer.
LAYERS = (
    ("capsule_ros",),                                   # config, errors, metrics, paths, polling
    ("capsule_ros.runtime", "capsule_ros.sim"),         # mechanism; the simulated arm (numpy)
    ("capsule_ros.policies",),                          # model code over the runtime's protocol
    ("capsule_ros.capsules",),                          # store, files, directory
    ("capsule_ros.serving",),                           # the session: what the node does, without ROS
    ("capsule_ros.bag",),                               # rosbag2 record and replay engine (no ROS)
    ("capsule_ros.msg", "capsule_ros.srv", "capsule_ros.action"),
    ("capsule_ros.ros",),                               # the node and everything rclpy
    ("capsule_ros.bt",),                                # behaviour-tree leaves
    ("capsule_ros.benchmarks",),
    ("capsule_ros.cli",),
)
ROS_FREE = ("capsule_ros", "capsule_ros.runtime", "capsule_ros.sim", "capsule_ros.policies", "capsule_ros.capsules",
            "capsule_ros.serving", "capsule_ros.bag")


def layer_of(module: str) -> Tuple[int, str]:
    """(rank, subpackage) of a capsule_ros module name."""
    best = None
    for rank, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (rank, name)
    assert best is not None, module
    return best


def modules() -> Iterator[Tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, module) of every absolute import in the file, wherever it is."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:           # `from capsule_ros import srv` imports capsule_ros.srv
                yield node.lineno, f"{node.module}.{alias.name}"


def test_layers_import_downward_only():
    upward = []
    for module, path in modules():
        rank, own = layer_of(module)
        for line, target in imports(path):
            if not target.startswith("capsule_ros"):
                continue
            target_rank, target_package = layer_of(target)
            if target_package != own and target_rank > rank:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({own}) imports {target}")
    assert upward == [], "upward imports:\n" + "\n".join(upward)


@pytest.mark.parametrize("layer", ROS_FREE)
def test_ros_free_layers_never_import_ros(layer):
    ros = ("rclpy", "rcl_interfaces", "launch", "launch_ros", "ament_index_python", "sensor_msgs", "std_msgs",
           "geometry_msgs", "diagnostic_msgs", "builtin_interfaces", "trajectory_msgs", "lifecycle_msgs")
    found = []
    for module, path in modules():
        if layer_of(module)[1] != layer:
            continue
        for line, target in imports(path):
            # ament_index_python is looked up optionally (paths.py: installed share first)
            if target.split(".")[0] in ros and not (module == "capsule_ros.paths" and target.startswith("ament")):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert found == []
