"""Shared test set-up: an isolated DDS domain per test session, rclpy for the test's own
client node, markers, and the guard that the package was built (./setup.sh)."""
from __future__ import annotations

import importlib.abc
import os
import random
import sys

import pytest
from hypothesis import settings

from capsule_ros.runtime import numerics

# CAPSULE_ROS_WITHOUT_ROS=1 makes every ROS 2 module unimportable, as on the GPU machine:
# the ROS-free tests (the runtime, capsules, session, replay engine) must still run.
ROS_MODULES = ("rclpy", "rcl_interfaces", "rosidl_runtime_py", "ament_index_python", "launch", "launch_ros",
               "builtin_interfaces", "std_msgs", "sensor_msgs", "geometry_msgs", "diagnostic_msgs", "std_srvs",
               "lifecycle_msgs", "action_msgs", "trajectory_msgs", "capsule_ros.msg", "capsule_ros.srv",
               "capsule_ros.action")


class _NoRos(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in ROS_MODULES):
            raise ImportError(f"{name} is not available (CAPSULE_ROS_WITHOUT_ROS=1)")
        return None


if os.environ.get("CAPSULE_ROS_WITHOUT_ROS") == "1":
    sys.meta_path.insert(0, _NoRos())

# The suite runs at the default CPU numerics level (runtime.numerics: portable), pinned
# before any test runs torch: a level is fixed at torch's first operation in a process.
numerics.pin(numerics.PORTABLE)

# Hypothesis profiles. "ci" (the default, what `make test` runs): derandomized, the same
# examples on every run, so CI is reproducible. "dev": new examples every run.
# "hunt": long exploration, e.g. `HYPOTHESIS_PROFILE=hunt pytest test/test_capsule_statemachine.py -s`.
# A failing example prints its @reproduce_failure blob.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.register_profile("hunt", max_examples=1500, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    # Each test session talks on its own DDS domain, on this machine only: concurrent
    # runs (a developer's and CI's) never see each other's nodes.
    if "CAPSULE_ROS_TEST_DOMAIN" in os.environ:
        os.environ["ROS_DOMAIN_ID"] = os.environ["CAPSULE_ROS_TEST_DOMAIN"]
    else:
        os.environ["ROS_DOMAIN_ID"] = str(random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
                                          .randint(1, 200))
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped with its reason elsewhere)")
    config.addinivalue_line("markers", "ros: starts ROS 2 processes or uses rclpy")


@pytest.fixture(scope="session")
def rclpy_context():
    """rclpy initialised once for the session's client nodes, shut down at the end."""
    import rclpy
    rclpy.init()
    yield rclpy
    rclpy.try_shutdown()


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here: run `pytest -m cuda` on a GPU machine "
                                   "(docs/benchmarks.md records the last GPU run)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
