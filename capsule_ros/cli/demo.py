"""`capsule-ros demo`: the main job, on the built-in simulated arm and the default policy.

Starts ``policy_node`` (its own process, the default config in trigger mode) and drives
the simulated arm (in this process, in lockstep with the policy through real ROS 2
topics), then runs a scripted capsule plan through the node's services:

1. episode 1 starts: commit its start capsule (saved to disk);
2. interrupt mid-reach (boundary capsule, saved), hold, re-enter, finish the reach;
3. roll back to the start capsule (and the arm to its start state) and run the same
   segment again: every action must be bit-identical to the original ones;
4. fork the start capsule and run the branch towards another goal;
5. episodes 2..N: plain seeded reaches, for the success rate.

The node records the run into a rosbag2 (``~/record``). Writes ``runs/<stamp>/``: the
bag, the saved capsules, ``report.png`` and ``summary.json`` (each complete or absent);
exits 1 if a check of the run failed. ``--out`` and ``--weights`` are checked before
anything starts; an unusable one, or a policy_node that cannot start, ends in one line on
stderr and exit 2, with nothing of the run left (docs/command-line.md).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import queue
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from capsule_ros.cli.command import COMMANDS
from capsule_ros.cli.paths import input_file, run_dir
from capsule_ros.errors import CapsuleRosError, InvalidArgument, path_error
from capsule_ros.files import write_file
from capsule_ros.ros.spinning import drain
from capsule_ros.sim.arm import ArmSim, Observation

EPISODE_SEED0 = 1000       # episode i uses seed EPISODE_SEED0 + i (the training script's evaluation seeds)
INTERRUPT_AT = 15          # steps into episode 1
HOLD_TICKS = 5


@dataclass
class Segment:
    """Actions and end-effector path of a run of steps."""

    name: str
    actions: List[bytes] = field(default_factory=list)     # raw float32 values, for bit comparison
    sources: List[int] = field(default_factory=list)       # Action.SOURCE_*: a safe action marks a missed deadline
    path: List[List[float]] = field(default_factory=list)
    steps: List[int] = field(default_factory=list)
    round_trips_ms: List[float] = field(default_factory=list)


class ArmDriver:
    """The simulated arm in lockstep with policy_node over ROS 2 topics."""

    def __init__(self, node, namespace: str):
        from geometry_msgs.msg import PointStamped
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import JointState

        from capsule_ros.msg import Action
        from capsule_ros.ros.sim_node import goal_message, joint_state_message
        self._goal_message, self._joint_message = goal_message, joint_state_message
        self.node = node
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.joints = node.create_publisher(JointState, f"{namespace}/arm/joint_states", reliable)
        self.goals = node.create_publisher(PointStamped, f"{namespace}/arm/goal", reliable)
        self.actions: queue.Queue = queue.Queue()
        node.create_subscription(Action, f"{namespace}/capsule_policy/action", self.actions.put, reliable)
        from capsule_ros.msg import RuntimeStatus
        self._goal_taken = threading.Condition()
        self._goals_received = 0          # the node's count of accepted goal messages (~/status)
        self._goals_sent = 0
        node.create_subscription(RuntimeStatus, f"{namespace}/capsule_policy/status", self._on_status, 10)
        self.sim = ArmSim(seed=0)
        self.obs: Observation = self.sim.observation()
        self._stamp = 0
        self._sent_goal: Optional[bytes] = None

    def _on_status(self, status) -> None:
        with self._goal_taken:
            self._goals_received = max((p.received for p in status.ports if p.name == "goal"), default=0)
            self._goal_taken.notify_all()

    def publish(self) -> float:
        """The goal (when it changed: the node must report it accepted before going on),
        then the joint state that triggers the step, so every step sees its own goal."""
        from builtin_interfaces.msg import Time
        self._stamp += 1                       # strictly increasing: the node drops older stamps
        stamp = Time(sec=self._stamp // 1000, nanosec=(self._stamp % 1000) * 1_000_000)
        goal = self.obs.goal.tobytes()
        if goal != self._sent_goal:
            self.goals.publish(self._goal_message(self.obs, stamp, "arm_base"))
            self._goals_sent += 1
            with self._goal_taken:
                if not self._goal_taken.wait_for(lambda: self._goals_received >= self._goals_sent, timeout=10):
                    raise RuntimeError("policy_node did not take the new goal within 10 s")
            self._sent_goal = goal
        msg = self._joint_message(self.obs, stamp, "arm_base")
        sent = time.perf_counter()
        self.joints.publish(msg)
        return sent

    def step(self, segment: Optional[Segment] = None, timeout: float = 10.0):
        """Publish the arm's state, wait for the action it triggers, apply it."""
        while not self.actions.empty():
            self.actions.get_nowait()
        sent = self.publish()
        action = self.actions.get(timeout=timeout)
        elapsed = (time.perf_counter() - sent) * 1e3
        self.obs = self.sim.step(np.asarray(action.values, dtype=np.float64))
        if segment is not None:
            segment.actions.append(np.asarray(action.values, np.float32).tobytes())
            segment.sources.append(int(action.source))
            segment.path.append(self.sim.end_effector().tolist())
            segment.steps.append(int(action.step))
            segment.round_trips_ms.append(elapsed)
        return action

    def snapshot(self) -> dict:
        s = self.sim
        return {"q": s.q.copy(), "dq": s.dq.copy(), "goal": s.goal.copy(), "steps": s.steps,
                "steps_to_success": s.steps_to_success}

    def restore(self, saved: dict) -> None:
        s = self.sim
        s.q, s.dq, s.goal = saved["q"].copy(), saved["dq"].copy(), saved["goal"].copy()
        s.steps, s.steps_to_success = saved["steps"], saved["steps_to_success"]
        self.obs = s.observation()

    def reach(self, segment: Segment, max_steps: int) -> bool:
        """Step until the arm is at the goal (and stays for 3 steps) or max_steps."""
        for _ in range(max_steps):
            self.step(segment)
            reached = self.sim.steps_to_success
            if self.sim.success and reached is not None and self.sim.steps - reached >= 3:
                return True
        return self.sim.success


