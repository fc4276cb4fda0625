"""The simulated arm (capsule_ros.sim.arm), its scripted expert, and the shipped default policy.

Fast (a few seconds): the sim is deterministic for a seed, its limits hold, the expert
solves the task, and the shipped ``builtin:arm_reach`` weights load into the policy of
config/policy.yaml and solve it closed loop through the serving runtime.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from capsule_ros.sim import arm
from capsule_ros.sim.arm import ArmSim, expert_action

REPO = Path(__file__).resolve().parents[1]
POLICIES = REPO / "capsule_ros" / "policies"


def trajectory(seed: int, steps: int, process_noise: float = 0.0) -> np.ndarray:
    """Observations [steps + 1, 6] of the expert plus a seeded perturbation, from reset(seed)."""
    sim = ArmSim(seed=7, process_noise=process_noise)
    obs = sim.reset(seed)
    perturbation = np.random.default_rng(seed).normal(0.0, 0.5, size=(steps, 2))
    rows = [np.concatenate([obs.joints, obs.goal])]
    for t in range(steps):
        obs = sim.step(expert_action(obs) + perturbation[t])
        rows.append(np.concatenate([obs.joints, obs.goal]))
    return np.stack(rows)


@pytest.mark.parametrize("process_noise", [0.0, 0.05])
def test_same_seed_same_trajectory_bit_for_bit(process_noise):
    first, second = trajectory(3, 120, process_noise), trajectory(3, 120, process_noise)
    assert first.dtype == np.float32
    assert first.tobytes() == second.tobytes()
    assert trajectory(4, 120, process_noise).tobytes() != first.tobytes()


def test_reset_without_a_seed_is_reproducible_per_sim_seed():
    a, b, c = ArmSim(seed=11), ArmSim(seed=11), ArmSim(seed=12)
    episodes_a = [a.reset().goal.tobytes() for _ in range(3)]
    assert episodes_a == [b.reset().goal.tobytes() for _ in range(3)]
    assert len(set(episodes_a)) == 3
    assert c.reset().goal.tobytes() != episodes_a[0]


def test_episodes_start_at_rest_with_reachable_goals():
    sim = ArmSim()
    for seed in range(200):
        obs = sim.reset(seed)
        assert obs.joints.shape == (4,) and obs.goal.shape == (2,)
        assert obs.joints.dtype == np.float32 and obs.goal.dtype == np.float32
        assert np.all(obs.joints[2:] == 0.0)
        assert np.all(sim.q >= arm.Q_LOW) and np.all(sim.q <= arm.Q_HIGH)
        assert arm.GOAL_RADIUS[0] <= np.linalg.norm(sim.goal) <= arm.GOAL_RADIUS[1]
        assert sim.distance_to_goal() >= arm.MIN_START_DISTANCE and not sim.success
        for solution in arm.inverse_kinematics(sim.goal):
            assert np.allclose(arm.end_effector(solution), sim.goal, atol=1e-9)
            assert np.all(solution >= arm.Q_LOW) and np.all(solution <= arm.Q_HIGH)


def test_commands_are_clipped_and_joint_limits_hold():
    sim = ArmSim()
    sim.reset(5)
    start = sim.q.copy()
    sim.step(np.array([100.0, -100.0]))
    clipped = ArmSim()
    clipped.reset(5)
    clipped.step(np.array([arm.U_MAX, -arm.U_MAX]))
    assert np.array_equal(sim.q, clipped.q) and np.array_equal(sim.dq, clipped.dq)
    # first-order actuator from rest: dq = u * dt / tau, then q += dq * dt
    expected_dq = np.array([arm.U_MAX, -arm.U_MAX]) * arm.DT / arm.TAU
    assert np.allclose(sim.dq, expected_dq) and np.allclose(sim.q, start + expected_dq * arm.DT)
    for command in ([50.0, 50.0], [-50.0, -50.0]):
        for _ in range(200):
            sim.step(np.array(command))
            assert np.all(sim.q >= arm.Q_LOW) and np.all(sim.q <= arm.Q_HIGH)
            assert np.all(np.abs(sim.dq) <= arm.U_MAX + 1e-12)
        limit = arm.Q_HIGH if command[0] > 0 else arm.Q_LOW
        assert np.array_equal(sim.q, limit) and np.all(sim.dq == 0.0)  # at the limit: no velocity
    sim.step(np.array([math.nan, 1.0]))
    assert np.all(np.isfinite(sim.q)) and np.all(np.isfinite(sim.dq))


def test_hold_brings_the_arm_to_rest():
    sim = ArmSim()
    sim.reset(9)
    for _ in range(5):
        sim.step(np.array([1.5, -1.5]))
    for _ in range(40):
        sim.hold()
    assert np.all(np.abs(sim.dq) < 1e-6)


def test_expert_reaches_the_goal_in_most_seeded_episodes():
    reached = 0
    for seed in range(1000, 1050):
        sim = ArmSim()
        obs = sim.reset(seed)
        for _ in range(120):
            obs = sim.step(expert_action(obs))
            if sim.success:
                break
        reached += sim.success
    assert reached >= 45, f"the expert reached {reached} of 50 goals"
    assert np.all(np.abs(expert_action(obs)) <= arm.U_MAX)


def test_success_needs_the_goal_and_a_slow_end_effector():
    sim = ArmSim()
    sim.reset(2)
    target = arm.inverse_kinematics(sim.goal)[0]
    sim.q, sim.dq = target.copy(), np.zeros(2)
    assert sim.at_goal()
    sim.dq = np.array([1.0, 0.0])  # at the goal, but sweeping through it
    assert not sim.at_goal()


def test_shipped_policy_reaches_goals_in_process():
    """builtin:arm_reach loads into the configured policy and solves 20 seeded episodes
    closed loop, stepped exactly like serving (PolicyRuntime on CPU, current observation)."""
    import torch

    from capsule_ros.runtime.builder import build_policy_runtime
    from capsule_ros.runtime.engine import RuntimeConfig
    from capsule_ros.runtime.weights import read_weights
    from capsule_ros.serving.config import ServingConfig
    from capsule_ros.serving.factory import build_policy, resolve_weights

    config = ServingConfig.from_file(REPO / "config" / "policy.yaml")
    assert config.policy.weights == "builtin:arm_reach"
    path = resolve_weights(config.policy.weights)
    assert path == POLICIES / "arm_reach.safetensors" and path.stat().st_size < 5 * 2**20
    tensors, metadata = read_weights(path)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert {"seed", "steps", "success_rate", "date"} <= set(metadata)
    report = json.loads((POLICIES / "arm_reach.json").read_text())
    assert report["evaluation"]["policy_success_rate"] >= 0.9

    threads = torch.get_num_threads()
    runtime = build_policy_runtime(build_policy(config), RuntimeConfig(device="cpu"))
    reached = 0
    try:
        for episode, seed in enumerate(range(1000, 1020), start=1):
            sim = ArmSim()
            obs = sim.reset(seed)
            runtime.reset(episode=episode)
            for _ in range(150):
                runtime.staging["joints"][:] = obs.joints
                runtime.staging["goal"][:] = obs.goal
                runtime.load_inputs()
                runtime.step()
                obs = sim.step(runtime.read_outputs().action)
                if sim.success:
                    break
            reached += sim.success
    finally:
        torch.set_num_threads(threads)
    assert reached >= 18, f"the shipped policy reached {reached} of 20 goals"
