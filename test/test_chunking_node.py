"""Asynchronous chunking through the installed policy_node, with capsules at random moments.

One policy_node serves the ACT fixture (chunk 10, 5 executed) with ``control.chunking:
async`` and a fixed ``inference_delay_steps`` of 3, fed the fixture's recorded inputs as
JointState and Image messages in trigger mode, recording through ``~/record``. A seeded
schedule commits, forks, interrupts, re-enters (the interrupt capsule, or an earlier
commit: a rollback), re-enters forks and resets at random steps, while refills are in
flight or not. Then:

- every action the policy published before the first re-entry equals LeRobot's own
  fixed-delay loop (``async.npz``, d = 3) bit for bit, and a safe action appears only at a
  chunk takeover whose refill was late (counted in ``~/status``);
- every action after a re-entry of a capsule repeats the actions that followed its commit
  the first time, bit for bit;
- ``capsule-ros replay --verify`` of the bag, in a fresh process, is bit-identical, and
  the bag records the delay.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Dict, List, Tuple

import numpy as np
import pytest
from harness import REPO, ClientNode, FixtureDriver, start_policy_node, timeline_repeats
from lerobot_fixtures import Fixture, load_npz, reference_path

pytestmark = pytest.mark.ros
DELAY, STEPS = 3, 60


@pytest.fixture(scope="module")
def run(tmp_path_factory, rclpy_context):
    tmp = tmp_path_factory.mktemp("chunking_node")
    fixture = Fixture.load("act_queue", tmp)
    params = fixture.node_params()
    params["control"].update(chunking="async", inference_delay_steps=str(DELAY))
    ns = "/chunked"
    proc = start_policy_node(tmp, params, namespace=ns, tag="chunked")
    client = ClientNode(rclpy_context, "chunking_client", node_path=f"{ns}/capsule_policy")
    schedule = random.Random(7)
    log: List[Tuple[str, object]] = []          # ("step", (t, action)), ("commit", ...), ...
    try:
        driver = FixtureDriver(client, ns, fixture)
        bag = tmp / "bag"
        driver.capsules.record(True, str(bag), "mcap")
        driver.capsules.reset()
        commits: Dict[str, int] = {}            # capsule id -> the step its state is at
        t = 0
        reentered = False
        while t < STEPS:
            log.append(("step", (t, driver.step(0, t))))
            t += 1
            roll = schedule.random()
            if roll < 0.12:
                capsule = driver.capsules.commit(label=f"at {t}").capsule
                commits[capsule.id] = t
                log.append(("commit", (capsule.id, t)))
            elif roll < 0.18 and commits:
                source = schedule.choice(sorted(commits))
                fork = driver.capsules.fork(source, label="branch").capsule
                commits[fork.id] = commits[source]
                log.append(("fork", (fork.id, source)))
            elif roll < 0.24 and t > 2:
                interrupt = driver.capsules.interrupt(commit=True)
                held = driver.step(0, t)                     # a trigger while interrupted: the held action
                log.append(("interrupt", (interrupt.capsule.id, t, held)))
                driver.capsules.reenter("")
                reentered = True
                log.append(("reenter", ("", t)))
            elif roll < 0.32 and commits and t > 8:
                target = schedule.choice(sorted(commits))
                driver.capsules.reenter(target)
                reentered = True
                log.append(("reenter", (target, commits[target])))
                t = commits[target]
            if not reentered:
                log.append(("clean", t))
        status = client.drain(driver.status)[-1] if driver.status.qsize() else None
        driver.capsules.record(False)
    finally:
        client.close()
        code = proc.stop()
    assert code == 0, proc.log()[-3000:]
    return fixture, bag, log, status


def test_policy_actions_equal_lerobots_fixed_delay_loop_until_the_first_reentry(run):
    fixture, _, log, _ = run
    reference = load_npz(reference_path("act_queue", "async.npz"))[f"action_d{DELAY}"][0]
    clean_until = max((t for kind, t in log if kind == "clean"), default=0)
    steps = [entry for kind, entry in log if kind == "step"][:clean_until]
    assert len(steps) >= 10, "the schedule re-entered too early to compare"
    late_takeovers = 0
    end = 5 + DELAY                                    # rows delay .. end - 1 of each chunk (chunk 10, 5 executed)
    for t, action in steps:
        values = np.asarray(action.values, np.float32)
        if action.source == action.SOURCE_POLICY:
            assert values.tobytes() == reference[t].tobytes(), t
        else:                                          # a late refill: only at a takeover (step end, end + 5, ...)
            assert t >= end and (t - end) % 5 == 0, (t, action.source)
            late_takeovers += 1
    assert late_takeovers < len(steps) // 5 + 1


def test_actions_after_every_reentry_repeat_the_first_timeline_bit_for_bit(run):
    """A step index reached again after re-entering a capsule gives the same action as the
    first time that index followed that capsule's state (policy actions; the safe action of
    a late refill is a timing event, not part of the timeline)."""
    _, _, log, _ = run
    repeated = timeline_repeats(log)
    assert repeated > 0 or not any(kind == "reenter" and entry[0] for kind, entry in log)


def test_the_async_bag_verifies_bit_identically_in_a_fresh_process(run):
    _, bag, log, _ = run
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "replay", str(bag), "--verify", "--json"],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["identical"] and report["first_divergence"] is None, report
    kinds = {kind for kind, _ in log}
    assert {"commit", "reenter"} <= kinds
    import yaml
    info = yaml.safe_load((bag / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    chunking = json.loads(info["custom_data"]["capsule_ros.chunking"])
    assert chunking == {"chunking": "async", "inference_delay_steps": str(DELAY), "execution_horizon": 0}