class NodeDidNotStart(CapsuleRosError):
    """policy_node exited during start-up (its one-line reason), or was not ready in time."""


def wait_ready(client, driver: ArmDriver, node_proc, timeout: float = 60.0) -> None:
    """Until the node's services answer and it subscribes to the arm's topics;
    NodeDidNotStart with the node's own one-line reason if it exits first."""
    from capsule_ros.polling import wait_until

    def still_running() -> None:
        if node_proc.proc.poll() is not None:
            lines = [line for line in node_proc.log().splitlines() if line.strip()]
            raise NodeDidNotStart(f"policy_node could not start: {lines[-1] if lines else 'no output'} "
                                  f"(exit {node_proc.proc.returncode})")
    try:
        wait_until(lambda: (client.ready() and driver.joints.get_subscription_count() > 0
                            and driver.goals.get_subscription_count() > 0), timeout, "policy_node to be ready",
                   interval=0.1, check=still_running)
    except TimeoutError as exc:
        raise NodeDidNotStart(f"{exc} (its log: {node_proc.log_path})") from None


class Progress:
    """rich live progress, or plain lines with --headless."""

    def __init__(self, episodes: int, headless: bool):
        self.headless = headless
        if not headless:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            self._progress = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
            self._task = self._progress.add_task("episodes", total=episodes)

    def __enter__(self):
        if not self.headless:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.headless:
            self._progress.__exit__(*exc)

    def note(self, text: str) -> None:
        if self.headless:
            print(text, flush=True)
        else:
            self._progress.console.print(text)

    def advance(self, description: str) -> None:
        if not self.headless:
            self._progress.update(self._task, advance=1, description=description)


