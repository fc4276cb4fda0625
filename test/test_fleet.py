"""Many robots from the batch slots of one runtime: the fleet core and its sessions (no ROS).

The exactness contract (docs/fleet.md), with randomised neighbours, occupancy and placement:

- (a) a robot's actions are byte-identical whatever the other slots hold (random bytes,
  random inputs), whether they step with it, and in which slot it sits; a slot that does
  not step keeps every byte;
- (b) batch size: a batched (vmap) fleet's fingerprint includes S, and a capsule made under
  another S is refused with that reason; the loop batching is batch-invariant (a single
  runtime's bits and fingerprint);
- (c) each robot's counter-based RNG is keyed by its own seed and step, never its slot;
- per-robot verbs act on one slot while the others keep stepping, and a capsule one robot
  took is re-entered by another;
- trigger-mode robots are gathered into one fleet step (complete, or at the bounded
  wait), timer-mode robots step together; a faulty step gets one robot its safe action.

The CUDA cases run the same checks with captured graphs on a GPU (``bench/run_gpu.sh tests``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import pytest
import torch
from runtime_fixtures import INPUTS, SMALL, default_config, feed, make_policy, make_runtime, run

from capsule_ros.capsules.fileformat import read_header
from capsule_ros.config import ConfigError
from capsule_ros.errors import FingerprintMismatch
from capsule_ros.fleet import FleetConfig, FleetRobot, build_fleet
from capsule_ros.runtime.arena import BufferKind
from capsule_ros.runtime.engine import RuntimeConfig
from capsule_ros.runtime.fleetbuild import build_fleet_runtime
from capsule_ros.runtime.policy import StatefulPolicy, standard_specs
from capsule_ros.runtime.schema import STATE_KINDS
from capsule_ros.serving.factory import build_session
from capsule_ros.serving.records import ActionSource, EpisodeState, StepFault

NOISY = dataclasses.replace(SMALL, action_noise_std=0.5)        # draws from the counter RNG every step
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def fleet_actions(me: int, slots: int, obs: np.ndarray, seed: int, *, device: str = "cpu",
                  batching: str = "vmap", robot_seed: int = 0) -> np.ndarray:
    """Robot in slot ``me`` of a fleet of ``slots`` fed ``obs``; every other slot holds random
    bytes, steps with it at random with random inputs. Checks every step that the slots
    that did not step kept every byte. The robot's actions."""
    rng = np.random.default_rng(seed)
    seeds = [int(s) for s in rng.integers(0, 2**31 - 1, slots)]
    seeds[me] = robot_seed
    fleet = build_fleet_runtime(make_policy(NOISY), RuntimeConfig(device=device), slots=slots, batching=batching,
                                seeds=seeds)
    for other in range(slots):
        if other != me:
            noise = torch.from_numpy(rng.integers(0, 256, fleet.arena.stride, dtype=np.uint8))
            fleet.arena.rows[other].copy_(noise.to(fleet.device))
    actions = []
    for row in obs:
        ready = sorted({me} | {int(s) for s in rng.permutation(slots)[:rng.integers(0, slots)]})
        idle = {slot: fleet.arena.rows[slot].clone() for slot in range(slots) if slot not in ready}
        for slot in ready:
            runtime = fleet.runtime(slot)
            values = row if slot == me else rng.normal(size=6).astype(np.float32)
            runtime.staging["joints"][:] = values[:4]
            runtime.staging["goal"][:] = values[4:]
            runtime.load_inputs()
        fleet.step(list(rng.permutation(ready)))
        actions.append(fleet.runtime(me).read_step_outputs().action)
        for slot, before in idle.items():
            assert torch.equal(fleet.arena.rows[slot], before), f"slot {slot} did not step but its bytes changed"
    fleet.close()
    return np.stack(actions)


@pytest.mark.parametrize("device", DEVICES)
def test_a_robots_actions_do_not_depend_on_its_neighbours_their_occupancy_or_its_slot(device):
    obs = np.random.default_rng(7).normal(size=(12, 6)).astype(np.float32)
    trials = [fleet_actions(me, 4, obs, seed, device=device) for me, seed in ((0, 1), (3, 2), (1, 3), (2, 4))]
    for other in trials[1:]:
        assert other.tobytes() == trials[0].tobytes()


