#!/usr/bin/env python3
"""Train the default policy (config/policy.yaml, ``builtin:arm_reach``) by behaviour cloning.

    PYTHONPATH=. .venv/bin/python tools/train_default_policy.py

The task is the simulated two-link arm of ``capsule_ros.sim.arm``; the teacher is its
scripted expert. A few minutes on one CPU core, seeded and reproducible:

1. data: expert episodes with DART-style noise injection (the arm executes the expert's
   action plus temporally correlated noise; the label is the clean expert action at the
   visited state), so the data covers the states a slightly wrong policy drifts into.
   Some episodes stall for a few periods (a zero command, or the last one repeated: what
   the arm does on a held or late action), which puts resting states away from the goal
   in the data; most get a new goal every 35..70 steps (more approaching and settling per
   step of data, and a policy that follows a goal replaced mid-episode); all of them keep
   going after the goal is reached, so the policy learns to stay.
2. targets: at step t, the chunk of the expert labels of steps t..t+H-1 (the last label
   repeated past the end); the loss weights chunk element k by ``chunk_decay ** k``, the
   weight temporal ensembling gives it when serving.
3. training: Adam on ``HybridPolicy.forward_sequence`` over whole episodes (the parallel
   path, from the initial state like an episode served), then DAgger rounds: the trained
   policy drives the arm through the serving runtime (``PolicyRuntime``: the recurrent
   step with temporal ensembling), the expert labels the visited states, and training
   goes on over those episodes mixed with as many expert episodes.
4. evaluation, exactly as served: a ``PolicyRuntime`` on CPU over the trained weights, one
   runtime step per control period on the current observation, on 50 seeded episodes
   (seeds 1000..1049, 150 steps, success as ``ArmSim.success``); the expert is scored on
   the same episodes.
5. output: ``capsule_ros/policies/arm_reach.safetensors`` (float32 state_dict + metadata)
   and ``arm_reach.json`` (the figures of this run and the command that produced it).

Reproducible: every generator is seeded from ``--seed`` and torch runs its deterministic
algorithms, so the same command with the same ``--threads`` writes the same tensors.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from capsule_ros.policies.hybrid import HybridPolicy
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig, configure_torch
from capsule_ros.runtime.weights import save_weights
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_policy
from capsule_ros.sim.arm import ArmSim, Observation, expert_action

REPO = Path(__file__).resolve().parents[1]
CONFIG_PATH = REPO / "config" / "policy.yaml"
OUTPUT_DIR = REPO / "capsule_ros" / "policies"
POLICY_NAME = "arm_reach"
EVAL_SEEDS = tuple(range(1000, 1050))
EVAL_MAX_STEPS = 150
TRAIN_SEED_BASE = 100_000            # training episode seeds: far from the evaluation seeds
MAX_FILE_BYTES = 5 * 2**20


@dataclass
class Episodes:
    """Training sequences: observations [N, T, 6] (joints then goal) and expert labels [N, T, 2]."""

    observations: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return self.observations.shape[0]

    def subset(self, indices: np.ndarray) -> Episodes:
        return Episodes(self.observations[indices], self.labels[indices])

    def extend(self, other: Episodes) -> Episodes:
        return Episodes(np.concatenate([self.observations, other.observations]),
                        np.concatenate([self.labels, other.labels]))


def observation_vector(obs: Observation) -> np.ndarray:
    """[q1, q2, dq1, dq2, gx, gy]: the policy's inputs in the encoder's concatenation order."""
    return np.concatenate([obs.joints, obs.goal])


def correlated_noise(rng: np.random.Generator, steps: int, std: float, correlation: float) -> np.ndarray:
    """An AR(1) sequence [steps, 2] of stationary std ``std``: noise the actuator does not filter out."""
    noise = np.zeros((steps, 2))
    value = rng.normal(0.0, std, size=2)
    innovation = std * math.sqrt(1.0 - correlation ** 2)
    for t in range(steps):
        noise[t] = value
        value = correlation * value + rng.normal(0.0, innovation, size=2)
    return noise


def goal_switch_steps(rng: np.random.Generator, steps: int, probability: float) -> frozenset:
    """Steps at which an episode gets a new goal: every 35..70 steps with ``probability``, else never.

    Several reaches per episode put more of the data where the policy needs precision
    (approaching and settling) than one reach followed by a long rest, and teach it to
    follow a goal replaced mid-episode.
    """
    if rng.random() >= probability:
        return frozenset()
    switches, t = [], int(rng.integers(35, 71))
    while t < steps - 10:
        switches.append(t)
        t += int(rng.integers(35, 71))
    return frozenset(switches)


def stall_mask(rng: np.random.Generator, steps: int, probability: float) -> np.ndarray:
    """bool[steps]: short stretches (2..8 periods) where the executed command stalls.

    Stalls leave the arm at rest away from the goal: without them every resting state in
    the data is at the goal (or the start), and a sequence policy learns "at rest -> stay"
    from the velocities (the copycat problem). They also stand for held actions when serving.
    """
    mask = np.zeros(steps, bool)
    if rng.random() < probability:
        for _ in range(int(rng.integers(1, 4))):
            start = int(rng.integers(0, steps - 8))
            mask[start:start + int(rng.integers(2, 9))] = True
    return mask


def collect_expert_episodes(seeds: Sequence[int], steps: int, noise_levels: Sequence[float],
                            goal_switch_fraction: float, stall_probability: float,
                            rng: np.random.Generator) -> Episodes:
    """DART data: the expert's action plus correlated noise is executed, with stalls (a zero
    command, or the last command repeated); the clean expert action is the label."""
    observations = np.zeros((len(seeds), steps, 6), np.float32)
    labels = np.zeros((len(seeds), steps, 2), np.float32)
    for i, seed in enumerate(seeds):
        sim = ArmSim(seed)
        obs = sim.reset(int(seed))
        std = float(rng.choice(noise_levels))
        noise = correlated_noise(rng, steps, std, correlation=float(rng.uniform(0.5, 0.9)))
        switch_steps = goal_switch_steps(rng, steps, goal_switch_fraction)
        stalled = stall_mask(rng, steps, stall_probability)
        repeat_on_stall = rng.random() < 0.5
        executed = np.zeros(2)
        for t in range(steps):
            if t in switch_steps:
                obs = sim.set_goal(sim.sample_goal())
            action = expert_action(obs)
            observations[i, t], labels[i, t] = observation_vector(obs), action
            if not stalled[t]:
                executed = action + noise[t]
            elif not repeat_on_stall:
                executed = np.zeros(2)
            obs = sim.step(executed)
    return Episodes(observations, labels)


def chunk_targets(labels: torch.Tensor, horizon: int) -> torch.Tensor:
    """labels [N, T, A] -> [N, T, H, A]: at t the labels of t..t+H-1, the last one repeated past the end."""
    t = labels.shape[1]
    index = torch.clamp(torch.arange(t)[:, None] + torch.arange(horizon)[None, :], max=t - 1)
    return labels[:, index]


def set_normalisation(policy: HybridPolicy, data: Episodes) -> None:
    """encoder.obs_mean / obs_std from the data (std floored: no division by ~0)."""
    flat = data.observations.reshape(-1, data.observations.shape[-1]).astype(np.float64)
    policy.encoder.obs_mean.copy_(torch.from_numpy(flat.mean(0)).float())
    policy.encoder.obs_std.copy_(torch.from_numpy(np.maximum(flat.std(0), 1e-2)).float())


def sequence_inputs(observations: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {"joints": observations[..., :4], "goal": observations[..., 4:]}


class Trainer:
    """Adam over whole episodes through forward_sequence, with a cosine learning-rate schedule."""

    def __init__(self, policy: HybridPolicy, total_steps: int, lr: float, batch_episodes: int, seed: int):
        self.policy = policy
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
        self.base_lr, self.total_steps, self.batch_episodes = lr, max(total_steps, 1), batch_episodes
        self.steps_done = 0
        self.rng = np.random.default_rng(seed)
        cfg = policy.cfg
        weights = torch.tensor([cfg.chunk_decay ** k for k in range(cfg.chunk_horizon)])
        self.chunk_weights = (weights / weights.sum()).view(1, 1, -1, 1)

    def chunk_loss(self, observations: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean over steps of the chunk's squared error, element k weighted by chunk_decay ** k."""
        chunks = self.policy.forward_sequence(sequence_inputs(observations))
        return ((chunks - targets).square() * self.chunk_weights).sum(dim=(-1, -2)).mean()

    def loss(self, data: Episodes) -> float:
        """The loss over ``data`` without training (in batches)."""
        observations = torch.from_numpy(data.observations)
        targets = chunk_targets(torch.from_numpy(data.labels), self.policy.chunk_horizon)
        with torch.no_grad():
            losses = [float(self.chunk_loss(observations[i:i + 64], targets[i:i + 64])) * len(targets[i:i + 64])
                      for i in range(0, len(data), 64)]
        return sum(losses) / len(data)

    def epoch(self, data: Episodes) -> float:
        """One pass over the episodes in a seeded order; returns the mean weighted loss."""
        observations = torch.from_numpy(data.observations)
        targets = chunk_targets(torch.from_numpy(data.labels), self.policy.chunk_horizon)
        order = self.rng.permutation(len(data))
        losses = []
        self.policy.train()
        for start in range(0, len(order), self.batch_episodes):
            batch = torch.from_numpy(order[start:start + self.batch_episodes])
            loss = self.chunk_loss(observations[batch], targets[batch])
            progress = min(self.steps_done / self.total_steps, 1.0)
            for group in self.optimizer.param_groups:
                group["lr"] = self.base_lr * (0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress)))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.optimizer.step()
            self.steps_done += 1
            losses.append(loss.item())
        return float(np.mean(losses))


