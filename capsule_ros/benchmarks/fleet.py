"""`capsule-ros bench fleet`: N robots served by one fleet of S batch slots, against N
separate runtimes in one process, for N = 1 .. S, side by side in one run.

Cases (``--cases``, default all three):

- ``default``: the default policy (config/policy.yaml, its shipped weights);
- ``act``: the ACT benchmark checkpoint (``benchmarks/lerobot_act.py``: LeRobot's default
  architecture, one 480 x 640 camera; ``--quick``: small, 96 x 128), sync chunking, the
  robots' chunks at staggered rows (each robot's refills fall on its own steps);
- ``act-async``: the same with ``control.chunking: async`` and a delay of ``ASYNC_DELAY``
  steps (90 of each chunk's 100 rows executed): each refill is planned by the refill worker
  (a thread on a CPU, a stream on a GPU) while the control steps go on, on both sides;
- ``recurrent``: an Isaac Lab-style recurrent actor as exported to ONNX (an LSTM of 256
  and an ELU MLP of 512, 256, 128 on 48 observations, 12 actions; ``--quick``: 64, 64/64),
  written in torch (``RecurrentActor``): ONNX Runtime's LSTM cannot be batched by vmap (a
  policy.kind onnx fleet runs the loop batching, which is what ``loop`` measures).

Sides (``--sides``, default all five). In process, each at the session level (what a
node pays per control period: every robot's inputs staged, the step, the outputs read and
checked, the accounting):

- ``fleet``: one ``FleetSession`` of S slots (``fleet.batching: vmap``), N of its robots
  stepping in each fleet step (the other slots idle);
- ``loop``: the same with ``fleet.batching: loop`` (the batch-invariant path: each slot runs
  the single-robot program);
- ``separate``: N ``PolicySession`` s, each with its own runtime and copy of the weights,
  ticked one after the other per control period.

Processes, driven over real topics in trigger mode from one driver process (its own rclpy
node and executor): for each robot-step its inputs are published and its action message
awaited, the round trip timed (``capsule_ros/benchmarks/fleet_nodes.py``):

- ``nodes``: N ``policy_node`` processes, one per robot (max N started once, the first N
  driven);
- ``fleet_node``: one ``fleet_node`` process serving N robots from S slots (started once
  per N: a robot that never asks would hold every gathered step for ``fleet.gather_ms``).

This module imports and runs without ROS: the sides are passed in (``run(sides=...)``);
the command line (``capsule_ros.cli.main``) adds the process sides where rclpy imports and
otherwise records them as skipped with the reason (the GPU machine has no ROS). The nodes
serve each case with the parameters the in-process sides use (ACT's camera frames go over
``sensor_msgs/Image``, 480 x 640 rgb8 per robot-step). The recurrent case's nodes serve
the same actor (same weights) as a ``torch.export`` program (``policy.kind: exported``,
``capsule-ros export``'s format), which vmap cannot batch: its ``fleet_node`` runs
``fleet.batching: loop``.

``--steps``: control periods per side and N (default 200; ``--quick``: 50, and S = 4).
``--float32-matmul high``: every side's float32 matrix products on TensorFloat-32 on a GPU
(``runtime.float32_matmul``; a batch-1 refill is where a GPU-bound fleet spends most).

Figures per side and N: robot-steps/s (N x ticks / wall time), the time of a control
period for all N robots (p50 / p99 ms) and, for ``separate``, one robot's step; for the
process sides, also each robot-step's round trip (``roundtrip_ms``: its inputs published to
its action received). Ratios: every side's aggregate robot-steps/s over separate's. For the fleet at N = S: a robot's
commit (its snapshot at the boundary) and the other robots' next fleet step against their
steps without it (``snapshot_stall_ms``); and whether a robot's actions in the fleet equal
its actions in a single runtime bit for bit (``identical_to_single``: the batch size S
changes a batched step's bits; the loop batching's equal a single runtime's).
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from capsule_ros.benchmarks.common import chosen, config_path, emit, environment, pct, print_table, resolve_device
from capsule_ros.config import load_params_file
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.numerics import FLOAT32_MATMUL_HIGHEST
from capsule_ros.runtime.policy import ACTION, RNG, STEP, State, StatefulPolicy, standard_specs
from capsule_ros.serving.config import ServingConfig

CASES = ("default", "act", "act-async", "recurrent")
ASYNC_DELAY = 10                      # act-async: steps between a refill's request and its takeover
OBS, ACTIONS = 48, 12


class RecurrentActor(StatefulPolicy):
    """An rsl_rl recurrent actor as Isaac Lab exports it to ONNX (observation normaliser,
    one LSTM layer in ONNX's gate order i, o, f, c written as linear layers, an ELU MLP), as
    a StatefulPolicy: h and c are its recurrent state."""

    action_dim, chunk_horizon = ACTIONS, 1
    mean: torch.Tensor               # buffers (register_buffer), declared for the type checker
    std: torch.Tensor

    def __init__(self, hidden: int, mlp: Sequence[int], seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.hidden = hidden
            self.gates = nn.Linear(OBS + hidden, 4 * hidden)
            widths = [hidden, *mlp]
            self.mlp = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))
            self.head = nn.Linear(widths[-1], ACTIONS)
            self.register_buffer("mean", torch.randn(OBS) * 0.1)
            self.register_buffer("std", torch.rand(OBS) + 0.5)
        self.mlp_widths = tuple(mlp)

    def state_spec(self) -> List[BufferSpec]:
        return [BufferSpec("obs", (OBS,), torch.float32, BufferKind.INPUT),
                BufferSpec("h", (self.hidden,), torch.float32, BufferKind.RECURRENT),
                BufferSpec("c", (self.hidden,), torch.float32, BufferKind.RECURRENT),
                *standard_specs(ACTIONS, 1)]

    def init_state(self, state: State, *, episode: int, seed: int) -> None:
        for name in ("h", "c", ACTION, STEP):
            state[name].zero_()
        state[RNG][0] = seed

    def step(self, state: State) -> None:
        obs = (state["obs"] - self.mean) / self.std
        gates = self.gates(torch.cat([obs, state["h"]]))
        i, o, f, g = gates.chunk(4)
        c = torch.sigmoid(f) * state["c"] + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        x = h
        for layer in self.mlp:
            x = nn.functional.elu(layer(x))
        action = self.head(x)
        state["h"].copy_(h)
        state["c"].copy_(c)
        state[ACTION].copy_(action)
        state["chunk"].copy_(action[None])
        state[STEP].add_(1)

    def architecture(self) -> dict:
        return {"policy": "bench recurrent actor", "hidden": self.hidden, "mlp": list(self.mlp_widths)}


class RecurrentProgram(nn.Module):
    """``actor``'s step in the export interface (``capsule_ros.policies.export``): batch
    first, pure, ``forward(obs, h, c) -> (action, chunk, h, c)``; what a node serves."""

    def __init__(self, actor: RecurrentActor):
        super().__init__()
        self.actor = actor
        self.inputs = [BufferSpec("obs", (OBS,), torch.float32, BufferKind.INPUT)]
        self.state = [BufferSpec(name, (actor.hidden,), torch.float32, BufferKind.RECURRENT) for name in ("h", "c")]
        self.action_dim, self.chunk_horizon = ACTIONS, 1

    def initial_state(self) -> Dict[str, torch.Tensor]:
        return {"h": torch.zeros(self.actor.hidden), "c": torch.zeros(self.actor.hidden)}

    def forward(self, obs: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        actor = self.actor
        i, o, f, g = actor.gates(torch.cat([(obs - actor.mean) / actor.std, h], -1)).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        x = h
        for layer in actor.mlp:
            x = nn.functional.elu(layer(x))
        action = actor.head(x)
        return action, action[:, None], h, c


@dataclasses.dataclass
class Case:
    """What a case serves: its config, the policy (None: ``policy.kind``'s), its inputs."""

    name: str
    config: ServingConfig
    make_policy: Optional[Callable[[], StatefulPolicy]]
    stagger: int                      # steps between the robots' chunk phases (0: no chunking)
    frames: Dict[str, Any]            # port -> a few input rows to cycle through (numpy)
    node_params: Callable[[], Dict[str, Any]]   # the ROS parameters a node serves it with
    node_batching: str = "vmap"       # fleet_node's fleet.batching for it


def _params(params: Dict[str, Any], device: torch.device, float32_matmul: str, *, pools_mb: float = 8.0,
            input_log_steps: int = 64) -> Dict[str, Any]:
    """``params`` (a node's parameters) on ``device`` with ``runtime.float32_matmul``, without
    a capsule directory, deadlines or port staleness (the in-process sides stage inputs
    directly, as no message arrives), and small capsule pools (a commit at a time; the pools
    are allocated up front, per session); every side serves the same parameters."""
    params["runtime"].update(device=str(device), float32_matmul=float32_matmul)
    params["capsules"].update(directory="", device_budget_mb=pools_mb, host_budget_mb=pools_mb)
    params["control"].update(deadline_ms=0.0, input_log_steps=input_log_steps)
    for port in params["ports"]["names"]:
        params["ports"][port]["staleness_ms"] = 0.0
    return params


def make_case(name: str, device: torch.device, quick: bool, workdir: Path, rng: np.random.Generator,
              slots: int, float32_matmul: str = FLOAT32_MATMUL_HIGHEST) -> Case:
    frames: Dict[str, Any]
    if name == "default":
        params = _params(load_params_file(config_path("policy.yaml")), device, float32_matmul)
        frames = {"joints": rng.normal(size=(8, 4)).astype(np.float32),
                  "goal": rng.normal(size=(8, 2)).astype(np.float32)}
        return Case(name, ServingConfig.from_params(params), None, 0, frames, node_params=lambda: params)
    if name in ("act", "act-async"):
        from capsule_ros.benchmarks.lerobot_act import serving_params, write_act_checkpoint
        act = _params(serving_params(write_act_checkpoint(workdir / name, quick=quick)), device, float32_matmul,
                      pools_mb=16.0, input_log_steps=8)
        horizon = 100                 # the checkpoint's n_action_steps: a chunk lasts 100 steps
        if name == "act-async":
            act["control"].update(chunking="async", inference_delay_steps=str(ASYNC_DELAY))
            horizon -= ASYNC_DELAY    # rows executed per chunk: the rest count as executed while it is planned
        config = ServingConfig.from_params(act)
        shape = config.ports["top_camera"].shape
        frames = {"joints": rng.normal(size=(8, config.ports["joints"].shape[0])).astype(np.float32),
                  "top_camera": rng.integers(0, 256, size=(4, *shape), dtype=np.uint8)}
        return Case(name, config, None, max(1, horizon // slots), frames, node_params=lambda: act)
    hidden, mlp = (64, (64, 64)) if quick else (256, (512, 256, 128))
    params = _params(load_params_file(config_path("policy.yaml")), device, float32_matmul)
    params["ports"] = {"names": ["obs"], "obs": {"topic": "observation", "type": "std_msgs/msg/Float32MultiArray",
                                                  "fields": ["data"], "shape": [OBS], "dtype": "float32"}}
    params["control"]["trigger_port"] = "obs"

    def exported_params() -> Dict[str, Any]:
        program = workdir / f"recurrent-{hidden}.pt2"
        if not program.exists():
            from capsule_ros.policies.export import export_module
            export_module(RecurrentProgram(RecurrentActor(hidden, mlp)), program)
        return {**params, "policy": {**params["policy"], "kind": "exported", "weights": "",
                                     "exported": {"program": str(program)}}}
    return Case(name, ServingConfig.from_params(params), lambda: RecurrentActor(hidden, mlp), 0,
                {"obs": rng.normal(size=(8, OBS)).astype(np.float32)}, node_params=exported_params,
                node_batching="loop")


def _stage(loop: Any, case: Case, t: int) -> None:
    for port, rows in case.frames.items():
        loop.write_input(port, rows[t % len(rows)])


def staggered_fleet(case: Case, slots: int, batching: str) -> Tuple[Any, Tuple[str, ...]]:
    """A fleet of ``slots`` robots (``r0`` ...) serving ``case``, each robot's chunk at another
    row; the fleet and its robots' names."""
    from capsule_ros.fleet import FleetConfig, build_fleet
    names = tuple(f"r{i}" for i in range(slots))
    policy = case.make_policy() if case.make_policy is not None else None
    fleet = build_fleet(case.config, FleetConfig(robots=names, batching=batching), policy=policy)
    _stagger(case, [fleet.robot(name).loop for name in names])
    return fleet, names


def timed_ticks(fleet: Any, case: Case, active: Sequence[str], ticks: int) -> np.ndarray:
    """``ticks`` fleet steps of the ``active`` robots, each timed (seconds) after every
    robot's inputs are staged."""
    seconds = np.zeros(ticks)
    for t in range(ticks):
        for name in active:
            _stage(fleet.robot(name).loop, case, t)
        start = time.perf_counter()
        fleet.tick(active)
        seconds[t] = time.perf_counter() - start
    return seconds


def fleet_side(case: Case, slots: int, ns: Sequence[int], ticks: int, batching: str) -> Dict[str, Any]:
    """One fleet of ``slots`` robots; for each N, ``ticks`` fleet steps of its first N robots."""
    fleet, names = staggered_fleet(case, slots, batching)
    out: Dict[str, Any] = {"by_n": {}}
    for n in ns:
        out["by_n"][n] = _figures(n, timed_ticks(fleet, case, names[:n], ticks))
    if batching == "vmap":
        out["snapshot_stall_ms"] = _snapshot_stall(fleet, case, names, ticks)
    out["first_robot"] = _first_robot_actions(fleet, case, names[0])
    fleet.release()
    return out


def separate_side(case: Case, ns: Sequence[int], ticks: int) -> Dict[str, Any]:
    """max(ns) separate sessions, each its own runtime; for each N, the first N ticked in turn."""
    from capsule_ros.runtime.builder import runtime_identity
    from capsule_ros.serving.factory import PreparedServing, port_bindings, start_session
    sessions = []
    for _ in range(max(ns)):
        if case.make_policy is None:
            from capsule_ros.serving.factory import build_session
            sessions.append(build_session(case.config))
        else:
            policy = case.make_policy()
            identity = runtime_identity(policy, case.config.runtime, port_bindings(case.config))
            sessions.append(start_session(PreparedServing(case.config, policy, identity)))
    _stagger(case, [session.loop for session in sessions])
    out: Dict[str, Any] = {"by_n": {}}
    for n in ns:
        periods, robot = [], []
        for t in range(ticks):
            for session in sessions[:n]:
                _stage(session.loop, case, t)
            start = time.perf_counter()
            for session in sessions[:n]:
                one = time.perf_counter()
                session.loop.tick()
                robot.append(time.perf_counter() - one)
            periods.append(time.perf_counter() - start)
        out["by_n"][n] = {**_figures(n, np.asarray(periods)), "robot_step_ms": pct(robot, 1e3)}
    out["first_robot"] = _first_robot_actions(None, case, "", session=sessions[0])
    for session in sessions:
        session.release()
    return out


Measure = Callable[[Case, int, Sequence[int], int], Dict[str, Any]]   # (case, slots, ns, ticks) -> figures


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of the comparison: its name and how it measures a case, or (``measure``
    None) why it cannot run here. A measure may return ``{"skipped": reason}`` for a case."""

    name: str
    measure: Optional[Measure]
    skipped: str = ""


IN_PROCESS = ("fleet", "loop", "separate")
PROCESSES = ("nodes", "fleet_node")          # capsule_ros/benchmarks/fleet_nodes.py (ROS)
SIDE_NAMES = IN_PROCESS + PROCESSES


def in_process_sides() -> Tuple[Side, ...]:
    """fleet, loop and separate: the sides that need no ROS."""
    return (Side("fleet", lambda case, slots, ns, ticks: fleet_side(case, slots, ns, ticks, "vmap")),
            Side("loop", lambda case, slots, ns, ticks: fleet_side(case, slots, ns, ticks, "loop")),
            Side("separate", lambda case, slots, ns, ticks: separate_side(case, ns, ticks)))


def _stagger(case: Case, loops: Sequence[Any]) -> None:
    """Robot k runs k x ``case.stagger`` steps alone first: each robot's chunk at another row."""
    for k, loop in enumerate(loops):
        for t in range(k * case.stagger):
            _stage(loop, case, t)
            loop.tick()


def _figures(n: int, seconds: np.ndarray) -> Dict[str, Any]:
    return {"robot_steps_per_s": float(n * len(seconds) / seconds.sum()), "period_ms": pct(seconds, 1e3)}


def _snapshot_stall(fleet: Any, case: Case, names: Sequence[str], ticks: int) -> Dict[str, Any]:
    """Robot 0 commits (and drops it) before every other fleet step of the others: the
    commit's time at the boundary, and the others' step after it against without."""
    others = names[1:] or names
    plain: List[float] = []
    after: List[float] = []
    commits: List[float] = []
    robot = fleet.robot(names[0])
    for t in range(ticks):
        for name in others:
            _stage(fleet.robot(name).loop, case, t)
        if t % 2:
            start = time.perf_counter()
            capsule = robot.verbs.commit("stall")
            commits.append(time.perf_counter() - start)
        start = time.perf_counter()
        fleet.tick(others)
        (after if t % 2 else plain).append(time.perf_counter() - start)
        if t % 2:
            robot.verbs.drop(capsule.id)
    return {"commit_ms": pct(commits, 1e3), "next_step_ms": pct(after, 1e3), "without_ms": pct(plain, 1e3),
            "stall_p50_ms": float(np.percentile(after, 50) - np.percentile(plain, 50)) * 1e3}


def _first_robot_actions(fleet: Any, case: Case, name: str, session: Any = None, steps: int = 16) -> List[list]:
    """A robot's actions on the case's inputs after a reset (for the bits comparison)."""
    session = session if session is not None else fleet.robot(name).session
    session.verbs.reset()
    actions = []
    for t in range(steps):
        _stage(fleet.robot(name).loop if fleet is not None else session.loop, case, t)
        record = fleet.tick([name])[name] if fleet is not None else session.loop.tick()
        actions.append(record.values.tolist())
    return actions


def run_case(case: Case, slots: int, ns: Sequence[int], ticks: int, sides: Sequence[Side]) -> Dict[str, Any]:
    """Every side on ``case``; ratios of each side's robot-steps/s over separate's, and the
    bits of fleet and loop against a single runtime (when separate ran)."""
    figures: Dict[str, Dict[str, Any]] = {
        side.name: (side.measure(case, slots, ns, ticks) if side.measure is not None else {"skipped": side.skipped})
        for side in sides}
    measured = [name for name, side in figures.items() if "skipped" not in side]
    out: Dict[str, Any] = {"sides": figures, "ratios": {}, "identical_to_single": {}, "max_abs_diff_to_single": {}}
    if "separate" not in measured:
        return out
    single = np.asarray(figures["separate"].pop("first_robot"), dtype=np.float32)
    for name in ("fleet", "loop"):
        if name in measured:
            mine = np.asarray(figures[name].pop("first_robot"), dtype=np.float32)
            out["identical_to_single"][name] = bool(mine.tobytes() == single.tobytes())
            out["max_abs_diff_to_single"][name] = float(np.abs(mine - single).max())
    for n in ns:
        base = figures["separate"]["by_n"][n]["robot_steps_per_s"]
        out["ratios"][n] = {name: figures[name]["by_n"][n]["robot_steps_per_s"] / base
                            for name in measured if name != "separate"}
    return out


def run(device: torch.device, quick: bool, cases: Sequence[str], ticks: Optional[int] = None,
        sides: Optional[Sequence[Side]] = None, float32_matmul: str = FLOAT32_MATMUL_HIGHEST) -> Dict[str, Any]:
    """``sides``: default the in-process ones (the command line adds the process sides);
    ``float32_matmul``: every side's ``runtime.float32_matmul``."""
    sides = tuple(sides) if sides is not None else in_process_sides()
    slots = 4 if quick else 16
    ns = [n for n in (1, 2, 4, 8, 16) if n <= slots]
    ticks = ticks or (50 if quick else 200)
    rng = np.random.default_rng(0)
    result: Dict[str, Any] = {"environment": environment(device), "slots": slots, "ns": ns, "ticks": ticks,
                              "sides": [side.name for side in sides], "float32_matmul": float32_matmul, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="capsule_bench_fleet_") as workdir:
        for name in cases:
            case = make_case(name, device, quick, Path(workdir), rng, slots, float32_matmul)
            result["cases"][name] = run_case(case, slots, ns, ticks, sides)
    return result


def table(result: Dict[str, Any]) -> None:
    for name, case in result["cases"].items():
        ran = [side for side, figures in case["sides"].items() if "skipped" not in figures]
        ratios = [side for side in ran if side != "separate" and "separate" in ran]
        header: List[str] = ["N"]
        for side in ran:
            header += [f"{side}/s", "p50", "p99"]
        rows = []
        for n in result["ns"]:
            row: List[object] = [n]
            for side in ran:
                figures = case["sides"][side]["by_n"][n]
                row += [figures["robot_steps_per_s"], figures["period_ms"]["p50"], figures["period_ms"]["p99"]]
            rows.append(row + [case["ratios"][n][side] for side in ratios])
        print_table(f"bench fleet, {name} (S = {result['slots']}): robot-steps/s and control period p50 / p99 (ms)",
                    header + [f"{side} x" for side in ratios], rows)
        stall = case["sides"].get("fleet", {}).get("snapshot_stall_ms")
        if stall:
            print(f"  commit p50 {stall.get('commit_ms', {}).get('p50', 0):.3f} ms, others' next step +"
                  f"{stall.get('stall_p50_ms', 0):.3f} ms; identical to a single runtime: "
                  f"{case['identical_to_single']}")
        for side, figures in case["sides"].items():
            if "skipped" in figures:
                print(f"  {side}: skipped ({figures['skipped']})")


def main(args, sides: Optional[Sequence[Side]] = None) -> int:
    """``sides``: what the command line assembled (default the in-process ones), of which
    ``--sides`` picks."""
    device = resolve_device(args.device)
    cases = chosen(args.cases, CASES, "cases", "fleet")
    available = {side.name: side for side in (sides if sides is not None else in_process_sides())}
    picked = chosen(getattr(args, "sides", None), SIDE_NAMES, "sides", "fleet")
    picked_sides = [available.get(name, Side(name, None, "not offered by this caller")) for name in picked]
    emit(run(device, args.quick, cases, args.steps, picked_sides,
             getattr(args, "float32_matmul", FLOAT32_MATMUL_HIGHEST)), args.json, table)
    return 0


__all__ = ["IN_PROCESS", "PROCESSES", "SIDE_NAMES", "Case", "RecurrentActor", "RecurrentProgram", "Side",
           "in_process_sides", "main"]