def test_an_idle_fleet_slot_keeps_every_byte_through_verbs_of_the_others(tmp_path):
    fleet = build_fleet(default_config(tmp_path), FleetConfig(robots=("a", "b"), slots=3))
    obs = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
    spare = fleet.runtime.arena.rows[2].clone()
    b_before = fleet.runtime.arena.rows[fleet.robot("b").slot].clone()
    feed(fleet.robot("a"), obs)
    capsule = fleet.robot("a").verbs.commit("a")
    fleet.robot("a").verbs.reenter(capsule.id)
    fleet.robot("a").verbs.reset()
    assert torch.equal(fleet.runtime.arena.rows[2], spare)
    assert torch.equal(fleet.runtime.arena.rows[fleet.robot("b").slot], b_before)
    fleet.release()


def test_the_loop_batching_is_batch_invariant_a_single_runtimes_bits_and_fingerprint():
    obs = np.random.default_rng(3).normal(size=(10, 6)).astype(np.float32)
    single = make_runtime(NOISY)
    reference = run(single, obs)
    for me, slots, seed in ((0, 1, 0), (2, 3, 1)):
        assert fleet_actions(me, slots, obs, seed, batching="loop").tobytes() == reference.tobytes()
    fleet = build_fleet_runtime(make_policy(NOISY), RuntimeConfig(), slots=3, batching="loop")
    assert fleet.fingerprint == single.fingerprint


def on(device: str, config):
    """``config`` on ``device`` (default_config is the CPU's)."""
    return dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_a_batched_fleets_fingerprint_includes_its_slot_count_and_refuses_a_capsule_of_another(tmp_path, device):
    config = on(device, default_config(tmp_path))
    two = build_fleet(config, FleetConfig(robots=("a", "b"), slots=2))
    feed(two.robot("a"), np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32))
    capsule = two.robot("a").verbs.commit("made under S = 2", persist=True)
    header = read_header(Path(capsule.path), max_bytes=1 << 30)
    assert header.fingerprint_parts is not None and "fleet_slots 2" in header.fingerprint_parts.kernel
    assert two.runtime.captured == (device == "cuda")
    fingerprint = two.runtime.fingerprint
    two.release()
    three = build_fleet(config, FleetConfig(robots=("a", "b"), slots=3))
    assert three.runtime.fingerprint != fingerprint
    before = three.runtime.arena.storage.clone()
    with pytest.raises(FingerprintMismatch, match="fleet_slots 2"):
        three.robot("b").verbs.reenter(capsule.id)
    assert torch.equal(three.runtime.arena.storage, before)
    three.release()


def test_each_robots_rng_is_keyed_by_its_own_seed_never_by_its_slot():
    obs = np.random.default_rng(5).normal(size=(8, 6)).astype(np.float32)
    in_slot_0 = fleet_actions(0, 3, obs, seed=1, robot_seed=11)
    in_slot_2 = fleet_actions(2, 3, obs, seed=2, robot_seed=11)
    other_seed = fleet_actions(2, 3, obs, seed=2, robot_seed=12)
    assert in_slot_0.tobytes() == in_slot_2.tobytes()
    assert not np.array_equal(in_slot_0, other_seed)


def robot_run(fleet, name: str, obs: np.ndarray, others: Sequence[str] = (), seed: int = 0) -> List[np.ndarray]:
    """``obs`` fed to robot ``name`` while ``others`` step with it on random inputs, one fleet
    step per row; the robot's actions."""
    rng = np.random.default_rng(seed)
    out = []
    for row in obs:
        fleet.robot(name).loop.write_input("joints", row[:4])
        fleet.robot(name).loop.write_input("goal", row[4:])
        for other in others:
            fleet.robot(other).loop.write_input("joints", rng.normal(size=4).astype(np.float32))
            fleet.robot(other).loop.write_input("goal", rng.normal(size=2).astype(np.float32))
        out.append(fleet.tick([name, *others])[name].values)
    return out