def serving_runtime(config: ServingConfig, trained: HybridPolicy) -> PolicyRuntime:
    """A CPU PolicyRuntime over a copy of the trained weights (the trained module stays trainable)."""
    policy = build_policy(config, weights="")
    policy.load_state_dict(trained.state_dict())
    return build_policy_runtime(policy, RuntimeConfig(device="cpu"))


def policy_action(runtime: PolicyRuntime, obs: Observation) -> np.ndarray:
    """One serving step on the current observation."""
    runtime.staging["joints"][:] = obs.joints
    runtime.staging["goal"][:] = obs.goal
    runtime.load_inputs()
    runtime.step()
    return runtime.read_outputs().action


def run_policy_episodes(runtime: PolicyRuntime, seeds: Sequence[int], steps: int, *, stop_at_success: bool,
                        goal_switch_fraction: float = 0.0, rng: Optional[np.random.Generator] = None) -> dict:
    """Closed-loop episodes; returns success flags (of the last goal, where goals switch), the
    visited observations and the expert's labels of them."""
    observations = np.zeros((len(seeds), steps, 6), np.float32)
    labels = np.zeros((len(seeds), steps, 2), np.float32)
    success, final_at_goal, steps_to_success = [], [], []
    for i, seed in enumerate(seeds):
        sim = ArmSim(seed)
        obs = sim.reset(int(seed))
        runtime.reset(episode=i + 1)
        switch_steps = goal_switch_steps(rng, steps, goal_switch_fraction) if rng is not None else frozenset()
        for t in range(steps):
            if t in switch_steps:
                obs = sim.set_goal(sim.sample_goal())
            observations[i, t], labels[i, t] = observation_vector(obs), expert_action(obs)
            obs = sim.step(policy_action(runtime, obs))
            if stop_at_success and sim.success:
                break
        success.append(sim.success)
        final_at_goal.append(sim.at_goal())
        steps_to_success.append(sim.steps_to_success)
    return {"success": np.array(success), "final_at_goal": np.array(final_at_goal),
            "steps_to_success": steps_to_success, "data": Episodes(observations, labels)}


