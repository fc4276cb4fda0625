"""A planar two-link arm reaching goals: the built-in task of the default policy.

numpy only (no ROS, no torch), so the simulator node, the training script and the tests
share one model of the task.

Model (one control period ``DT`` per ``step``):

- state q = (q1, q2) [rad], dq [rad/s]; control u = joint-velocity command [rad/s],
  clipped to ``[-U_MAX, U_MAX]``;
- first-order actuator: ``dq += (u - dq) * DT / TAU``, then ``q += dq * DT``;
- joint limits: q clipped to ``Q_LOW..Q_HIGH``; a joint at a limit loses its velocity;
- optional process noise on dq (std ``process_noise`` rad/s per step) drawn from the
  episode's own generator, so a noisy episode is still reproducible (default off).

Episodes: ``reset(episode_seed)`` draws a start configuration (at rest) and a goal at
distance ``GOAL_RADIUS`` from the base, any angle, with ``np.random.default_rng(episode_seed)``:
the same seed gives the same episode, bit for bit. ``set_goal`` replaces the goal
mid-episode; ``hold()`` is the safe state (a zero velocity command for one period).

Success: the end effector is within ``GOAL_TOLERANCE`` (0.03 m) of the goal AND moves slower
than ``SPEED_TOLERANCE`` (0.05 m/s): passing through the goal at speed does not count.
``at_goal()`` is that test now; ``success`` latches once it has held at any step of the
episode (an episode's outcome); ``steps_to_success`` says when.

The scripted expert (``expert_action``) is a pure function of the observation: analytic
inverse kinematics (the elbow solution closest to the current configuration, steering
clear of targets at the q1 limit: see ``target_cost``) and a joint-space PD law on the
velocity command. Being Markov in the observation, it labels any visited state the same
way, which is what behaviour cloning with noise injection and DAgger need. It reaches
every one of 5000 seeded goals within 120 steps (30 on average, 63 at most over 300).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

LINK_LENGTHS = (0.5, 0.4)            # m
DT = 0.05                            # s: one control period (20 Hz)
TAU = 0.1                            # s: actuator time constant
U_MAX = 2.0                          # rad/s: velocity command bound
Q_LOW = np.array([-math.pi, -2.8])   # rad
Q_HIGH = np.array([math.pi, 2.8])    # rad
START_Q2_RANGE = (-2.5, 2.5)         # rad: start elbow angles (inside the limits)
GOAL_RADIUS = (0.25, 0.8)            # m: goal distance from the base
MIN_START_DISTANCE = 0.1             # m: a fresh episode never starts at its goal
GOAL_TOLERANCE = 0.03                # m
SPEED_TOLERANCE = 0.05               # m/s

# Expert gains: a high gain makes a small bias in an imitating policy's command cost little
# accuracy (the steady-state offset is bias / gain; 0.2 rad/s of bias stays within the
# tolerance), and the damping keeps the loop stable with up to two periods of delay.
EXPERT_GAIN = 8.0                    # 1/s: joint-space proportional gain
EXPERT_DAMPING = 0.5                 # velocity damping of the expert's command
LIMIT_MARGIN = (0.42, 0.25)          # rad from q1 = +-pi: IK targets closer than the first are avoided
LIMIT_PENALTY = 15.0                 # rad: ... by a cost ramping up to this (more than any L1 distance
                                     # between the two solutions) at the second, and beyond


@dataclass(frozen=True)
class Observation:
    """What the policy sees: ``joints`` float32[4] = [q1, q2, dq1, dq2], ``goal`` float32[2] = [x, y]."""

    joints: np.ndarray
    goal: np.ndarray


def end_effector(q: np.ndarray) -> np.ndarray:
    """Forward kinematics: joint angles [2] -> end-effector position [x, y] (float64)."""
    l1, l2 = LINK_LENGTHS
    q1, q12 = float(q[0]), float(q[0]) + float(q[1])
    return np.array([l1 * math.cos(q1) + l2 * math.cos(q12), l1 * math.sin(q1) + l2 * math.sin(q12)])


def jacobian(q: np.ndarray) -> np.ndarray:
    """d end_effector / d q, [2, 2]."""
    l1, l2 = LINK_LENGTHS
    q1, q12 = float(q[0]), float(q[0]) + float(q[1])
    return np.array([[-l1 * math.sin(q1) - l2 * math.sin(q12), -l2 * math.sin(q12)],
                     [l1 * math.cos(q1) + l2 * math.cos(q12), l2 * math.cos(q12)]])


def inverse_kinematics(goal: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The two joint solutions (elbow q2 >= 0, elbow q2 <= 0) reaching ``goal``, within the limits.

    An unreachable goal gets the closest reachable point in its direction.
    """
    l1, l2 = LINK_LENGTHS
    x, y = float(goal[0]), float(goal[1])
    cos_q2 = (x * x + y * y - l1 * l1 - l2 * l2) / (2.0 * l1 * l2)
    q2 = math.acos(min(max(cos_q2, math.cos(Q_HIGH[1])), 1.0))
    solutions = []
    for elbow in (q2, -q2):
        q1 = math.atan2(y, x) - math.atan2(l2 * math.sin(elbow), l1 + l2 * math.cos(elbow))
        q1 = math.remainder(q1, 2.0 * math.pi)  # into [-pi, pi]: q1 cannot wrap past its limits
        solutions.append(np.array([q1, elbow]))
    return solutions[0], solutions[1]


