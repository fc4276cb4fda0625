"""LeRobot checkpoints served by the installed policy_node, through ROS.

For each fixture checkpoint (ACT with an action queue, ACT with temporal ensembling,
Diffusion with a camera), one policy_node process serves it from the unpacked
``pretrained_model/`` directory (policy.kind lerobot_act / lerobot_diffusion), fed the
fixture's recorded inputs as real JointState, Image and Float32MultiArray messages in
trigger mode. One scenario per node, recorded through ``~/record``: reset, K steps,
commit, N - K steps, re-enter the commit (a rollback), the same N - K steps again, reset,
two steps, then a behaviour tree (``capsule_ros.bt.pause.interrupt_then_resume``, the
guide's tree) interrupts the episode, two triggers arrive while it holds, and it resumes
for four more steps. The tests check it against LeRobot's recorded actions and the in-process
policy, and verify the bag with ``capsule-ros replay --verify`` in a fresh process (and
that a replay whose re-entry leaves the policy's episode state out diverges).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import numpy as np
import py_trees
import pytest
from harness import REPO, ClientNode, FixtureDriver, start_policy_node, wait_for
from lerobot_fixtures import PORTS, Fixture

from capsule_ros.bt import INTERRUPT_KEY, interrupt_then_resume, tick_until_done
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_runtime

pytestmark = pytest.mark.ros
NAMES = ["act_queue", "act_ensemble", "diffusion"]
K, N = 6, 13              # commit after step K - 1: mid-queue for ACT (5 actions) and Diffusion (8)
HELD, RESUMED = range(2, 4), range(2, 6)      # inputs while interrupted (after 2 steps), after the resume
# LeRobot's actions, made at another CPU numerics level (test_lerobot_parity.py; 3.8e-6 at most here);
# the in-process policy's: bit for bit
TOLERANCE = 1e-5


class Call(py_trees.behaviour.Behaviour):
    """A leaf that runs ``fn`` on its first tick and succeeds (what an operator does while
    the policy holds: here, send the next sensor messages)."""

    def __init__(self, name: str, fn):
        super().__init__(name)
        self.fn = fn

    def update(self):
        self.fn()
        return py_trees.common.Status.SUCCESS


def values(actions) -> np.ndarray:
    return np.stack([np.asarray(a.values, np.float32) for a in actions])


def chunks(actions) -> List[bytes]:
    return [np.asarray(a.chunk, np.float32).tobytes() for a in actions]


@dataclass
class Served:
    fixture: Fixture
    bag: Path
    first: list           # steps 0..K-1 of a fresh episode
    rest: list            # steps K..N-1
    again: list           # steps K..N-1 after re-entering the commit at K
    after_reset: list     # steps 0, 1 of the next episode
    held: list            # what the node published for the triggers while the tree held the episode
    resumed: list         # steps 2..5 of that episode after the tree resumed it
    tree_status: str
    interrupt_capsule: str
    rollback: bool
    commit_step: int
    in_process: np.ndarray          # steps 0..N-1 from the in-process policy
    in_process_chunk0: bytes
    log: str


@pytest.fixture(scope="module", params=NAMES)
def served(request, tmp_path_factory, rclpy_context) -> Served:
    name = request.param
    tmp = tmp_path_factory.mktemp(f"lerobot_node_{name}")
    fixture = Fixture.load(name, tmp)
    ns = f"/lr_{name}"
    proc = start_policy_node(tmp, fixture.node_params(), namespace=ns, tag=name)
    client = ClientNode(rclpy_context, f"lerobot_{name}_client", node_path=f"{ns}/capsule_policy")
    try:
        driver = FixtureDriver(client, ns, fixture)
        bag = tmp / "bag"
        driver.capsules.record(True, str(bag), "mcap")
        driver.capsules.reset()
        first = driver.run(range(K))
        capsule = driver.capsules.commit(label="k").capsule
        rest = driver.run(range(K, N))
        reentered = driver.capsules.reenter(capsule.id)
        again = driver.run(range(K, N))
        driver.capsules.reset()
        after_reset = driver.run(range(2))
        held: list = []
        tree = py_trees.trees.BehaviourTree(interrupt_then_resume(
            Call("OperatorTakesOver", lambda: held.extend(driver.run(HELD))), node_path=f"{ns}/capsule_policy",
            server_wait_s=10.0, call_timeout_s=5.0))
        tree.setup(node=client.node, timeout=15)
        status = tick_until_done(tree, period_s=0.01, timeout_s=120)
        interrupt_capsule = str(py_trees.blackboard.Blackboard.get(INTERRUPT_KEY))
        resumed = driver.run(RESUMED)
        driver.capsules.record(False)
    finally:
        client.close()
        code = proc.stop()
    assert code == 0, proc.log()[-3000:]
    runtime = build_runtime(ServingConfig.from_params(fixture.serving_params()))
    runtime.reset(episode=1, seed=fixture.seed(0))
    reference, chunk0 = [], b""
    for t in range(N):
        for key, value in fixture.features.items():
            runtime.staging[PORTS[key]][...] = value[0, t]
        runtime.load_inputs()
        runtime.step()
        out = runtime.read_outputs()
        reference.append(out.action)
        chunk0 = chunk0 or out.chunk.astype(np.float32).tobytes()
    return Served(fixture, bag, first, rest, again, after_reset, held, resumed, status.name, interrupt_capsule,
                  reentered.rollback, int(capsule.step), np.stack(reference), chunk0, proc.log())


def test_actions_through_ros_are_lerobots_and_the_in_process_policys(served):
    got = values(served.first + served.rest)
    assert all(a.source == a.SOURCE_POLICY for a in served.first + served.rest)
    assert [a.step for a in served.first + served.rest] == list(range(1, N + 1))
    expected = served.fixture.outputs["action"][0, :N]
    diff = float(np.abs(got - expected).max())
    print(f"{served.fixture.name}: {N} actions through ROS, max abs diff to LeRobot {diff:.3g}")
    assert diff <= TOLERANCE
    assert got.tobytes() == served.in_process.tobytes()


def test_commit_then_rollback_reproduces_the_actions_bit_identically(served):
    assert served.rollback and served.commit_step == K
    assert [a.step for a in served.again] == [a.step for a in served.rest]
    assert values(served.again).tobytes() == values(served.rest).tobytes()
    assert chunks(served.again) == chunks(served.rest)


def test_reset_gives_a_fresh_policys_first_action(served):
    first, fresh = served.after_reset[0], served.first[0]
    assert first.episode_id == fresh.episode_id + 1 and first.step == 1 and first.lineage == ""
    assert np.asarray(first.values, np.float32).tobytes() == np.asarray(fresh.values, np.float32).tobytes()
    assert chunks([first]) == chunks([fresh]) == [served.in_process_chunk0]
    assert values(served.after_reset).tobytes() == values(served.first[:2]).tobytes()


def test_a_behaviour_tree_interrupts_and_resumes_the_episode_exactly(served):
    """While interrupted the node answers each trigger with the held action (HOLD_LAST) and
    steps no policy; after the tree re-enters the interrupt capsule, the actions are those
    of an episode that was never interrupted (the first episode, same inputs), bit for bit."""
    assert served.tree_status == "SUCCESS" and served.interrupt_capsule
    last = served.after_reset[-1]
    assert [a.source for a in served.held] == [last.SOURCE_HOLD] * len(HELD)
    assert all(np.asarray(a.values, np.float32).tobytes() == np.asarray(last.values, np.float32).tobytes()
               for a in served.held)
    assert [a.step for a in served.resumed] == [t + 1 for t in RESUMED]
    assert all(a.source == a.SOURCE_POLICY and a.episode_id == last.episode_id for a in served.resumed)
    assert all(a.lineage == served.interrupt_capsule for a in served.resumed)
    uninterrupted = served.first[RESUMED.start:RESUMED.stop]
    assert values(served.resumed).tobytes() == values(uninterrupted).tobytes()
    assert chunks(served.resumed) == chunks(uninterrupted)


def test_the_recorded_bag_verifies_in_a_fresh_process(served):
    result = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "replay", str(served.bag), "--verify",
                             "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["identical"] and report["first_divergence"] is None
    interrupted = 1 + len(HELD) + len(RESUMED)        # the safe action the interrupt publishes, held, resumed
    assert report["steps_compared"] == report["steps_matched"] == K + 2 * (N - K) + 2 + interrupted
    assert report["events_replayed"] == {"RESET": 2, "COMMIT": 1, "REENTER": 2, "INTERRUPT": 1}


def test_a_reentry_restoring_only_the_metadata_diverges_at_the_next_step(served):
    """The queue, the ensemble and Diffusion's observation history are load-bearing: the same
    bag replayed with re-entries that restore only the metadata (``--ablation kv-meta``,
    the policy's CHUNK and CONV buffers left as they were) diverges at the first step after
    the re-entry, so the verification above can fail."""
    from capsule_ros.bag.replay import ReplayOptions, replay_bag
    verdict = replay_bag(served.bag, ReplayOptions(ablation="kv-meta"))
    assert not verdict.identical and verdict.first_divergence is not None
    assert verdict.first_divergence.step == K + 1 and "values" in verdict.first_divergence.what


def test_a_bad_map_stops_the_node_at_start_naming_the_key(tmp_path):
    """A camera feature fed by a JointState port: exit 2 with one line naming the port and
    the key, before the (here unreadable) weights are touched."""
    fixture = Fixture.load("act_queue", tmp_path)
    (fixture.checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    params = fixture.node_params()
    params["ports"]["front_camera"].update(type="sensor_msgs/msg/JointState", fields=["position"])
    proc = start_policy_node(tmp_path, params, namespace="/lr_bad", tag="bad_map")
    start = time.monotonic()
    try:
        wait_for(lambda: not proc.alive(), timeout=60, what="policy_node to exit")
    finally:
        code = proc.stop()
    log = proc.log()
    assert code == 2, log[-2000:]
    assert "invalid configuration" in log and "'front_camera'" in log and "'observation.images.front'" in log, log
    assert "safetensors" not in log and "Traceback" not in log, log
    print(f"policy_node exited {time.monotonic() - start:.1f} s after start (process start-up included)")


def test_node_reports_the_lerobot_kind_and_device(served):
    assert "serving on cpu" in served.log, served.log[-2000:]
    params: Dict[str, object] = served.fixture.node_params()["policy"]
    assert params["kind"] == served.fixture.kind