def test_verbs_act_on_one_robots_slot_while_the_others_keep_stepping(tmp_path):
    obs = np.random.default_rng(1).normal(size=(16, 6)).astype(np.float32)
    quiet = build_fleet(default_config(tmp_path / "quiet"), FleetConfig(robots=("a", "b"), slots=2))
    b_alone = robot_run(quiet, "b", obs)
    quiet.release()
    fleet = build_fleet(default_config(tmp_path / "busy"), FleetConfig(robots=("a", "b"), slots=2))
    a, b = fleet.robot("a"), fleet.robot("b")
    b_actions = robot_run(fleet, "b", obs[:4], others=["a"])
    start = a.verbs.commit("start", persist=True)
    b_actions += robot_run(fleet, "b", obs[4:8], others=["a"], seed=1)
    a.verbs.interrupt()
    assert a.episode.state == EpisodeState.INTERRUPTED and b.episode.state == EpisodeState.RUNNING
    b_actions += robot_run(fleet, "b", obs[8:10], others=["a"], seed=2)
    assert fleet.tick(["a"])["a"].source == ActionSource.HOLD
    a.verbs.reenter()
    fork = a.verbs.fork(start.id, "branch")
    a.verbs.drop(start.id)
    a.verbs.save(fork.id)
    a.verbs.drop(fork.id)
    a.verbs.load(fork.id)
    assert fork.id in {c.id for c in a.verbs.list()}
    a.verbs.reset(fork.id)
    b_actions += robot_run(fleet, "b", obs[10:], others=["a"], seed=3)
    assert b.episode.episode_id == 1 and b.episode.step == len(obs)
    assert np.stack(b_actions).tobytes() == np.stack(b_alone).tobytes()
    fleet.release()


@pytest.mark.parametrize("device", DEVICES)
def test_a_capsule_one_robot_took_is_reentered_by_another_and_continues_bit_identically(tmp_path, device):
    obs = np.random.default_rng(2).normal(size=(12, 6)).astype(np.float32)
    fleet = build_fleet(on(device, default_config(tmp_path)), FleetConfig(robots=("a", "b", "c"), slots=4))
    robot_run(fleet, "a", obs[:6], others=["b"])
    moved = fleet.robot("a").verbs.commit("to move")
    a_goes_on = robot_run(fleet, "a", obs[6:], others=["c"], seed=5)
    fleet.robot("b").verbs.reenter(moved.id)
    fleet.robot("c").verbs.reset(moved.id)
    b_goes_on = robot_run(fleet, "b", obs[6:], others=["a"], seed=6)
    c_goes_on = robot_run(fleet, "c", obs[6:], seed=7)
    assert np.stack(b_goes_on).tobytes() == np.stack(a_goes_on).tobytes()
    assert np.stack(c_goes_on).tobytes() == np.stack(a_goes_on).tobytes()
    fleet.release()


@pytest.mark.parametrize("device", DEVICES)
def test_a_robots_nonfinite_step_gets_it_the_safe_action_and_is_undone_the_others_step_on(tmp_path, device):
    fleet = build_fleet(on(device, default_config(tmp_path)), FleetConfig(robots=("a", "b"), slots=2))
    obs = np.random.default_rng(4).normal(size=(3, 6)).astype(np.float32)
    robot_run(fleet, "a", obs, others=["b"])
    a_slot = fleet.runtime.runtime(fleet.robot("a").slot)
    state = a_slot.arena.storage.clone()
    fleet.robot("a").loop.write_input("joints", np.full(4, np.inf, dtype=np.float32))
    records = fleet.tick()
    assert records["a"].fault == StepFault.NONFINITE and records["a"].source == ActionSource.HOLD
    assert records["b"].fault == StepFault.NONE and records["b"].source == ActionSource.POLICY
    start, end = a_slot.layout.byte_range(*STATE_KINDS, BufferKind.OUTPUT)
    assert torch.equal(a_slot.arena.storage[start:end], state[start:end])
    assert fleet.status().robots["a"].counters.nonfinite_steps == 1
    fleet.release()


def test_trigger_robots_are_gathered_into_one_fleet_step_up_to_the_bounded_wait(tmp_path):
    records: Dict[str, list] = {"a": [], "b": [], "c": []}
    fleet = build_fleet(default_config(tmp_path), FleetConfig(robots=("a", "b", "c"), gather_ms=50.0),
                        on_action=lambda name, record: records[name].append(record))
    for name in records:
        fleet.robot(name).loop.write_input("goal", np.zeros(2, dtype=np.float32))
    joints = _joint_state
    assert not fleet.robot("a").loop.feed("joints", joints(1)).stepped
    assert not fleet.robot("b").loop.feed("joints", joints(2)).stepped
    fed = fleet.robot("c").loop.feed("joints", joints(3))
    assert fed.stepped and fed.record is records["c"][-1]
    assert [len(r) for r in records.values()] == [1, 1, 1] and fleet.status().fleet_steps == 1
    fleet.robot("a").loop.feed("joints", joints(4))
    assert fleet.poll() == {} and fleet.next_poll() is not None       # c and b have not asked yet
    fleet.robot("a").loop.feed("joints", joints(5))                      # a asks again: its first request steps
    assert len(records["a"]) == 2 and fleet.status().gathers.flushed == 1
    fleet.gather.wait_s = 0.0
    assert set(fleet.poll()) == {"a"}
    assert fleet.status().gathers.timed_out == 1 and fleet.status().fleet_steps == 3
    fleet.release()