def target_cost(target: np.ndarray, q: np.ndarray) -> float:
    """How far the arm at ``q`` is from the IK solution ``target``: joint-space L1 distance
    (no wrap: q1 cannot pass +-pi), plus a penalty ramping up as target q1 nears +-pi.

    A target at the q1 limit is a cliff for an imitating policy: nudge the goal across the
    limit and its q1 jumps by 2 pi, flipping the command for every configuration. A policy
    blurs that jump into a standstill, and the goal (unlike q) never moves out of the blur.
    The penalty makes the other elbow win there (the two solutions' q1 differ by at least
    0.84 rad for goals in GOAL_RADIUS, so at most one is within 0.42 rad of the limit),
    which leaves only ties between distances: those depend on q, and the motion itself
    settles them. The margin is wide because a learned policy's idea of where the target
    q1 wraps is blurred over a few tenths of a radian.
    """
    start, full = LIMIT_MARGIN
    near_limit = (abs(float(target[0])) - (math.pi - start)) / (start - full)
    return float(np.abs(target - q).sum()) + LIMIT_PENALTY * min(max(near_limit, 0.0), 1.0)


def expert_action(obs: Observation, gain: float = EXPERT_GAIN, damping: float = EXPERT_DAMPING) -> np.ndarray:
    """The scripted expert's velocity command float32[2] for ``obs``.

    IK target q* = the elbow solution of least ``target_cost`` from the current q (the
    closest, away from the q1 limit), then ``u = clip(gain * (q* - q) - damping * dq, -U_MAX, U_MAX)``.
    The damping term cancels part of the actuator lag, so large moves do not overshoot.
    """
    q = obs.joints[:2].astype(np.float64)
    dq = obs.joints[2:].astype(np.float64)
    target = min(inverse_kinematics(obs.goal), key=lambda s: target_cost(s, q))
    return np.clip(gain * (target - q) - damping * dq, -U_MAX, U_MAX).astype(np.float32)


