"""``capsule-ros bench fleet --quick``: every side measures, the process sides included (N
``policy_node`` processes and a ``fleet_node`` serving N robots, driven over real topics),
and the processes leave cleanly. Figures are the benchmark's business (docs/benchmarks.md),
never asserted here: this checks that each side produced them, for every N."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from harness import REPO

pytestmark = pytest.mark.ros
CLI = [sys.executable, "-m", "capsule_ros.cli.main", "bench", "fleet"]


def _figures_are_numbers(by_n: dict, ns: list, roundtrip: bool) -> None:
    assert sorted(int(n) for n in by_n) == ns
    for figures in by_n.values():
        assert figures["robot_steps_per_s"] > 0
        assert 0 < figures["period_ms"]["p50"] <= figures["period_ms"]["p99"]
        if roundtrip:
            assert 0 < figures["roundtrip_ms"]["p50"] <= figures["roundtrip_ms"]["p99"]


def test_quick_run_measures_every_side_the_processes_included():
    done = subprocess.run([*CLI, "--quick", "--device", "cpu", "--json", "--cases", "default,recurrent",
                           "--steps", "20"], capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["sides"] == ["fleet", "loop", "separate", "nodes", "fleet_node"] and result["ns"] == [1, 2, 4]
    for name, case in result["cases"].items():
        sides = case["sides"]
        for side in ("fleet", "loop", "separate"):
            _figures_are_numbers(sides[side]["by_n"], result["ns"], roundtrip=False)
        for side in ("nodes", "fleet_node"):
            assert "skipped" not in sides[side], (name, side, sides[side])
            _figures_are_numbers(sides[side]["by_n"], result["ns"], roundtrip=True)
            assert sides[side]["exit_codes"] and set(sides[side]["exit_codes"]) == {0}, (name, side)
        assert sides["nodes"]["processes"] == 4 and len(sides["fleet_node"]["exit_codes"]) == 3
        assert sides["fleet_node"]["batching"] == ("loop" if name == "recurrent" else "vmap")
        for n in result["ns"]:
            assert set(case["ratios"][str(n)]) == {"fleet", "loop", "nodes", "fleet_node"}


def test_act_process_sides_drive_camera_frames_over_topics():
    """ACT's robots send a camera image (sensor_msgs/Image) and joint states each step to
    policy_node processes and to a fleet_node; every robot-step gets its action back."""
    done = subprocess.run([*CLI, "--quick", "--device", "cpu", "--json", "--cases", "act", "--steps", "5",
                           "--sides", "nodes,fleet_node"], capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    sides = result["cases"]["act"]["sides"]
    for side in ("nodes", "fleet_node"):
        assert "skipped" not in sides[side], sides[side]
        _figures_are_numbers(sides[side]["by_n"], result["ns"], roundtrip=True)
        assert sides[side]["exit_codes"] and set(sides[side]["exit_codes"]) == {0}, (side, sides[side])


def test_without_ros_the_process_sides_are_skipped_with_the_reason():
    """As on the GPU machine: rclpy unimportable, the in-process sides still run (here with
    ``--float32-matmul high``, recorded with the figures: a CPU's products stay as they are)."""
    env = {**os.environ, "CAPSULE_ROS_WITHOUT_ROS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "test"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import conftest, sys; from capsule_ros.cli.main import main; "
                           "sys.exit(main(sys.argv[1:]))", "bench", "fleet", "--quick", "--device", "cpu", "--json",
                           "--cases", "default", "--steps", "5", "--sides", "separate,nodes,fleet_node",
                           "--float32-matmul", "high"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["float32_matmul"] == "high"
    sides = result["cases"]["default"]["sides"]
    _figures_are_numbers(sides["separate"]["by_n"], [1, 2, 4], roundtrip=False)
    for side in ("nodes", "fleet_node"):
        assert "ROS 2 is not importable here" in sides[side]["skipped"], sides[side]


def test_sides_is_an_option_of_bench_fleet_and_vla_only_and_names_known_sides():
    done = subprocess.run([*CLI[:-1], "step", "--sides", "nodes"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode != 0 and "--sides is an option of bench fleet and vla only" in done.stderr
    done = subprocess.run([*CLI, "--quick", "--sides", "nodes,robots"], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert done.returncode != 0 and "--sides ['robots']" in done.stderr


def test_float32_matmul_is_an_option_of_bench_fleet_and_vla_only():
    done = subprocess.run([*CLI[:-1], "step", "--float32-matmul", "high"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode != 0 and "--float32-matmul is an option of bench fleet and vla only" in done.stderr


def test_the_fleet_tick_profile_reports_the_ticks_and_where_they_went(tmp_path):
    """bench/profile_fleet_tick.py on the CPU: the ticks' percentiles, their time by part (every
    tick of a policy that does not chunk), then the fleet's own functions under cProfile (its
    tick among them, the parts' timers gone) and torch's ops under torch.profiler."""
    done = subprocess.run([sys.executable, "bench/profile_fleet_tick.py", str(tmp_path), "--device", "cpu", "--case",
                           "default", "--quick", "--robots", "3", "--ticks", "12"], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "CAPSULE_ROS_WITHOUT_ROS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "profile_fleet_tick.txt").read_text()
    assert report.startswith("default, 3 robots, cpu, 12 ticks back to back\ntick ms p10 / p50 / p90 / p99: ")
    parts = report.split("parts of the 12 ticks in which no robot planned, us per tick / per robot:\n")[1]
    for label in ("fleet tick", "robots' begin_tick", "fleet runtime step", "robots' finish"):
        line = next(row for row in parts.splitlines() if row.strip().startswith(label))
        per_tick, per_robot = (float(x) for x in line.split()[-3::2])
        assert per_tick > 0 and abs(per_tick / 3 - per_robot) < 0.1, line
    assert report.count("fleet/session.py") >= 2 and "(tick)" in report, report[:3000]
    assert not re.search(r"profile_fleet_tick\.py:\d+\(run\)", report), "a part's timer stayed in place"
    assert "Self CPU time total" in report


def test_act_async_case_plans_off_the_tick_on_both_sides_with_a_single_runtimes_bits():
    """``--cases act-async``: the ACT robots with async chunking (the refill worker plans while
    the steps go on) measure on the fleet and separate sides, and a fleet robot's actions
    equal a single runtime's bit for bit, as in sync mode."""
    done = subprocess.run([*CLI, "--quick", "--device", "cpu", "--json", "--cases", "act-async", "--steps", "30",
                           "--sides", "fleet,separate"], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    case = result["cases"]["act-async"]
    for side in ("fleet", "separate"):
        _figures_are_numbers(case["sides"][side]["by_n"], result["ns"], roundtrip=False)
    assert case["identical_to_single"] == {"fleet": True}