def run(args) -> int:
    import rclpy

    from capsule_ros.msg import CapsuleEvent, RuntimeStatus
    from capsule_ros.paths import share_file
    from capsule_ros.ros.client import CapsuleClient
    from capsule_ros.ros.processes import start_policy_node
    from capsule_ros.ros.spinning import SpunNode
    from capsule_ros.srv import Interrupt

    started = time.monotonic()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    weights = {"": None, "random": ""}.get(args.weights)
    if weights is None and args.weights:
        weights = str(input_file(args.weights, "--weights").resolve())
    out, made = run_dir(args.out or f"runs/{stamp}", "--out")
    out = out.resolve()
    ns = "/demo"
    params = {"runtime": {"device": args.device}, **({"policy": {"weights": weights}} if weights is not None else {}),
              "capsules": {"directory": str(out / "capsules")},
              "ports": {"joints": {"qos": "reliable", "depth": 10}},
              "control": {"status_rate_hz": 50.0}}       # fast status: the arm waits for each new goal
    try:             # writes its parameter file and log into the run directory: a full disk shows here
        node_proc = start_policy_node(out, params, namespace=ns, params_file=share_file("config", "policy.yaml"))
    except BaseException as exc:
        _discard(made)
        if isinstance(exc, OSError):
            raise path_error(exc, "--out", out) from None
        raise
    rclpy.init()
    spun = SpunNode(rclpy, "capsule_demo")
    events: queue.Queue = queue.Queue()
    statuses: queue.Queue = queue.Queue()
    spun.node.create_subscription(CapsuleEvent, f"{ns}/capsule_policy/capsule_events", events.put, 100)
    spun.node.create_subscription(RuntimeStatus, f"{ns}/capsule_policy/status", statuses.put, 10)
    client = CapsuleClient(spun.node, f"{ns}/capsule_policy", server_wait_s=60.0, call_timeout_s=10.0)
    driver = ArmDriver(spun.node, ns)
    summary: Dict[str, Any] = {"out": str(out), "device": args.device}
    segments: Dict[str, Segment] = {}
    plan: Dict[str, object] = {}
    outcomes: List[bool] = []
    failures: List[str] = []
    node_code: Optional[int] = None
    refused: Optional[NodeDidNotStart] = None
    try:
        with Progress(args.episodes, args.headless) as progress:
            wait_ready(client, driver, node_proc)
            bag = client.record(start=True, path=str(out / "bag")).bag_path
            progress.note(f"policy_node ready; recording to {bag}")
            for episode in range(args.episodes):
                driver.obs = driver.sim.reset(EPISODE_SEED0 + episode)
                client.reset()
                if episode == 0:
                    outcomes.append(scripted_plan(client, driver, segments, plan, args.max_steps, progress,
                                                  Interrupt))
                else:
                    seg = segments.setdefault("episodes", Segment("episodes"))
                    outcomes.append(driver.reach(seg, args.max_steps))
                progress.advance(f"episode {episode + 1}: {'reached' if outcomes[-1] else 'missed'}")
            recorded = client.record(start=False)
            summary["bag"], summary["bag_messages"] = recorded.bag_path, recorded.messages
            status = _latest(statuses, timeout=3.0)
    except NodeDidNotStart as exc:
        refused = exc
    except Exception as exc:  # noqa: BLE001 - reported in summary.json and the exit code
        failures.append(f"{type(exc).__name__}: {exc}")
        status = None
    finally:
        spun.close()
        rclpy.try_shutdown()
        node_code = node_proc.stop()
    if refused is not None:                 # nothing was run: nothing of the run is kept
        _discard(made)
        raise refused
    if node_code != 0:
        failures.append(f"policy_node exited with {node_code} (log: {node_proc.log_path})")
    identical, compared, note = rollback_check(segments.get("original"), segments.get("rolled_back"))
    if not identical and not failures:
        failures.append(f"the rolled-back segment's actions differ from the original ones ({note})")
    bag_verdict = verify_bag(summary.get("bag"), out / "capsules") if not failures else None
    if bag_verdict is not None and bag_verdict["exit_code"] != 0:
        failures.append(f"replaying the run's bag did not verify (exit {bag_verdict['exit_code']}): "
                        f"{bag_verdict['first_divergence'] or 'actions skipped'}")
    round_trips = [ms for seg in segments.values() for ms in seg.round_trips_ms]
    summary.update({
        "episodes": len(outcomes), "success_rate": float(np.mean(outcomes)) if outcomes else 0.0,
        "steps": sum(len(seg.actions) for seg in segments.values()),
        "step_p50_ms": status.step_p50_ms if status else None, "step_p99_ms": status.step_p99_ms if status else None,
        "round_trip_p50_ms": float(np.percentile(round_trips, 50)) if round_trips else None,
        "round_trip_p99_ms": float(np.percentile(round_trips, 99)) if round_trips else None,
        "restore_p50_us": status.restore_p50_ms * 1e3 if status else None,
        "restore_p99_us": status.restore_p99_ms * 1e3 if status else None,
        "identical_after_rollback": identical,
        "compared_steps": compared, "rollback_check": note, "bag_verdict": bag_verdict,
        "capsule_events": [_event_dict(e) for e in drain(events)],
        "capsule_files": sorted(p.name for p in (out / "capsules").glob("*.capsule")),
        "wall_s": time.monotonic() - started, "failures": failures,
    })
    if segments:
        from capsule_ros.cli.report import write_report
        write_report(out / "report.png", segments, plan, summary, round_trips)
    write_file(out / "summary.json", json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("episodes", "success_rate", "steps", "step_p50_ms", "step_p99_ms",
                                              "restore_p50_us", "restore_p99_us", "identical_after_rollback",
                                              "rollback_check", "bag_verdict", "wall_s")}, indent=2))
    print(f"wrote {out}/summary.json, report.png, the bag and {len(summary['capsule_files'])} capsule file(s)")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def scripted_plan(client, driver: ArmDriver, segments: Dict[str, Segment], plan: dict, max_steps: int, progress,
                  Interrupt) -> bool:
    """Episode 1: commit, interrupt, re-enter, roll back and replay, fork. Returns whether
    the episode's own reach (before the rollback) succeeded."""
    start_capsule = client.commit(label="episode start", persist=True).capsule
    arm_start = driver.snapshot()
    original = segments.setdefault("original", Segment("original"))
    for _ in range(INTERRUPT_AT):
        driver.step(original)
    boundary = client.interrupt(hold_mode=Interrupt.Request.HOLD_ZERO, commit=True).capsule
    client.save(boundary.id)
    progress.note(f"interrupted at step {boundary.step} (capsule {boundary.id}, saved); holding")
    for _ in range(HOLD_TICKS):
        driver.step(original)                 # safe actions (zeros): the arm comes to rest
    client.reenter()
    reached = driver.reach(original, max_steps)
    progress.note(f"re-entered {boundary.id}; reach {'succeeded' if reached else 'missed'} "
                  f"after {driver.sim.steps} steps")
    rollback = client.reenter(start_capsule.id)
    driver.restore(arm_start)
    progress.note(f"rolled back to {start_capsule.id} (step {rollback.capsule.step}, restore "
                  f"{rollback.restore_ms * 1e3:.0f} us); replaying the segment")
    rolled = segments.setdefault("rolled_back", Segment("rolled_back"))
    driver.reach(rolled, max_steps)
    fork = client.fork(start_capsule.id, label="branch: mirrored goal").capsule
    client.reenter(fork.id)
    driver.restore(arm_start)
    driver.obs = driver.sim.set_goal(-arm_start["goal"])
    branch = segments.setdefault("branch", Segment("branch"))
    driver.reach(branch, max_steps)
    progress.note(f"forked {fork.id}: branch towards {np.round(-arm_start['goal'], 2).tolist()} "
                  f"{'reached' if driver.sim.success else 'missed'}")
    plan["goal"], plan["branch_goal"] = arm_start["goal"].tolist(), (-arm_start["goal"]).tolist()
    plan["interrupt_at"], plan["hold_ticks"] = INTERRUPT_AT, HOLD_TICKS
    return reached