class ArmSim:
    """The arm, one episode at a time (see the module docstring).

    ``ArmSim(seed)``: ``reset()`` without an episode seed draws episode i's seed from
    (seed, i), so a sequence of resets is reproducible too. ``process_noise`` is the std of
    the velocity disturbance per step (rad/s), drawn from the episode's generator.
    """

    def __init__(self, seed: int = 0, process_noise: float = 0.0):
        self.seed = int(seed)
        self.process_noise = float(process_noise)
        self.episodes_started = 0
        self.episode_seed = 0
        self.rng = np.random.default_rng(0)
        self.q = np.zeros(2)
        self.dq = np.zeros(2)
        self.goal = np.array([GOAL_RADIUS[0], 0.0])
        self.steps = 0
        self.steps_to_success: Optional[int] = None

    # -- episodes ---------------------------------------------------------------------------
    def reset(self, episode_seed: Optional[int] = None) -> Observation:
        """Start an episode: a start configuration at rest and a reachable goal, from the seed."""
        if episode_seed is None:
            episode_seed = int(np.random.SeedSequence([self.seed, self.episodes_started]).generate_state(1)[0])
        self.episodes_started += 1
        self.episode_seed = int(episode_seed)
        self.rng = np.random.default_rng(self.episode_seed)
        self.q = np.array([self.rng.uniform(Q_LOW[0], Q_HIGH[0]), self.rng.uniform(*START_Q2_RANGE)])
        self.dq = np.zeros(2)
        start = end_effector(self.q)
        while True:  # rejection sampling from the episode's generator: still deterministic
            self.goal = self.sample_goal()
            if np.linalg.norm(self.goal - start) >= MIN_START_DISTANCE:
                break
        self.steps = 0
        self.steps_to_success = 0 if self.at_goal() else None
        return self.observation()

    def set_goal(self, goal: np.ndarray) -> Observation:
        """Replace the goal mid-episode (a new task for the same arm); success starts over."""
        self.goal = np.asarray(goal, dtype=np.float64).reshape(2).copy()
        self.steps_to_success = self.steps if self.at_goal() else None
        return self.observation()

    def sample_goal(self) -> np.ndarray:
        """A reachable goal (GOAL_RADIUS, any angle) from the episode's generator."""
        radius, angle = self.rng.uniform(*GOAL_RADIUS), self.rng.uniform(-math.pi, math.pi)
        return np.array([radius * math.cos(angle), radius * math.sin(angle)])

    def step(self, u: np.ndarray) -> Observation:
        """Apply the velocity command ``u`` (clipped) for one control period."""
        u = np.clip(np.asarray(u, dtype=np.float64).reshape(2), -U_MAX, U_MAX)
        if not np.all(np.isfinite(u)):
            u = np.zeros(2)  # a broken command is a stop, never a NaN state
        self.dq = self.dq + (u - self.dq) * (DT / TAU)
        if self.process_noise > 0.0:
            self.dq = self.dq + self.rng.normal(0.0, self.process_noise, size=2)
        q = self.q + self.dq * DT
        at_limit = (q <= Q_LOW) | (q >= Q_HIGH)
        self.q = np.clip(q, Q_LOW, Q_HIGH)
        self.dq = np.where(at_limit, 0.0, self.dq)
        self.steps += 1
        if self.steps_to_success is None and self.at_goal():
            self.steps_to_success = self.steps
        return self.observation()

    def hold(self) -> Observation:
        """The safe state when actions stop: a zero velocity command for one period."""
        return self.step(np.zeros(2))

    # -- reading ----------------------------------------------------------------------------
    def observation(self) -> Observation:
        return Observation(joints=np.concatenate([self.q, self.dq]).astype(np.float32),
                           goal=self.goal.astype(np.float32))

    def end_effector(self, q: Optional[np.ndarray] = None) -> np.ndarray:
        """End-effector position [x, y] of ``q`` (default: the current configuration)."""
        return end_effector(self.q if q is None else q)

    def end_effector_speed(self) -> float:
        return float(np.linalg.norm(jacobian(self.q) @ self.dq))

    def distance_to_goal(self) -> float:
        return float(np.linalg.norm(end_effector(self.q) - self.goal))

    def at_goal(self) -> bool:
        """Within GOAL_TOLERANCE of the goal and slower than SPEED_TOLERANCE, now."""
        return self.distance_to_goal() < GOAL_TOLERANCE and self.end_effector_speed() < SPEED_TOLERANCE

    @property
    def success(self) -> bool:
        """The episode has reached its goal (at_goal held at some step so far)."""
        return self.steps_to_success is not None

    def expert_action(self, obs: Optional[Observation] = None) -> np.ndarray:
        """The scripted expert's command for ``obs`` (default: the current observation)."""
        return expert_action(self.observation() if obs is None else obs)
