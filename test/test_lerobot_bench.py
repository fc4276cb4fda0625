"""`capsule-ros bench step --policy act` (docs/benchmarks.md): its checkpoint is a LeRobot
directory the lerobot_act kind serves, and the command reports what the docs record.
Timings are printed, never asserted. ROS-free (bench/run_gpu.sh runs the CUDA test)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capsule_ros.benchmarks.lerobot_act import ACT_DEFAULTS, PORTS, serving_config, write_act_checkpoint
from capsule_ros.serving.factory import build_runtime

REPO = Path(__file__).resolve().parents[1]


def test_the_benchmark_checkpoint_is_served_by_the_lerobot_act_kind(tmp_path):
    """Written twice with the same seed: the same files; served: a queue of n_action_steps
    actions that refills after it empties, actions finite and deterministic."""
    first = write_act_checkpoint(tmp_path / "a" / "pretrained_model", quick=True)
    second = write_act_checkpoint(tmp_path / "b" / "pretrained_model", quick=True)
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    for path in first.iterdir():
        assert path.read_bytes() == (second / path.name).read_bytes(), path.name
    runtime = build_runtime(serving_config(first))
    config = json.loads((first / "config.json").read_text())
    assert {k: config[k] for k in ("chunk_size", "n_action_steps", "n_decoder_layers", "vision_backbone")} == \
        {k: ACT_DEFAULTS[k] for k in ("chunk_size", "n_action_steps", "n_decoder_layers", "vision_backbone")}
    rng = np.random.default_rng(0)
    runtime.staging[PORTS["observation.state"]][...] = rng.normal(size=14)
    runtime.staging[PORTS["observation.images.top"]][...] = rng.integers(0, 256, size=(96, 128, 3))
    runtime.reset(episode=1, seed=0)
    actions = []
    for _ in range(config["n_action_steps"] + 1):
        runtime.load_inputs()
        runtime.step()
        actions.append(runtime.read_outputs().action.copy())
    actions_arr = np.stack(actions)
    assert np.isfinite(actions_arr).all() and actions_arr.shape == (101, 14)
    assert not np.array_equal(actions_arr[0], actions_arr[1])           # the queue pops one action per step
    assert np.array_equal(actions_arr[0], actions_arr[100])             # refilled from the same inputs


def test_bench_step_policy_act_reports_steps_and_the_capsule_against_the_copy_limit():
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "step", "--policy", "act",
                             "--quick", "--device", "cpu", "--json"], capture_output=True, text=True, timeout=300,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    (row,) = report["policies"]
    assert report["device"] == "cpu" and report["quick"] and row["policy"] == "act-quick"
    assert row["checkpoint"]["inputs"] == {"observation.state": [14], "observation.images.top": [3, 96, 128]}
    assert row["graph"] is None and row["eager"]["graph_captured"] is False and row["eager"]["threads"] == 1
    assert 0 < row["eager"]["gpu_ms"]["p50"] <= row["eager"]["gpu_ms"]["p99"]
    if "eager_all_cores" in row:                        # more than one core: the same action with more threads
        assert row["eager_all_cores"]["threads"] > 1
    capsule = row["capsule"]
    assert capsule["state_bytes"]["input"] >= 96 * 128 * 3 + 14 * 4
    assert capsule["state_bytes"]["chunk"] >= 100 * 14 * 4                # the chunk (its cursor is meta)
    assert capsule["state_bytes"]["request"] >= 96 * 128 * 3 + 14 * 4     # an async request's copy of the inputs
    assert capsule["bytes"] >= sum(capsule["state_bytes"].values())
    assert capsule["limit_us"] > 0 and capsule["ratio_to_limit"] > 0
    print(f"act-quick on cpu: step p50 {row['eager']['gpu_ms']['p50']:.1f} ms, capsule {capsule['bytes']} B "
          f"snapshot {capsule['snapshot_us']:.2f} us vs limit {capsule['limit_us']:.2f} us")


def test_bench_chunking_reports_every_side_and_says_why_one_did_not_run(tmp_path):
    """The quick ACT case through the command: the session sides report their figures and
    bit-equal sync actions need LeRobot's side, which is reported as not run (no LeRobot
    environment where CAPSULE_ROS_LEROBOT_PYTHON points: an explicit ``--lerobot-python``
    that is missing is refused instead, test_cli_errors.py) with the reason; the finished
    case is printed on stderr at once."""
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "chunking", "--quick",
                             "--device", "cpu", "--cases", "act10", "--steps", "40", "--json"],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "CAPSULE_ROS_LEROBOT_PYTHON": str(tmp_path / "no-lerobot" / "python")})
    assert result.returncode == 0, result.stderr[-3000:]
    (case,) = json.loads(result.stdout)["cases"]
    assert case["lerobot"] == {"ran": False, "reason": case["lerobot"]["reason"]}
    assert "no LeRobot environment" in case["lerobot"]["reason"]
    for side in ("sync", "sync_paced", "async"):
        assert case[side]["mean_ms"] > 0 and case[side]["p50_ms"] <= case[side]["p99_ms"] <= case[side]["max_ms"]
    # async's consume steps against sync's paced the same way (and against the back-to-back side)
    assert case["consume_ratio"] == case["async"]["consume_p50_ms"] / case["sync_paced"]["consume_p50_ms"]
    assert case["consume_ratio_back_to_back"] == case["async"]["consume_p50_ms"] / case["sync"]["consume_p50_ms"]
    assert case["sync"]["refills"] == 4                     # 40 steps, 10 rows per chunk: the network 4 times
    assert case["async"]["delay"] >= 1 and "async, inference delay" in case["async"]["schedule"]
    assert "bench chunking: case act10 done:" in result.stderr


def test_bench_chunking_reports_a_schedule_the_configuration_refuses(tmp_path):
    """A case whose auto delay cannot fit its chunk (a control rate far beyond the refill's)
    keeps its other sides and says, with the numbers, why async did not run."""
    from capsule_ros.benchmarks import chunking
    case = chunking.Case("too-fast", "act", 10000.0, chunk_size=10, n_action_steps=10)
    result = chunking.run_case(case, torch_device("cpu"), quick=True, steps=20, lerobot_python=None)
    assert result["sync"]["refills"] == 2
    assert result["async"]["ran"] is False
    assert re.search(r"refused at configure: inference_delay_steps auto measured a refill of [\d.]+ ms .* none "
                     r"left", result["async"]["reason"]), result["async"]["reason"]


def torch_device(name: str):
    import torch
    return torch.device(name)


def test_policy_is_an_option_of_bench_step_only():
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "snapshot", "--policy", "act"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode != 0 and "--policy act is an option of bench step only" in result.stderr


@pytest.mark.cuda
def test_bench_step_policy_act_on_the_gpu_captures_a_graph_that_acts_like_eager():
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "step", "--policy", "act",
                             "--quick", "--device", "cuda", "--json"], capture_output=True, text=True, timeout=600,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(result.stdout)["policies"]
    assert row["graph"]["graph_captured"] and row["graph_matches_eager"] and row["graph_speedup"] > 0


LEROBOT_PYTHON = REPO / "tools" / "lerobot_bench" / ".venv" / "bin" / "python"


@pytest.mark.skipif(not LEROBOT_PYTHON.exists(), reason="LeRobot's environment (tools/lerobot_bench/setup.sh) writes "
                    "the SmolVLA checkpoint; test_vla_parity.py covers the policy without it")
def test_bench_chunking_smolvla_against_lerobots_own_loop(tmp_path):
    """The tiny SmolVLA case: LeRobot writes the checkpoint, its loop and both session sides
    serve it; the sync side's actions are LeRobot's bit for bit (same noise, same task)."""
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "chunking", "--quick",
                             "--device", "cpu", "--cases", "smolvla-tiny", "--steps", "60", "--json"],
                            capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    (case,) = json.loads(result.stdout)["cases"]
    assert case["lerobot"]["ran"] and case["lerobot"]["lerobot"] == "0.6.1"
    phases = case["lerobot"]["phase_seconds"]               # where LeRobot's process spent its time
    assert set(phases) == {"imports", "load", "episode"} and min(phases.values()) > 0, phases
    assert phases["episode"] >= case["lerobot"]["mean_ms"] * 60 / 1e3       # the 60 timed steps are in it
    assert case["actions_equal_lerobot"] is True, case
    assert case["sync"]["refills"] == 2                      # 60 steps, 50 rows per chunk
    assert case["async"]["delay"] >= 1 and case["async"]["consume_p99_ms"] > 0


def test_bench_chunking_smolvla_without_lerobot_says_why(tmp_path):
    from capsule_ros.benchmarks import chunking
    result = chunking.run_case(chunking.CASES["smolvla-tiny"], torch_device("cpu"), quick=True, steps=10,
                               lerobot_python=tmp_path / "no-lerobot" / "python")
    for side in ("lerobot", "sync", "async"):
        assert result[side]["ran"] is False and "written by LeRobot" in result[side]["reason"]


@pytest.mark.skipif(not LEROBOT_PYTHON.exists(), reason="LeRobot's environment (tools/lerobot_bench/setup.sh) runs "
                    "LeRobot's side; test_lerobot_pi.py covers the policy without it")
def test_bench_chunking_pi0_and_pi05_against_lerobots_own_loop(tmp_path):
    """The tiny π0 and π0.5 cases: capsule_ros writes the checkpoint, LeRobot loads it (scaled)
    and runs its loop, both session sides serve it; the sync side's actions are LeRobot's bit
    for bit (same noise, same task, π0.5's prompt with the state of each planning step)."""
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "chunking", "--quick",
                             "--device", "cpu", "--cases", "pi0-tiny,pi05-tiny", "--steps", "60", "--json"],
                            capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    for case in json.loads(result.stdout)["cases"]:
        assert case["lerobot"]["ran"] and case["lerobot"]["lerobot"] == "0.6.1", case["case"]
        assert case["actions_equal_lerobot"] is True, case
        assert case["sync"]["refills"] == 2                  # 60 steps, 50 rows per chunk
        assert case["async"]["delay"] >= 1 and case["async"]["consume_p99_ms"] > 0


def test_bench_chunking_pi0_without_lerobot_still_runs_its_own_sides(tmp_path):
    from capsule_ros.benchmarks import chunking
    result = chunking.run_case(chunking.CASES["pi0-tiny"], torch_device("cpu"), quick=True, steps=10,
                               lerobot_python=tmp_path / "no-lerobot" / "python")
    assert result["lerobot"]["ran"] is False and "no LeRobot environment" in result["lerobot"]["reason"]
    for side in ("sync", "async"):                     # a session side's figures have no "ran" key
        assert result[side].get("ran", True) and result[side]["refills"] >= 1, result[side]


@pytest.mark.skipif(not LEROBOT_PYTHON.exists(), reason="LeRobot's environment (tools/lerobot_bench/setup.sh) writes "
                    "the SmolVLA checkpoint and runs LeRobot's side; test_bench_vla_without_lerobot_* covers the "
                    "capsule_ros sides without it")
def test_bench_vla_serves_each_kind_and_camera_count_as_lerobot_does(tmp_path):
    """bench vla's tiny cases with 1 and 3 cameras: both sides serve one checkpoint directory,
    the graph side's actions are LeRobot's bit for bit, chunks and consume steps are timed,
    and each verdict is reported against its target."""
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "vla", "--quick", "--device",
                             "cpu", "--cases", "smolvla-3cam,pi05-1cam", "--steps", "110", "--async-steps", "60",
                             "--lerobot-python", str(LEROBOT_PYTHON), "--json"],
                            capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = {case["case"]: case for case in json.loads(result.stdout)["cases"]}
    assert set(cases) == {"smolvla-3cam", "pi05-1cam"}
    for case in cases.values():
        assert case["lerobot"]["lerobot"] == "0.6.1" and case["actions_equal_lerobot"] is True, case
        for side in ("lerobot", "graph"):                   # 110 steps of a 50-row chunk: two chunks after the first
            assert case[side]["chunks_timed"] == 2 and case[side]["consume_p50_ms"] > 0, (side, case[side])
        assert case["chunk_target"] == (1 / 8 if case["kind"] == "smolvla" else 1 / 3)
        assert case["chunk_met"] == (case["chunk_ratio"] <= case["chunk_target"])
        assert case["async_misses_after_first"] == case["async"]["misses_steady"]
    assert cases["smolvla-3cam"]["graph"]["state_bytes"] > cases["pi05-1cam"]["graph"]["state_bytes"] > 0