def rollback_check(original: Optional[Segment], rolled: Optional[Segment]):
    """(identical, compared steps, note): the rolled-back segment against the original,
    step for step, up to the interrupt. A safe action in either (a missed deadline: the
    arm then moved on a held action, so the inputs that follow differ) ends the comparison
    there; that is reported as such, not as a divergence (the bag's replay checks those
    steps exactly)."""
    if original is None or rolled is None:
        return False, 0, "the scripted plan did not get to the rollback"
    n = min(len(original.actions), len(rolled.actions), INTERRUPT_AT)
    late = next((i for i in range(n) if original.sources[i] != 0 or rolled.sources[i] != 0), None)
    compared = n if late is None else late
    identical = original.actions[:compared] == rolled.actions[:compared] and (compared == INTERRUPT_AT or
                                                                             late is not None)
    if late is not None:
        which = "original" if original.sources[late] != 0 else "rolled-back"
        note = (f"compared {compared} steps: step {late + 1} of the {which} run missed its deadline (a safe "
                "action was published and the arm moved on it), so the steps after it had other inputs")
    else:
        note = f"compared {compared} steps"
    return identical, compared, note


def verify_bag(bag: Optional[str], capsule_dir: Path) -> Optional[dict]:
    """The run's bag replayed in this process (every recorded action, deadline misses
    re-enacted): the proof that holds whatever the timing was."""
    if not bag:
        return None
    from capsule_ros.bag.replay import ReplayOptions, replay_bag
    verdict = replay_bag(bag, ReplayOptions(capsule_dir=capsule_dir))
    return {"exit_code": verdict.exit_code(), "steps_compared": verdict.steps_compared,
            "steps_skipped": verdict.steps_skipped, "deadline_misses": verdict.deadline_misses,
            "first_divergence": str(verdict.first_divergence) if verdict.first_divergence else None,
            "seconds": round(verdict.seconds, 2)}


