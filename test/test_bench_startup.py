"""`capsule-ros bench startup` (docs/benchmarks.md, "Start-up"): the installed policy_node's
launch to its first policy action beside a plain load of the same model, per case. Timings
are printed, never asserted; what is asserted is what each figure is made of."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ros

REPO = Path(__file__).resolve().parents[1]


def test_bench_startup_times_both_sides_and_a_chunking_policy_checks_its_state_beside_serving():
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "startup", "--quick", "--cases",
                             "default,act", "--json"], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["rounds"] == 2 and set(report["cases"]) == {"default", "act"}
    for name, row in report["cases"].items():
        for key in ("served_s", "plain_s", "plain_native_s", "configured_s", "serving_s", "state_check_s"):
            assert row[key]["min"] <= row[key]["median"] <= row[key]["max"], (name, key)
        assert row["target_s"] == report["budget_s"] + row["plain_s"]["median"] + row["graph_capture_s"]
        assert row["met"] == (row["served_s"]["median"] <= row["target_s"]), name
    # the default policy checks before serving; ACT, a chunking policy on a CPU, beside it
    assert (report["cases"]["default"]["state_check_beside"], report["cases"]["act"]["state_check_beside"]) == \
        (False, True)
    assert report["met"] == all(row["met"] for row in report["cases"].values())


def test_a_state_check_is_settled_by_its_verdict_or_by_running_before_serving():
    """The benchmark stops a node only once its state check has a verdict in the log (a check
    beside serving stopped early logs none, and the round would read as checked before)."""
    from capsule_ros.benchmarks.startup import state_check_settled
    check = "[1.0] [policy_node]: [runtime.contract] state check: 5 steps (repeated: True) in 3.0 ms\n"
    serving = "[2.0] [policy_node]: serving on cpu\n"
    assert state_check_settled(check + serving)
    assert not state_check_settled(serving)
    assert not state_check_settled(serving + check)
    for verdict in ("passed, beside serving, in 1.0 s", "failed, beside serving: boom; capsule restores are refused"):
        line = f"[3.0] [policy_node]: [serving.statecheck] state check {verdict}\n"
        assert state_check_settled(serving + check + line)
