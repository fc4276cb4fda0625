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


def test_a_cycle_logs_its_own_ticks_so_large_inputs_still_configure(tmp_path):
    """A VLA's cameras over the default 20,000 logged steps are over the log's memory limit
    (configure refuses them); the benchmark's cycles log the ticks they run. Here the limit
    is lowered until the default policy's own inputs are over it at 20,000 steps."""
    import dataclasses

    import torch

    from capsule_ros.benchmarks import lifecycle
    from capsule_ros.errors import ConfigError
    from capsule_ros.serving.factory import prepare_serving

    config = lifecycle.case_config("default", torch.device("cpu"), True, tmp_path)
    config = dataclasses.replace(config, control=dataclasses.replace(config.control, input_log_max_mb=0.1))
    try:
        prepare_serving(config)
    except ConfigError as exc:
        assert "input_log_steps = 20000" in str(exc)
    else:
        raise AssertionError("20,000 logged steps fit in 0.1 MB: the premise of this test is gone")
    cycles = lifecycle._for_the_cycles(config, torch.device("cpu"), tmp_path / "capsules")
    assert cycles.control.input_log_steps == lifecycle.STEADY_TICKS + 1
    prepare_serving(cycles)                      # configures: the cycle's ticks fit
