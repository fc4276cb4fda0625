"""Shared test set-up: an isolated DDS domain per test session, rclpy for the test's own
client node, markers, and the guard that the package was built (./setup.sh)."""
from __future__ import annotations

import os
import random

import pytest


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
