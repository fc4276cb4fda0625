"""The main job, as a user runs it: `capsule-ros demo` on the built-in simulated arm with the
shipped default policy, through the ROS 2 node. Its output is then checked with the
package's own tools (`capsule-ros inspect`, `capsule-ros replay --verify`)."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

pytestmark = pytest.mark.ros


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    start = time.monotonic()
    proc = subprocess.run(["capsule-ros", "demo", "--episodes", "50", "--headless", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    print(f"\ncapsule-ros demo --episodes 50: exit {proc.returncode} in {elapsed:.1f} s")
    return proc, out


def test_demo_succeeds_and_proves_the_rollback(demo_run):
    proc, out = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    for key in ("episodes", "success_rate", "steps", "step_p50_ms", "step_p99_ms", "restore_p50_us",
                "restore_p99_us", "identical_after_rollback"):
        assert summary[key] is not None, key
    print(f"success rate {summary['success_rate']:.2f} over {summary['episodes']} episodes, "
          f"{summary['steps']} steps, step p50 {summary['step_p50_ms']:.2f} ms, "
          f"restore p50 {summary['restore_p50_us']:.0f} us")
    assert summary["episodes"] == 50
    assert summary["success_rate"] >= 0.9               # the shipped policy, through ROS
    assert summary["identical_after_rollback"] is True
    assert summary["compared_steps"] >= 10 or "missed its deadline" in summary["rollback_check"]
    verdict = summary["bag_verdict"]          # the demo proves its run from its own bag too
    assert verdict["exit_code"] == 0 and verdict["steps_compared"] >= summary["steps"] - 5, verdict
    kinds = [e["kind"] for e in summary["capsule_events"]]
    for kind in ("COMMIT", "INTERRUPT", "REENTER", "FORK", "RESET", "SAVE"):
        assert kind in kinds, kind
    assert any(e["kind"] == "REENTER" and e["rollback"] for e in summary["capsule_events"])
    assert (out / "report.png").stat().st_size > 20_000
    assert summary["failures"] == []


def test_demo_capsules_verify_with_inspect(demo_run):
    _, out = demo_run
    files = sorted((out / "capsules").glob("*.capsule"))
    assert len(files) >= 2                               # the start capsule and the interrupt capsule
    for path in files:
        result = subprocess.run(["capsule-ros", "inspect", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr


def test_demo_bag_replays_bit_identically(demo_run):
    _, out = demo_run
    assert (out / "bag" / "metadata.yaml").is_file()
    result = subprocess.run(["capsule-ros", "replay", str(out / "bag"), "--verify", "--in-process",
                             "--capsule-dir", str(out / "capsules")],
                            capture_output=True, text=True, timeout=300)
    print(result.stdout[-1500:])
    assert result.returncode == 0, result.stdout + result.stderr


def test_demo_passes_under_a_cpu_hog(tmp_path):
    """A busy-looping process on every core (as a loaded robot computer): the demo still
    passes, run after run; a deadline miss is reported as such, never as a divergence."""
    import multiprocessing
    import os
    runs = int(os.environ.get("CAPSULE_DEMO_HOG_RUNS", "5"))
    hogs = [subprocess.Popen(["python3", "-c", "while True: pass"]) for _ in range(multiprocessing.cpu_count())]
    outcomes = []
    try:
        for i in range(runs):
            out = tmp_path / f"run{i}"
            proc = subprocess.run(["capsule-ros", "demo", "--episodes", "2", "--headless", "--out", str(out)],
                                  capture_output=True, text=True, timeout=600)
            summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
            outcomes.append((proc.returncode, summary.get("rollback_check"), summary.get("failures"),
                             proc.stderr[-500:] if proc.returncode else ""))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print("\n".join(f"run {i}: exit {code}, {check}" for i, (code, check, _, _) in enumerate(outcomes)))
    assert [o[0] for o in outcomes] == [0] * runs, outcomes
