"""``capsule-ros bench services --cpu-hog``: the capsule services timed while a busy loop
runs on every core, beside the floor of a plain rclpy service called at the same moments.
This checks that the benchmark measures what it says and leaves nothing behind; its
figures are the benchmark's business (docs/benchmarks.md), never asserted here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
from harness import REPO

pytestmark = pytest.mark.ros


def busy_loops() -> list:
    """Processes running the hog's busy loop."""
    from capsule_ros.benchmarks.services import BUSY_LOOP
    return [proc.pid for proc in psutil.process_iter(["cmdline"]) if (proc.info["cmdline"] or [])[-1:] == [BUSY_LOOP]]


def test_services_bench_under_a_cpu_hog_reports_every_service_and_the_floor():
    before = set(busy_loops())
    done = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "services", "--quick", "--cpu-hog",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["cpu_hog_processes"] == len(os.sched_getaffinity(0)) and result["node_exit_code"] == 0
    for name in ("commit", "reenter", "reset", "floor"):
        p50, p99, worst = (result[f"{name}_{k}_ms"] for k in ("p50", "p99", "max"))
        assert 0 < p50 <= p99 <= worst, name
    assert result["calls"] == 200 and isinstance(result["met"], bool) and result["target_p99_ms"] == 20.0
    assert set(busy_loops()) <= before, "the hog outlived the benchmark"


def test_the_hog_is_an_option_of_bench_services_only():
    done = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "step", "--cpu-hog"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode != 0 and "--cpu-hog is an option of bench services only" in done.stderr