def test_a_robots_waiting_step_runs_before_its_next_message_is_recorded(tmp_path):
    """The node records a message inside ``loop.receiving()``: a robot's gathered step that
    still waits (the others have not asked) runs on entering it, so the robot's bag has that
    step's action before the next message, and an event published by a verb that comes
    next lands after both, as in a policy_node's bag. (A fleet_node's bag had trigger,
    trigger, action: the replay stepped the second trigger before a REENTER that the
    recorded step followed, and found it DIVERGED.)"""
    order: List[str] = []
    fleet = build_fleet(default_config(tmp_path), FleetConfig(robots=("a", "b"), gather_ms=1000.0),
                        on_action=lambda name, record: order.append(f"action {name} {record.source.name}"))
    for name in ("a", "b"):
        fleet.robot(name).loop.write_input("goal", np.zeros(2, dtype=np.float32))
    loop = fleet.robot("a").loop
    with loop.receiving():
        order.append("recorded joints 1")
        assert not loop.feed("joints", _joint_state(1)).stepped                 # waits for b
    assert fleet.gather.pending("a") and order == ["recorded joints 1"]
    with loop.receiving():                                                       # a's next message
        order.append("recorded joints 2")
        assert not loop.feed("joints", _joint_state(2)).stepped
    assert order == ["recorded joints 1", "action a POLICY", "recorded joints 2"]
    fleet.robot("a").verbs.interrupt(commit=False)                               # the verb: after both
    fleet.gather.wait_s = 0.0
    fleet.poll()
    assert order[-1] == "action a HOLD" and fleet.status().gathers.flushed == 1
    with fleet.robot("b").loop.receiving():                                      # nothing of b's waits
        assert order[-1] == "action a HOLD"
    fleet.release()


def _joint_state(stamp_s: int):
    """A sensor_msgs/JointState-shaped message for the default policy's joints port."""
    from types import SimpleNamespace
    stamp = SimpleNamespace(sec=stamp_s, nanosec=0)
    return SimpleNamespace(header=SimpleNamespace(stamp=stamp, frame_id=""), name=[],
                           position=[0.1, 0.2], velocity=[0.0, 0.0], effort=[])


def test_timer_robots_step_together_and_a_robot_may_run_its_own_control(tmp_path):
    config = default_config(tmp_path, mode="timer")
    trigger = dataclasses.replace(config.control, mode="trigger")
    fleet = build_fleet(config, FleetConfig(robots=("a", "b", "c")), robots=[FleetRobot("c", control=trigger)])
    for name in ("a", "b", "c"):
        fleet.robot(name).loop.write_input("joints", np.zeros(4, dtype=np.float32))
        fleet.robot(name).loop.write_input("goal", np.zeros(2, dtype=np.float32))
    assert set(fleet.tick_timer()) == {"a", "b"}
    assert fleet.gather.expected == frozenset({"c"})
    fleet.release()


def test_vmap_refuses_a_step_it_cannot_batch_naming_the_operation_and_loop_serves_it():
    class Unbatchable(StatefulPolicy):
        action_dim, chunk_horizon = 2, 1

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))

        def state_spec(self):
            return [*INPUTS, *standard_specs(2, 1)]

        def init_state(self, state, *, episode, seed):
            pass

        def step(self, state):
            state["action"].index_copy_(0, state["step"] % 2, state["goal"][:1] * self.weight[:1])
            state["step"].add_(1)

        def architecture(self):
            return {"policy": "unbatchable"}

    with pytest.raises(ConfigError, match="index_copy.*fleet.batching: loop"):
        build_fleet_runtime(Unbatchable(), RuntimeConfig(), slots=2, batching="vmap")
    assert build_fleet_runtime(Unbatchable(), RuntimeConfig(), slots=2, batching="loop").slots == 2