def expert_success_rate(seeds: Sequence[int], max_steps: int) -> float:
    reached = []
    for seed in seeds:
        sim = ArmSim(seed)
        obs = sim.reset(int(seed))
        for _ in range(max_steps):
            obs = sim.step(expert_action(obs))
            if sim.success:
                break
        reached.append(sim.success)
    return float(np.mean(reached))


def evaluate(config: ServingConfig, policy: HybridPolicy, threads: int) -> dict:
    """Closed-loop success on the evaluation seeds, through the serving runtime."""
    runtime = serving_runtime(config, policy)
    result = run_policy_episodes(runtime, EVAL_SEEDS, EVAL_MAX_STEPS, stop_at_success=False)
    torch.set_num_threads(threads)  # the runtime sets its own thread count (runtime.cpu_threads)
    reached = [s for s in result["steps_to_success"] if s is not None]
    return {"success_rate": float(result["success"].mean()),
            "final_at_goal_rate": float(result["final_at_goal"].mean()),
            "mean_steps_to_success": float(np.mean(reached)) if reached else None,
            "failed_seeds": [s for s, ok in zip(EVAL_SEEDS, result["success"], strict=True) if not ok]}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="training seed (torch, numpy, data)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--episodes", type=int, default=1200, help="expert (DART) episodes")
    parser.add_argument("--episode-steps", type=int, default=150, help="steps per training episode")
    parser.add_argument("--epochs", type=int, default=12, help="epochs on the expert data")
    parser.add_argument("--dagger-rounds", type=int, default=3)
    parser.add_argument("--dagger-episodes", type=int, default=60, help="policy episodes per DAgger round")
    parser.add_argument("--dagger-epochs", type=int, default=6, help="epochs after each DAgger round")
    parser.add_argument("--batch-episodes", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--goal-switch-fraction", type=float, default=0.7,
                        help="share of training episodes whose goal changes every 35..70 steps")
    parser.add_argument("--stall-probability", type=float, default=0.5,
                        help="share of expert episodes with stalled stretches")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    parser.add_argument("--min-success", type=float, default=0.9, help="fail (exit 1) below this success rate")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    started, cpu_started = time.monotonic(), time.process_time()
    configure_torch(RuntimeConfig(device="cpu", cpu_threads=args.threads), torch.device("cpu"))  # deterministic
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    config = ServingConfig.from_file(CONFIG_PATH)
    policy = build_policy(config, weights="")
    policy.train()

    seeds = TRAIN_SEED_BASE + np.arange(args.episodes) + 10_000 * args.seed
    data = collect_expert_episodes(seeds, args.episode_steps, noise_levels=(0.0, 0.2, 0.4, 0.6),
                                   goal_switch_fraction=args.goal_switch_fraction,
                                   stall_probability=args.stall_probability, rng=rng)
    print(f"expert data: {len(data)} episodes x {args.episode_steps} steps ({time.monotonic() - started:.0f} s)")
    with torch.no_grad():
        set_normalisation(policy, data)

    batches = lambda n: math.ceil(n / args.batch_episodes)  # noqa: E731
    total_steps = args.epochs * batches(len(data)) + sum(
        args.dagger_epochs * batches(2 * r * args.dagger_episodes) for r in range(1, args.dagger_rounds + 1))
    trainer = Trainer(policy, total_steps, args.lr, args.batch_episodes, args.seed)
    history: List[dict] = []
    loss = float("nan")
    for epoch in range(args.epochs):
        loss = trainer.epoch(data)
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss:.5f} ({time.monotonic() - started:.0f} s)")
    history.append({"phase": "expert", "episodes": len(data), "loss": loss})

    # DAgger: the policy drives, the expert labels; each epoch trains on every DAgger
    # episode so far plus as many expert episodes drawn afresh (the expert data stays in
    # the mix so the policy does not forget the states it already handles).
    dagger_data = None
    dagger_seed_base = TRAIN_SEED_BASE + 50_000 + 10_000 * args.seed
    for round_index in range(args.dagger_rounds):
        runtime = serving_runtime(config, policy)
        round_seeds = dagger_seed_base + round_index * args.dagger_episodes + np.arange(args.dagger_episodes)
        rollout = run_policy_episodes(runtime, round_seeds, args.episode_steps, stop_at_success=False,
                                      goal_switch_fraction=args.goal_switch_fraction, rng=rng)
        torch.set_num_threads(args.threads)
        dagger_data = rollout["data"] if dagger_data is None else dagger_data.extend(rollout["data"])
        for _ in range(args.dagger_epochs):
            replay = data.subset(rng.choice(len(data), size=min(len(dagger_data), len(data)), replace=False))
            loss = trainer.epoch(dagger_data.extend(replay))
        history.append({"phase": f"dagger{round_index + 1}",
                        "rollout_reached_last_goal": float(rollout["success"].mean()),
                        "dagger_episodes": len(dagger_data), "loss": loss})
        print(f"DAgger round {round_index + 1}: policy reached the last goal of {rollout['success'].mean():.2f} "
              f"of its episodes; "
              f"{len(dagger_data)} DAgger episodes; loss {loss:.5f} ({time.monotonic() - started:.0f} s)")

    policy.eval()
    expert_data_loss = trainer.loss(data)
    result = evaluate(config, policy, args.threads)
    expert_rate = expert_success_rate(EVAL_SEEDS, EVAL_MAX_STEPS)
    wall, cpu = time.monotonic() - started, time.process_time() - cpu_started
    print(f"closed loop on {len(EVAL_SEEDS)} seeded episodes: policy {result['success_rate']:.2f} "
          f"(at goal at the end: {result['final_at_goal_rate']:.2f}), expert {expert_rate:.2f}; "
          f"loss on the expert data {expert_data_loss:.5f}; wall {wall:.0f} s, CPU {cpu:.0f} s")

    args.output_dir.mkdir(parents=True, exist_ok=True)
    weights_path = args.output_dir / f"{POLICY_NAME}.safetensors"
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    tensors = {name: t.detach().float().contiguous() for name, t in policy.state_dict().items()}
    save_weights(weights_path, tensors, {
        "name": POLICY_NAME, "seed": args.seed, "steps": trainer.steps_done,
        "success_rate": f"{result['success_rate']:.4f}", "date": date, "config": "config/policy.yaml"})
    size = weights_path.stat().st_size
    command = "PYTHONPATH=. .venv/bin/python tools/train_default_policy.py" + (
        " " + shlex.join(argv) if argv else "")
    report = {
        "name": POLICY_NAME, "date": date, "command": command, "training_seed": args.seed,
        "torch_threads": args.threads, "task": "capsule_ros.sim.arm: two-link arm reaching, dt 0.05 s",
        "data": {"expert_episodes": args.episodes, "episode_steps": args.episode_steps,
                 "dagger_rounds": args.dagger_rounds, "dagger_episodes_per_round": args.dagger_episodes,
                 "total_episodes": len(data) + (len(dagger_data) if dagger_data is not None else 0),
                 "total_steps": int((len(data) + (len(dagger_data) if dagger_data is not None else 0))
                                    * args.episode_steps)},
        "training": {"epochs": args.epochs, "dagger_epochs": args.dagger_epochs, "optimizer_steps": trainer.steps_done,
                     "batch_episodes": args.batch_episodes, "lr": args.lr, "final_loss": loss,
                     "final_loss_on_expert_data": expert_data_loss, "history": history},
        "evaluation": {"episode_seeds": [EVAL_SEEDS[0], EVAL_SEEDS[-1]], "max_steps": EVAL_MAX_STEPS,
                       "success": "end effector within 0.03 m of the goal and slower than 0.05 m/s at some step",
                       "policy_success_rate": result["success_rate"],
                       "policy_final_at_goal_rate": result["final_at_goal_rate"],
                       "policy_mean_steps_to_success": result["mean_steps_to_success"],
                       "policy_failed_seeds": result["failed_seeds"], "expert_success_rate": expert_rate},
        "weights_bytes": size, "wall_time_s": round(wall, 1), "cpu_time_s": round(cpu, 1),
    }
    (args.output_dir / f"{POLICY_NAME}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {weights_path} ({size} bytes) and {POLICY_NAME}.json")
    if size > MAX_FILE_BYTES:
        print(f"error: {weights_path} is over {MAX_FILE_BYTES} bytes", file=sys.stderr)
        return 1
    if result["success_rate"] < args.min_success:
        print(f"error: success rate {result['success_rate']:.2f} is below {args.min_success}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
