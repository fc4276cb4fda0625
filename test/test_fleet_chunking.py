"""A chunking policy in a batched fleet (``capsule_ros.chunking.fleet``), on the LeRobot ACT
fixture (``test/fixtures/lerobot/act_queue``): each robot runs its own chunk schedule, so the
refills of different robots fall on different steps, yet every fleet program runs over all S
slots; a robot's actions do not depend on its neighbours (stepping at random, at other rows
of their chunks) or on its slot, in sync and in deterministic async mode; a capsule taken
mid-chunk (in async mode with a refill in flight) by one robot is re-entered by another,
which goes on bit-identically.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import numpy as np
import pytest
import torch
from lerobot_fixtures import PORTS, Fixture

from capsule_ros.chunking.mode import ChunkProgram
from capsule_ros.fleet import FleetConfig, FleetRobot, build_fleet
from capsule_ros.fleet.session import FleetSession
from capsule_ros.polling import wait_until
from capsule_ros.runtime.policy import CHUNK_ACTIONS
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_session

torch.set_num_threads(1)
MODES = [("sync", "auto"), ("async", "2")]


@pytest.fixture(scope="module")
def act(tmp_path_factory) -> Fixture:
    return Fixture.load("act_queue", tmp_path_factory.mktemp("lerobot"))


def config(fixture: Fixture, chunking: str, delay: str, device: str = "cpu") -> ServingConfig:
    params = fixture.serving_params()
    params["control"].update(chunking=chunking, inference_delay_steps=delay, deadline_ms=0.0)
    params["runtime"]["device"] = device
    return ServingConfig.from_params(params)


def step(fleet: FleetSession, fixture: Fixture, feeds: Dict[str, tuple]) -> Dict[str, np.ndarray]:
    """One fleet step of the robots in ``feeds`` (robot -> (episode, step) of the fixture's
    inputs), each after its refill in flight is done (no takeover is late on a busy machine)."""
    worker = fleet.runtime.fleet_mode.worker
    for name, (episode, t) in feeds.items():
        for key, value in fixture.features.items():
            fleet.robot(name).loop.write_input(PORTS[key], value[episode, t])
        if worker is not None:
            slot = fleet.robot(name).slot
            wait_until(lambda: worker.ready(slot), 30.0, "the refill in flight", interval=0.001)
    return {name: record.values for name, record in fleet.tick(list(feeds)).items()}


def robot_actions(fixture: Fixture, cfg: ServingConfig, me: int, seed: int, steps: int = 14) -> np.ndarray:
    """The robot in slot ``me`` of a fleet of 3, fed episode 0, while the two others (each
    having run a random number of steps first, so at another row of its chunk) step with it
    at random on episode 1's inputs."""
    rng = np.random.default_rng(seed)
    others = [slot for slot in range(3) if slot != me]
    robots = [FleetRobot("me", slot=me), FleetRobot("n1", slot=others[0]), FleetRobot("n2", slot=others[1])]
    fleet = build_fleet(cfg, FleetConfig(robots=("me", "n1", "n2"), slots=3, batching="vmap"), robots=robots)
    for name in ("n1", "n2"):
        for t in range(int(rng.integers(1, 9))):
            step(fleet, fixture, {name: (1, t)})
    actions = []
    for t in range(steps):
        feeds = {"me": (0, t), **{n: (1, int(rng.integers(0, 50))) for n in ("n1", "n2") if rng.random() < 0.6}}
        actions.append(step(fleet, fixture, feeds)["me"])
    fleet.release()
    return np.stack(actions)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("chunking, delay", MODES)
def test_a_chunking_robots_actions_do_not_depend_on_its_neighbours_schedules_or_its_slot(act, chunking, delay,
                                                                                          device):
    cfg = config(act, chunking, delay, device)
    first = robot_actions(act, cfg, me=0, seed=1)
    assert robot_actions(act, cfg, me=2, seed=2).tobytes() == first.tobytes()
    assert robot_actions(act, cfg, me=1, seed=3).tobytes() == first.tobytes()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("chunking, delay", MODES)
