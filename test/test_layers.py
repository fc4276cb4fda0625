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
    ("capsule_ros",),                                   # config, errors, files, metrics, paths, polling
    ("capsule_ros.runtime", "capsule_ros.sim"),         # mechanism, the core; the simulated arm (numpy)
    ("capsule_ros.chunking",),                          # an execution mode above the core (the core never imports it)
    ("capsule_ros.policies",),                          # model code over the runtime's protocol
    ("capsule_ros.capsules",),                          # store, files, directory
    ("capsule_ros.serving",),                           # the session: what the node does, without ROS
    ("capsule_ros.updates",),                           # model updates: check, regenerate, the node's background
    ("capsule_ros.bag",),                               # rosbag2 record and replay engine (no ROS)
    ("capsule_ros.fleet",),                             # many robots from the batch slots of one runtime (no ROS)
    ("capsule_ros.msg", "capsule_ros.srv", "capsule_ros.action"),
    ("capsule_ros.ros",),                               # the node and everything rclpy
    ("capsule_ros.bt",),                                # behaviour-tree leaves
    ("capsule_ros.benchmarks",),
    ("capsule_ros.cli",),
)
ROS_FREE = ("capsule_ros", "capsule_ros.runtime", "capsule_ros.sim", "capsule_ros.chunking", "capsule_ros.policies",
            "capsule_ros.capsules", "capsule_ros.serving", "capsule_ros.updates", "capsule_ros.bag",
            "capsule_ros.fleet")


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


def import_graph() -> dict:
    """module -> the package's modules it imports (every import, TYPE_CHECKING ones too)."""
    known = {module for module, _ in modules()}
    graph = {}
    for module, path in modules():
        deps = set()
        for _, target in imports(path):
            while target and target not in known:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != module:
                deps.add(target)
        graph[module] = deps
    return graph


SUBPACKAGES = sorted({".".join(module.split(".")[:2]) for module, path in modules() if path.name == "__init__.py"
                      and module.count(".") == 1})


def test_the_circle_test_covers_every_subpackage():
    assert {"capsule_ros.runtime", "capsule_ros.chunking", "capsule_ros.capsules", "capsule_ros.serving",
            "capsule_ros.updates", "capsule_ros.bag", "capsule_ros.ros", "capsule_ros.bt"} <= set(SUBPACKAGES)


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_no_import_circle_inside_a_layer(package):
    """Within a subpackage, modules import each other one way: the node builds its servers
    and its facade, the servers know the facade only (no node <-> services <-> run_policy);
    the runtime's builder calls the state check, which knows the runtime, never the reverse."""
    graph = import_graph()
    inside = {m for m in graph if m.startswith(package + ".")}
    circles, state, path = [], {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module] & inside):
            if state.get(dep) == "open":
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[module] = "done"

    for module in sorted(inside):
        if module not in state:
            visit(module)
    assert circles == []


BOUNDARY_ENTRIES = {"held", "blocking", "unless_busy"}


def test_only_the_session_module_enters_its_boundary():
    """Every use of the session's boundary is in serving/session.py: its parts (capsule
    files, the recompute fallback, the guarded step), the node, the servers and the replay
    never take the lock, so what runs under it can be read in one module."""
    found = []
    for module, path in modules():
        if module in ("capsule_ros.serving.session", "capsule_ros.serving.boundary",
                      "capsule_ros.serving.parts"):          # the record of the session's parts names its type
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in BOUNDARY_ENTRIES | {"boundary"} \
                    and not (node.attr in BOUNDARY_ENTRIES and not _on_boundary(node)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Name) and node.id in ("Boundary", "BoundaryLock"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.id}")
    assert found == [], "the boundary outside serving/session.py:\n" + "\n".join(found)


def _on_boundary(node: ast.Attribute) -> bool:
    """``<something>.boundary.held`` (and the other entries)."""
    value = node.value
    return isinstance(value, ast.Attribute) and value.attr == "boundary"


def test_test_modules_import_helpers_from_the_harness_not_from_each_other():
    """A helper two test modules need lives in test/harness.py (or a fixture module such as
    lerobot_fixtures.py), never in a test_*.py that the other imports (which would tie the two modules' set-up
    and fixtures together, and hide the helper from the next engineer)."""
    tests = PACKAGE.parent / "test"
    found = [f"{path.name}:{line} imports {module}" for path in sorted(tests.glob("*.py"))
             for line, module in imports(path) if module.split(".")[0].startswith("test_")]
    assert found == []


def test_model_updates_make_no_json():
    """capsule_ros/updates/ hands out typed reports and outcomes (also over the background
    child's pipe); JSON is made only at the edge, by the commands in capsule_ros/cli/."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for module, path in modules()
             if layer_of(module)[1] == "capsule_ros.updates"
             for line, target in imports(path) if target.split(".")[0] == "json"]
    assert found == []