def test_bench_vla_without_lerobot_runs_the_capsule_ros_sides_and_says_why(tmp_path):
    """No LeRobot environment: π0's graph and async sides still run (capsule_ros writes its
    checkpoint) and LeRobot's side says why it did not; SmolVLA, whose checkpoint LeRobot
    writes, says so on every side."""
    from capsule_ros.benchmarks import vla
    device = torch_device("cpu")
    written = vla.write_case(vla.CASES["pi0-2cam"], tmp_path / "pi0", quick=True, device=device, python=None,
                             weights_from=None)
    assert set(written.ports_of.values()) == {"joints", "camera0", "camera1"}
    result = vla.run_case(vla.CASES["pi0-2cam"], written, device, steps=60, async_steps=20, python=None,
                          tmp=tmp_path)
    assert result["lerobot"]["ran"] is False and "no LeRobot environment" in result["lerobot"]["reason"]
    assert result["graph"]["chunks_timed"] == 1 and result["graph"]["state_bytes"] > 0
    assert result["async"]["misses_steady"] == result["async_misses_after_first"]
    paced, asynchronous = result["sync_paced"], result["async"]          # async's consume steps over sync's paced alike
    assert result["graph"]["steps"] == 60 and paced["steps"] == asynchronous["steps"] == 20   # one paced episode
    assert result["consume_ratio"] == asynchronous["consume_p50_ms"] / paced["consume_p50_ms"]
    assert result["consume_p99_ratio"] == asynchronous["consume_p99_ms"] / paced["consume_p99_ms"]
    assert result["consume_ratio_met"] == (result["consume_ratio"] <= vla.CONSUME_RATIO_TARGET)
    assert result["consume_ratio_back_to_back"] == asynchronous["consume_p50_ms"] / result["graph"]["consume_p50_ms"]
    assert "chunk_ratio" not in result and "actions_equal_lerobot" not in result
    with pytest.raises(vla.ConfigError, match="written by LeRobot"):
        vla.write_case(vla.CASES["smolvla-1cam"], tmp_path / "smolvla", quick=True, device=device, python=None,
                       weights_from=None)