def test_a_mid_chunk_capsule_moves_to_another_robot_and_goes_on_bit_identically(act, chunking, delay, device):
    fleet = build_fleet(config(act, chunking, delay, device), FleetConfig(robots=("a", "b"), slots=2))
    for t in range(7):                              # async: row 7 of a chunk whose refill is in flight
        step(fleet, act, {"a": (0, t), "b": (1, t + 3)})
    capsule = fleet.robot("a").verbs.commit("mid-chunk")
    a_after: List[np.ndarray] = [step(fleet, act, {"a": (0, t)})["a"] for t in range(7, 15)]
    fleet.robot("b").verbs.reenter(capsule.id)
    b_after: List[np.ndarray] = [step(fleet, act, {"b": (0, t), "a": (1, t)})["b"] for t in range(7, 15)]
    assert np.stack(b_after).tobytes() == np.stack(a_after).tobytes()
    mode = fleet.runtime.fleet_mode.slot_modes[fleet.robot("b").slot]
    assert mode.counters.refills >= 2, "the robot planned its own chunks"
    fleet.release()


def chunk_of(runtime) -> bytes:
    """The bytes of a runtime's chunk being executed (``chunk.actions``), its step done."""
    if runtime.device.type == "cuda":
        torch.cuda.synchronize()
    return runtime.arena[CHUNK_ACTIONS].cpu().numpy().tobytes()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("chunking, delay", MODES)
def test_a_robots_chunk_is_its_batch_1_refill_whichever_slots_plan_alongside_it(act, chunking, delay, device):
    """Each refill plans one robot's chunk at batch 1 (``SlotPlan``): after every step, the
    robot's chunk is bit for bit the chunk of a single runtime fed the same inputs, while a
    random set of the other slots (none, some or all) plans on the same step as it (each
    having re-entered the robot's capsule of the step before, so its chunk is due when the
    robot's is, then fed other inputs), the rest step on their own schedules or idle, and
    the robot sits in a random slot. Asynchronous, the consume steps in which no slot takes
    over or asks run ``consume.steady`` (no masked request copy), the others ``consume``:
    both among the steps checked."""
    cfg = config(act, chunking, delay, device)
    # the fleet's kernels (no torch.compile); the debug checks: every buffer the programs touch is owned
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, compile="off", debug_checks=True))
    single = build_session(cfg)
    rng = np.random.default_rng(7)
    me = int(rng.integers(0, 4))
    others = [slot for slot in range(4) if slot != me]
    neighbours = ("n1", "n2", "n3")
    placed = [FleetRobot("me", slot=me), *(FleetRobot(n, slot=s) for n, s in zip(neighbours, others, strict=True))]
    fleet = build_fleet(cfg, FleetConfig(robots=("me", *neighbours), slots=4, batching="vmap"), robots=placed)
    mode = fleet.runtime.fleet_mode.slot_modes[me]
    ran: List[str] = []                       # the fleet programs run, in order
    run_program = fleet.runtime.graphs.step
    fleet.runtime.graphs.step = lambda name, **kwargs: (ran.append(name), run_program(name, **kwargs))[1]
    planned_with: List[int] = []              # how many other slots planned alongside each of the robot's plans
    for t in range(4 * mode.schedule.execution_horizon + 2):
        capsule = fleet.robot("me").verbs.commit(f"before step {t}")
        if mode.next_program() in (ChunkProgram.REFILL, ChunkProgram.REQUEST):
            joining = list(rng.permutation(neighbours)[:(3, 0, 1, 2)[len(planned_with) % 4]])
            planned_with.append(len(joining))
        else:
            joining = [n for n in neighbours if rng.random() < 0.3]
        for name in joining:
            fleet.robot(name).verbs.reenter(capsule.id)
        feeds = {"me": (0, t), **{n: (int(rng.integers(1, 3)), int(rng.integers(0, 50))) for n in neighbours
                                  if n in joining or rng.random() < 0.5}}
        step(fleet, act, feeds)
        fleet.robot("me").verbs.drop(capsule.id)
        for key, value in act.features.items():
            single.loop.write_input(PORTS[key], value[0, t])
        single.loop.tick()
        if single.parts.runtime.mode.worker is not None:            # the single runtime's takeover, later, waits for it
            wait_until(single.parts.runtime.mode.worker.ready, 30.0, "the single runtime's refill", interval=0.001)
        assert chunk_of(fleet.runtime.runtime(me)) == chunk_of(single.parts.runtime), f"step {t}"
    assert set(planned_with) == {0, 1, 2, 3}, "the robot planned alone and with 1, 2 and 3 others planning with it"
    consumed = {name for name in ran if name.startswith("consume")}
    assert consumed == ({"consume", "consume.steady"} if chunking == "async" else {"consume"}), sorted(set(ran))
    fleet.release()
    single.release()


def test_async_auto_delay_is_refused_for_a_batched_fleet(act):
    from capsule_ros.config import ConfigError
    with pytest.raises(ConfigError, match="auto measures one robot's refill"):
        build_fleet(config(act, "async", "auto"), FleetConfig(robots=("a", "b")))