def test_a_fleet_refuses_a_robot_twice_in_one_slot_or_more_robots_than_slots():
    with pytest.raises(ConfigError, match="fewer than the 3 robots"):
        FleetConfig(robots=("a", "b", "c"), slots=2)
    from capsule_ros.fleet.config import robots_of
    with pytest.raises(ConfigError, match="each slot serves one robot"):
        robots_of(FleetConfig(robots=("a", "b")), [FleetRobot("a", slot=1)] + [FleetRobot("b", slot=1)])


def test_a_single_session_and_a_one_slot_batched_fleet_compute_the_same_bits(tmp_path):
    """S = 1 is a single runtime's batch shape: the same actions (only the fingerprint differs)."""
    obs = np.random.default_rng(9).normal(size=(6, 6)).astype(np.float32)
    single = build_session(default_config(tmp_path / "single"))
    fleet = build_fleet(default_config(tmp_path / "fleet"), FleetConfig(robots=("a",), batching="vmap"))
    ours = [record.values for record in feed(fleet.robot("a"), obs)]
    theirs = [record.values for record in feed(single, obs)]
    assert np.stack(ours).tobytes() == np.stack(theirs).tobytes()
    fleet.release()


def test_a_robot_past_its_deadline_gets_its_safe_action_the_others_of_the_step_their_actions(tmp_path):
    config = default_config(tmp_path)
    tight = dataclasses.replace(config.control, deadline_ms=1e-6)          # no step can make it
    fleet = build_fleet(config, FleetConfig(robots=("a", "b")), robots=[FleetRobot("a", control=tight)])
    robot_run(fleet, "b", np.zeros((1, 6), dtype=np.float32), others=["a"])
    records = fleet.tick()
    assert records["a"].fault == StepFault.LATE and records["a"].source == ActionSource.HOLD
    assert records["b"].fault == StepFault.NONE and records["b"].source == ActionSource.POLICY
    assert fleet.status().robots["a"].counters.deadline_misses == 2
    fleet.release()


def test_a_fleet_suspends_and_resumes_every_robot_bit_identically(tmp_path):
    obs = np.random.default_rng(8).normal(size=(10, 6)).astype(np.float32)
    reference = build_fleet(default_config(tmp_path / "ref"), FleetConfig(robots=("a", "b")))
    expected = robot_run(reference, "a", obs, others=["b"])
    reference.release()
    fleet = build_fleet(default_config(tmp_path / "run"), FleetConfig(robots=("a", "b")))
    before = robot_run(fleet, "a", obs[:5], others=["b"])
    capsules = fleet.suspend("deactivated")
    assert set(capsules) == {"a", "b"} and all(c is not None for c in capsules.values())
    assert fleet.robot("a").episode.state == EpisodeState.INTERRUPTED
    with pytest.raises(Exception, match="deactivated"):
        fleet.robot("b").verbs.commit()
    fleet.resume()
    after = robot_run(fleet, "a", obs[5:], others=["b"])
    assert np.stack(before + after).tobytes() == np.stack(expected).tobytes()
    fleet.release()


def test_a_robots_corrupt_capsule_is_rebuilt_on_a_replica_of_the_fleets_shape(tmp_path):
    from harness import damage_state
    obs = np.random.default_rng(6).normal(size=(14, 6)).astype(np.float32)
    fleet = build_fleet(default_config(tmp_path), FleetConfig(robots=("a", "b"), slots=3))
    robot_run(fleet, "a", obs[:6], others=["b"])
    capsule = fleet.robot("a").verbs.commit("to corrupt", persist=True)
    intact = fleet.robot("a").verbs.fork(capsule.id, "intact")
    fleet.robot("a").verbs.drop(capsule.id)
    damage_state(Path(capsule.path))
    result = fleet.robot("a").verbs.reenter(capsule.id)
    assert result.fallback, result
    rebuilt = robot_run(fleet, "a", obs[6:], others=["b"], seed=1)
    fleet.robot("a").verbs.reenter(intact.id)
    expected = robot_run(fleet, "a", obs[6:], others=["b"], seed=2)
    assert np.stack(rebuilt).tobytes() == np.stack(expected).tobytes()
    fleet.release()