def test_bench_vla_runs_only_the_chosen_sides(tmp_path):
    """``--sides graph``: π0's back-to-back graph side runs and every other side says it was
    not chosen; an unknown side is refused in one line, naming the sides there are."""
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "vla", "--quick", "--device",
                             "cpu", "--cases", "pi0-1cam", "--sides", "graph", "--steps", "60", "--async-steps", "20",
                             "--lerobot-python", sys.executable, "--json"],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    case, = out["cases"]
    assert out["sides"] == ["graph"] and case["graph"]["chunks_timed"] == 1, case["graph"]
    for side in ("lerobot", "sync_paced", "async"):
        assert case[side] == {"ran": False, "reason": "not chosen (--sides)"}, (side, case[side])
    assert "consume_ratio" not in case and "chunk_ratio" not in case
    refused = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "vla", "--quick", "--device",
                              "cpu", "--sides", "graph,lerobto"], capture_output=True, text=True, timeout=120,
                             cwd=REPO)
    assert refused.returncode != 0 and "lerobto" in refused.stderr and "sync_paced" in refused.stderr
    assert refused.stderr.strip().count("\n") == 0, refused.stderr


def test_a_pi_checkpoint_of_another_camera_count_links_the_same_weights(tmp_path):
    from capsule_ros.benchmarks import vla
    device = torch_device("cpu")
    first = vla.write_case(vla.CASES["pi0-1cam"], tmp_path / "a", True, device, None, None)
    third = vla.write_case(vla.CASES["pi0-3cam"], tmp_path / "b", True, device, None, first.checkpoint)
    weights = [w.checkpoint / "model.safetensors" for w in (first, third)]
    assert weights[0].stat().st_ino == weights[1].stat().st_ino
    assert len(third.camera_keys) == 3 and len(third.config.ports) == 5          # joints, 3 cameras, task


