"""`capsule-ros bench lifecycle` (docs/benchmarks.md, "Lifecycle"): each case's first tick
after activate is compared with the steady ticks that ran the same program, and cleanup is
checked as the node does it. Timings are printed, never asserted. ROS-free (the GPU figures
come from bench/run_gpu.sh)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_lifecycle_compares_a_chunking_first_tick_with_the_later_refills():
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "lifecycle", "--quick", "--device",
                             "cpu", "--cases", "default,pi0", "--json"], capture_output=True, text=True, timeout=600,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = {case["case"]: case for case in json.loads(result.stdout)["cases"]}
    assert cases["default"]["first_program"] == "step" and cases["pi0"]["first_program"] == "refill"
    for case in cases.values():
        assert case["cycles"] == 5 and len(case["per_cycle"]) == 5
        for cycle in case["per_cycle"]:
            assert cycle["program"] == case["first_program"]
            assert cycle["ratio"] == cycle["first_ms"] / cycle["steady_p50_ms"]
        # pi0's chunk of 50 over 200 steady ticks: its four later refills; the default policy: every tick
        compared = {cycle["steady_ticks_compared"] for cycle in case["per_cycle"]}
        assert compared == ({4} if case["case"] == "pi0" else {200}), compared
        assert case["met"] == (case["first_vs_p50_median"] <= case["target"])
        assert case["allocated_after_cleanup_bytes"] == 0                   # a CPU allocates no device memory


def test_bench_lifecycle_refuses_an_unknown_case():
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "lifecycle", "--quick", "--device",
                             "cpu", "--cases", "default,pi9"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode != 0 and "pi9" in result.stderr