def test_verbs_racing_fleet_steps_apply_between_them_and_leave_the_others_actions_alone(tmp_path):
    import threading
    obs = np.random.default_rng(12).normal(size=(60, 6)).astype(np.float32)
    quiet = build_fleet(default_config(tmp_path / "quiet"), FleetConfig(robots=("a", "b")))
    expected = robot_run(quiet, "b", obs)
    quiet.release()
    fleet = build_fleet(default_config(tmp_path / "busy"), FleetConfig(robots=("a", "b")))
    stop, errors = threading.Event(), []

    def verbs() -> None:
        a = fleet.robot("a").verbs
        while not stop.is_set():
            try:
                capsule = a.commit("race")
                a.reenter(capsule.id)
                a.fork(capsule.id, "branch")
                a.drop(capsule.id)
                a.reset()
            except Exception as exc:   # noqa: BLE001 - collected: the test fails with it
                errors.append(exc)
    racer = threading.Thread(target=verbs)
    racer.start()
    try:
        got = robot_run(fleet, "b", obs, others=["a"])
    finally:
        stop.set()
        racer.join()
    assert errors == []
    assert np.stack(got).tobytes() == np.stack(expected).tobytes()
    fleet.release()


class RaisesOnBadIndex(StatefulPolicy):
    """Writes its outputs, then indexes its weights with ``joints[0]``: out of range, the
    step raises after it has written (for every slot, batched)."""

    action_dim, chunk_horizon = 2, 1

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def state_spec(self):
        return [*INPUTS, *standard_specs(2, 1)]

    def init_state(self, state, *, episode, seed):
        pass

    def step(self, state):
        state["action"].copy_(state["goal"] * 2)
        state["step"].add_(1)
        rows = state["joints"][:1].long().clamp(min=0)
        state["chunk"].copy_(torch.index_select(self.weight, 0, rows)[None, :1].expand(1, 2))

    def architecture(self):
        return {"policy": "raises on a bad index"}


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_a_fleet_step_that_raises_leaves_every_other_slot_and_the_failed_ones_state_as_before(batching):
    fleet = build_fleet_runtime(RaisesOnBadIndex(), RuntimeConfig(), slots=3, batching=batching)
    for slot in range(3):
        fleet.arena.rows[slot].copy_(torch.from_numpy(np.random.default_rng(slot).integers(0, 256, fleet.arena.stride,
                                                                                              dtype=np.uint8)))
        fleet.runtime(slot).staging["joints"][:] = [1, 0, 0, 0]
        fleet.runtime(slot).staging["goal"][:] = [0.5, 0.25]
    before = fleet.arena.storage.clone()
    fleet.runtime(0).staging["joints"][:] = [99, 0, 0, 0]                 # out of range: slot 0's step raises
    for slot in (0, 2):
        fleet.runtime(slot).load_inputs()
    outcomes = fleet.step([0, 2])
    assert isinstance(outcomes[0], Exception)
    assert torch.equal(fleet.arena.rows[1], before.view(3, -1)[1]), "a slot that did not step changed"
    fleet.runtime(0).undo_step()
    start, end = fleet.runtime(0).layout.byte_range(*STATE_KINDS, BufferKind.OUTPUT)
    assert torch.equal(fleet.arena.rows[0][start:end], before.view(3, -1)[0][start:end])
    if batching == "loop":           # the others of the step step on; batched, the one program failed for all
        assert not isinstance(outcomes[2], Exception)


@pytest.mark.parametrize("where", ["action", "chunk"])
def test_the_fleets_one_check_of_every_slots_outputs_flags_exactly_the_slots_whose_own_outputs_are_not_finite(where):
    fleet = build_fleet_runtime(make_policy(SMALL), RuntimeConfig(), slots=4, batching="vmap")
    for slot in range(4):
        fleet.runtime(slot).staging["joints"][:] = np.random.default_rng(slot).normal(size=4)
        fleet.runtime(slot).staging["goal"][:] = [0.5, 0.25]
        fleet.runtime(slot).load_inputs()
    fleet.step(range(4))
    assert fleet.outputs_finite().tolist() == [True] * 4
    for slot, value in ((1, np.nan), (3, -np.inf)):     # in each slot's own host view, as its runtime reads them
        fleet.runtime(slot).transfer.outputs[where].reshape(-1)[-1] = value
    fleet.runtime(2).transfer.outputs[where].reshape(-1)[0] = np.finfo(np.float32).max      # finite, at the limit
    assert fleet.outputs_finite().tolist() == [True, False, True, False]
    own = [bool(np.isfinite(fleet.runtime(s).transfer.outputs["action"]).all()
                and np.isfinite(fleet.runtime(s).transfer.outputs["chunk"]).all()) for s in range(4)]
    assert own == [True, False, True, False]
    fleet.close()