def test_async_steps_is_an_option_of_bench_vla_only():
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "chunking", "--async-steps", "10"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode != 0 and "--async-steps is an option of bench vla only" in result.stderr


@pytest.mark.skipif(not LEROBOT_PYTHON.exists(), reason="bench/compare_vla_layers.py runs LeRobot and capsule_ros in "
                    "one process, LeRobot's (tools/lerobot_bench/setup.sh); test_vla_parity.py and "
                    "test_lerobot_pi.py compare the actions without it")
@pytest.mark.parametrize("case", ["smolvla-1cam", "pi0-1cam"])
def test_compare_vla_layers_finds_no_difference_where_the_bits_agree(tmp_path, case):
    """On the CPU, where both kinds give LeRobot's bits: the tool reports every action
    bit-identical, every shared weight equal, and no module whose output differs; its report
    names the modules it compared (so "none" is not an empty comparison)."""
    result = subprocess.run([str(LEROBOT_PYTHON), "bench/compare_vla_layers.py", str(tmp_path), "--case", case,
                             "--quick", "--device", "cpu"], capture_output=True, text=True, timeout=900, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'examples' / 'gru_policy'}",
                                 "CAPSULE_ROS_WITHOUT_ROS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "compare_vla_layers.txt").read_text()
    for pair in ("capsule_ros graph vs capsule_ros eager", "capsule_ros eager vs LeRobot deterministic"):
        assert f"{pair}: bit-identical (max 0)" in report, report
    assert re.search(r"weights with the same name on both sides: [1-9]\d*, different: 0", report), report
    compared = [int(n) for n in re.findall(r"modules compared: (\d+)", report)]
    assert len(compared) == 2 and min(compared) > 50, report
    assert report.count("first divergence: none") == 2, report