def _latest(q: queue.Queue, timeout: float):
    items = drain(q)
    if items:
        return items[-1]
    with contextlib.suppress(queue.Empty):
        return q.get(timeout=timeout)
    return None


def _event_dict(event) -> dict:
    from capsule_ros.serving.records import EventKind
    kind = EventKind(event.kind).name if event.kind in EventKind._value2member_map_ else str(event.kind)
    return {"kind": kind,
            "capsule_id": event.capsule_id, "episode_id": event.episode_id, "step": event.step,
            "rollback": event.rollback, "fallback": event.fallback}


def _discard(made: Optional[Path]) -> None:
    """Remove the run directory (and parents) made for a run that was refused before it ran."""
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--episodes", type=int, default=10, help="seeded episodes (default 10)")
    parser.add_argument("--device", default="cpu", help="policy device: cpu | cuda | auto (default cpu)")
    parser.add_argument("--headless", action="store_true", help="plain log lines instead of the live view")
    parser.add_argument("--out", default="", help="output directory (default runs/<stamp>)")
    parser.add_argument("--max-steps", type=int, default=150, help="step budget of one reach")
    parser.add_argument("--weights", default="", help="policy weights (default: config/policy.yaml's, the "
                        "shipped arm_reach policy); 'random' for seeded random weights")


def checked_run(args: argparse.Namespace) -> int:
    if args.episodes < 1:
        raise InvalidArgument("--episodes must be at least 1")
    return run(args)


def main(argv: Optional[List[str]] = None) -> int:
    return COMMANDS["demo"].main(argv, add_arguments, checked_run)


if __name__ == "__main__":
    sys.exit(main())
