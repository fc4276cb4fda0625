"""The chunking mode without ROS (``capsule_ros.chunking``), on the LeRobot
fixtures (``test/fixtures/lerobot``): the network runs only when a chunk is due; async mode
equals LeRobot's own ``predict_action_chunk`` in the fixed-delay loop of
``tools/lerobot_fixtures/make_references.py`` (``async.npz``) bit for bit; capsules taken at
every row of a chunk, and while a refill is in flight, restore byte-exactly and the actions
after them are bit-identical; stale refills are discarded by reset and re-enter; a slowed
refill is a deadline event, not a divergence; chunk schedules that cannot work, and capsules
of another schedule or with a forged cursor, are refused with the numbers.
"""
from __future__ import annotations

import dataclasses
import re
import threading
from typing import Dict, List

import numpy as np
import pytest
import torch
from lerobot_fixtures import PORTS, Fixture, load_npz, reference_path
from torch.utils._python_dispatch import TorchDispatchMode

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.chunking.mark import ChunkingMark
from capsule_ros.chunking.mode import ChunkProgram
from capsule_ros.chunking.schedule import ChunkingSettings, ChunkSchedule
from capsule_ros.chunking.workers import InlineRefill, ThreadRefill
from capsule_ros.errors import ConfigError, CorruptCapsule, FingerprintMismatch
from capsule_ros.polling import wait_until
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_runtime, build_session, prepare_serving
from capsule_ros.serving.records import ActionSource, StepFault

torch.set_num_threads(1)
CHUNKING = ("act_queue", "diffusion", "diffusion_ddim_env")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Dict[str, Fixture]:
    root = tmp_path_factory.mktemp("lerobot")
    return {name: Fixture.load(name, root) for name in CHUNKING}


def config(fixture: Fixture, chunking: str = "sync", delay: str = "auto", **control) -> ServingConfig:
    params = fixture.serving_params()
    params["control"].update(chunking=chunking, inference_delay_steps=delay, deadline_ms=0.0, **control)
    return ServingConfig.from_params(params)


def runtime_for(fixture: Fixture, chunking: str = "sync", delay: int = 0, worker: str = "auto") -> PolicyRuntime:
    cfg = config(fixture, chunking, str(delay) if delay else "auto")
    return build_runtime(cfg, worker=worker)


def mark_of(capsule) -> ChunkingMark:
    return ChunkingMark.parse(capsule.mark, capsule.id)


def stage(runtime: PolicyRuntime, fixture: Fixture, episode: int, step: int) -> None:
    for key, value in fixture.features.items():
        runtime.staging[PORTS[key]][...] = value[episode, step]


def rollout(runtime: PolicyRuntime, fixture: Fixture, episode: int, steps: int) -> np.ndarray:
    runtime.reset(episode=episode, seed=fixture.seed(episode))
    out = []
    for t in range(steps):
        stage(runtime, fixture, episode, t)
        runtime.load_inputs()
        runtime.step()
        out.append(runtime.read_outputs().action)
    return np.stack(out)


def ticks(session, fixture: Fixture, episode: int, steps: range, wait: bool = True) -> List:
    """Ticks on the fixture's inputs, each after the refill in flight (async) is done: no
    takeover is late, whatever the machine's load (the slowed-refill test makes one late)."""
    out = []
    worker = session.parts.runtime.mode.worker
    for t in steps:
        if worker is not None and wait:
            wait_until(worker.ready, 30.0, "the refill in flight", interval=0.001)
        for key, value in fixture.features.items():
            session.loop.write_input(PORTS[key], value[episode, t])
        out.append(session.loop.tick())
    return out


def values(records) -> bytes:
    return b"".join(r.values.tobytes() for r in records)


# -- the network runs only when a chunk is due -----------------------------------------------------

@pytest.mark.parametrize("name", CHUNKING)
def test_sync_mode_plans_once_per_chunk_and_equals_lerobot_select_action(name, fixtures):
    fixture = fixtures[name]
    runtime = runtime_for(fixture)
    horizon = runtime.mode.schedule.execution_horizon
    before = dataclasses.replace(runtime.mode.counters)
    actions = rollout(runtime, fixture, 0, 60)
    counters = runtime.mode.counters
    assert counters.refills - before.refills == 60 // horizon + (60 % horizon > 0)
    assert counters.consumes - before.consumes == 60 - (counters.refills - before.refills)
    assert actions.tobytes() == fixture.outputs["action"][0, :60].tobytes()


def test_consume_steps_of_act_upload_no_inputs(fixtures):
    """ACT reads its inputs only when it plans: a consume step ignores what is staged."""
    fixture = fixtures["act_queue"]
    runtime = runtime_for(fixture)
    runtime.reset(episode=0, seed=fixture.seed(0))
    stage(runtime, fixture, 0, 0)
    assert runtime.mode.reads_inputs()                   # the first step plans
    runtime.load_inputs()
    runtime.step()
    assert not runtime.mode.reads_inputs()
    staged = {name: view.copy() for name, view in runtime.staging.items()}
    arena = runtime.arena.storage.clone()
    for view in runtime.staging.values():
        view[...] = 0
    runtime.load_inputs()                                   # nothing moves: the next step only consumes
    assert torch.equal(runtime.arena.storage, arena)
    for name, value in staged.items():
        runtime.staging[name][...] = value


# -- async mode: LeRobot's own chunks, a fixed delay -----------------------------------------------

@pytest.mark.parametrize("name", CHUNKING)
def test_async_mode_equals_lerobots_fixed_delay_loop_bit_for_bit(name, fixtures):
    fixture = fixtures[name]
    reference = load_npz(reference_path(name, "async.npz"))
    episodes = reference[f"action_d{int(reference['delays'][0])}"].shape[0]
    for delay, horizon in zip(reference["delays"], reference["horizons"], strict=True):
        runtime = runtime_for(fixture, "async", int(delay))
        assert isinstance(runtime.mode.worker, ThreadRefill)
        assert (runtime.mode.schedule.delay, runtime.mode.schedule.execution_horizon) == (delay, horizon)
        expected = reference[f"action_d{int(delay)}"]
        for episode in range(episodes):
            got = rollout(runtime, fixture, episode, expected.shape[1])
            diff = float(np.abs(got - expected[episode]).max())
            assert got.tobytes() == expected[episode].tobytes(), f"{name} d={delay} episode {episode}: {diff}"
        runtime.close()
    # and the delay changes the actions: the check can fail
    first, last = (reference[f"action_d{int(d)}"] for d in (reference["delays"][0], reference["delays"][-1]))
    assert first.tobytes() != last.tobytes()


def test_async_runs_every_program_and_plans_off_the_calling_thread(fixtures):
    fixture = fixtures["act_queue"]                           # chunk 10, 5 executed: d 3 -> rows 3..7
    runtime = runtime_for(fixture, "async", 3)
    seen = []
    runtime.reset(episode=0, seed=fixture.seed(0))
    threads = set()
    plan = runtime.mode.worker.run_plan
    runtime.mode.worker.run_plan = lambda: (threads.add(threading.current_thread().name), plan())
    for t in range(20):
        stage(runtime, fixture, 0, t)
        runtime.load_inputs()
        seen.append(runtime.step().program)
        runtime.read_outputs()
    assert seen[:9] == [ChunkProgram.REFILL, *[ChunkProgram.CONSUME] * 4, ChunkProgram.REQUEST, ChunkProgram.CONSUME,
                        ChunkProgram.CONSUME, ChunkProgram.ADOPT]
    assert seen[9:14] == [ChunkProgram.CONSUME, ChunkProgram.REQUEST, ChunkProgram.CONSUME, ChunkProgram.CONSUME,
                          ChunkProgram.ADOPT]
    assert threads and all(name.startswith("capsule-refill") for name in threads)


class _Operations(TorchDispatchMode):
    """The names of the torch operations run under it, in order."""

    def __init__(self):
        super().__init__()
        self.names: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _record_calls(obj, method: str, calls: List[str]) -> None:
    original = getattr(obj, method)

    def recorded(*args, **kwargs):
        calls.append(method)
        return original(*args, **kwargs)
    setattr(obj, method, recorded)


@pytest.mark.parametrize("name", ("act_queue", "diffusion"))
def test_an_async_consume_step_is_the_sync_consume_step_and_leaves_the_worker_alone(name, fixtures):
    """A step between an async takeover and the next request runs the very operations of a
    sync consume step (on a GPU: the same captured program), and calls nothing of the
    refill worker: no submission, no poll, no wait. Only request and takeover steps do."""
    fixture = fixtures[name]
    consume_ops: Dict[str, set] = {}
    for chunking, delay in (("sync", 0), ("async", 2)):
        runtime = runtime_for(fixture, chunking, delay)
        worker_calls: List[str] = []
        if runtime.mode.worker is not None:
            for method in ("submit", "ready", "before_adopt"):
                _record_calls(runtime.mode.worker, method, worker_calls)
        runtime.reset(episode=0, seed=fixture.seed(0))
        seen = set()
        for t in range(2 * runtime.mode.schedule.end + 2):
            stage(runtime, fixture, 0, t)
            program = runtime.mode.next_program()
            runtime.load_inputs()
            before = len(worker_calls)
            with _Operations() as ops:
                runtime.step()
            runtime.read_outputs()
            seen.add(program)
            if program == ChunkProgram.CONSUME:
                consume_ops.setdefault(chunking, set()).add(tuple(ops.names))
                assert len(worker_calls) == before, (chunking, t, worker_calls[before:])
        if chunking == "async":
            assert {ChunkProgram.REQUEST, ChunkProgram.ADOPT} <= seen and worker_calls, seen
        runtime.close()
    assert len(consume_ops["sync"]) == 1 and consume_ops["async"] == consume_ops["sync"], consume_ops


def test_inline_and_thread_workers_give_the_same_bits(fixtures):
    fixture = fixtures["diffusion"]
    a = rollout(runtime_for(fixture, "async", 4, worker="inline"), fixture, 1, 40)
    b = rollout(runtime_for(fixture, "async", 4), fixture, 1, 40)
    assert isinstance(runtime_for(fixture, "async", 4, worker="inline").mode.worker, InlineRefill)
    assert a.tobytes() == b.tobytes()


# -- capsules: every row of a chunk, and across an in-flight refill ----------------------------------

@pytest.mark.parametrize("chunking, delay", [("sync", "auto"), ("async", "3")])
def test_a_capsule_at_every_row_of_a_chunk_restores_byte_exactly_and_replays_bit_identically(
        fixtures, tmp_path, chunking, delay):
    fixture = fixtures["act_queue"]
    session = build_session(config(fixture, chunking, delay))
    schedule = session.parts.runtime.mode.schedule
    steps = range(4 * schedule.end)
    original = ticks(session, fixture, 0, steps)
    seen_pending = False
    for k in range(2 * schedule.end, 3 * schedule.end + 1):      # a whole chunk cycle, from a mid-episode state
        session.verbs.reset()
        ticks(session, fixture, 0, range(k))
        capsule = session.verbs.commit(label=f"row {k}")
        snapshot = session.parts.runtime.arena.storage.clone()
        seen_pending |= mark_of(capsule).pending
        ticks(session, fixture, 0, range(k, k + 3))               # move on, then come back
        session.verbs.reenter(capsule.id)
        assert torch.equal(session.parts.runtime.arena.storage, snapshot), f"restore at step {k} not byte-exact"
        again = ticks(session, fixture, 0, range(k, len(steps)))
        assert values(again) == values(original[k:]), f"capsule at step {k} ({mark_of(capsule).describe()})"
        session.verbs.drop(capsule.id)
    assert seen_pending == (chunking == "async")                 # some capsules held an in-flight request


def test_a_capsule_with_a_refill_in_flight_survives_disk_and_a_fresh_process_runtime(fixtures, tmp_path):
    fixture = fixtures["diffusion"]
    params = fixture.serving_params()
    params["control"].update(chunking="async", inference_delay_steps="4", deadline_ms=0.0)
    params["capsules"]["directory"] = str(tmp_path / "capsules")
    cfg = ServingConfig.from_params(params)
    session = build_session(cfg)
    schedule = session.parts.runtime.mode.schedule
    ticks(session, fixture, 2, range(schedule.execution_horizon + 2))          # a request is out
    capsule = session.verbs.commit(label="in flight", persist=True)
    assert mark_of(capsule).pending and mark_of(capsule).delay == 4
    expected = ticks(session, fixture, 2, range(schedule.execution_horizon + 2, 40))
    other = build_session(cfg)                                           # another runtime, from the file
    loaded = other.verbs.load(capsule.id)
    assert loaded.mark == capsule.mark
    other.verbs.reenter(capsule.id)
    assert values(ticks(other, fixture, 2, range(schedule.execution_horizon + 2, 40))) == values(expected)


def test_reset_and_reenter_discard_a_stale_refill(fixtures):
    fixture = fixtures["act_queue"]
    session = build_session(config(fixture, "async", "3"))
    fresh = ticks(session, fixture, 1, range(12))
    session.verbs.reset()
    ticks(session, fixture, 0, range(6))                      # step 5 requested a chunk from episode 0
    assert session.parts.runtime.mode.pending
    session.verbs.reset()                                              # ... which must not take over here
    assert values(ticks(session, fixture, 1, range(12))) == values(fresh)
    ticks(session, fixture, 0, range(6))
    root = session.parts.recompute.root_id
    session.verbs.reenter(root)                                        # a rollback to the episode's start
    assert values(ticks(session, fixture, 1, range(12))) == values(fresh)


def test_a_slowed_refill_is_a_deadline_event_with_the_safe_action_not_a_divergence(fixtures):
    """The first request's plan is held until its takeover step has begun: that step hands
    out the safe action and counts the deadline event; its state, and every later action,
    are the unslowed run's. Every other tick waits for its refill first, so nothing else
    can be late, however busy the machine."""
    fixture = fixtures["act_queue"]
    reference = build_session(config(fixture, "async", "2"))
    expected = ticks(reference, fixture, 0, range(30))
    assert reference.parts.loop.counters.late_refills == 0
    schedule = reference.parts.runtime.mode.schedule
    takeover = schedule.execution_horizon + schedule.delay       # the first request is at step `horizon`
    session = build_session(config(fixture, "async", "2", deadline_action="zero"))
    worker = session.parts.runtime.mode.worker
    plan, release, held = worker.run_plan, threading.Event(), []

    def slow_plan():
        if not held:
            held.append(True)
            release.wait(10)
        plan()
    worker.run_plan = slow_plan
    got = ticks(session, fixture, 0, range(schedule.execution_horizon + 1))        # ... the request at step `horizon`
    got += ticks(session, fixture, 0, range(schedule.execution_horizon + 1, takeover), wait=False)
    threading.Timer(0.2, release.set).start()                   # the refill ends 0.2 s into its takeover step
    got += ticks(session, fixture, 0, range(takeover, takeover + 1), wait=False)
    got += ticks(session, fixture, 0, range(takeover + 1, 30))
    late = [i for i, r in enumerate(got) if r.fault == StepFault.LATE]
    assert late == [takeover], late
    assert got[takeover].source == ActionSource.ZERO and not got[takeover].values.any()
    assert session.parts.loop.counters.late_refills == 1 and session.parts.loop.counters.deadline_misses == 1
    assert "had not finished in time" in session.parts.loop.counters.last_fault
    others = [i for i in range(30) if i != takeover]
    assert [got[i].values.tobytes() for i in others] == [expected[i].values.tobytes() for i in others]
    assert session.parts.runtime.mode.schedule.delay == 2              # the delay never changes


# -- what is refused ---------------------------------------------------------------------------------

def test_a_schedule_that_cannot_work_is_refused_at_configure_with_the_numbers(fixtures, tmp_path):
    fixture = fixtures["act_queue"]                               # chunk 10, n_action_steps 5
    with pytest.raises(ConfigError, match=r"inference_delay_steps = 10: a chunk of 10 actions has none left .* "
                                          r"the delay must be below 10, at most 5") as refused:
        prepare_serving(config(fixture, "async", "10"))
    assert not re.search(r"-\d", str(refused.value))                    # no negative horizon or row counts
    with pytest.raises(ConfigError, match=r"inference_delay_steps = 6 and execution horizon 5: a chunk of 10 "
                                          r"actions has too few left"):
        prepare_serving(config(fixture, "async", "6", execution_horizon=5))
    with pytest.raises(ConfigError, match=r"execution horizon 2 < inference_delay_steps 4: .* raise "
                                          r"control.execution_horizon to at least 4"):
        prepare_serving(config(fixture, "async", "4", execution_horizon=2))
    with pytest.raises(ConfigError, match=r"control.execution_horizon = 11: must be in \[1, 10\]"):
        prepare_serving(config(fixture, "sync", execution_horizon=11))
    with pytest.raises(ConfigError, match=r"inference_delay_steps.*must match"):
        config(fixture, "async", "soon")


def test_capsules_of_another_schedule_or_with_a_forged_cursor_are_refused_and_change_nothing(fixtures, tmp_path):
    fixture = fixtures["act_queue"]
    params = fixture.serving_params()
    params["capsules"]["directory"] = str(tmp_path / "caps")
    params["control"].update(chunking="async", inference_delay_steps="3", deadline_ms=0.0)
    session = build_session(ServingConfig.from_params(params))
    ticks(session, fixture, 0, range(7))
    capsule = session.verbs.commit(label="c", persist=True)
    params["control"]["inference_delay_steps"] = "2"
    other = build_session(ServingConfig.from_params(params))
    ticks(other, fixture, 0, range(4))
    live = other.parts.runtime.arena.storage.clone()
    with pytest.raises(FingerprintMismatch, match=r"made under control.chunking async with inference delay 3 .* "
                                                  r"this runtime runs async with delay 2"):
        other.verbs.reenter(capsule.id)
    assert torch.equal(other.parts.runtime.arena.storage, live)
    # a forged header: a cursor the bytes do not hold
    directory = CapsuleDirectory(tmp_path / "caps", max_file_bytes=1 << 30)
    header = directory.header(capsule.id)
    assert header.mark == capsule.mark
    forged = dataclasses.replace(mark_of(capsule), cursor=mark_of(capsule).cursor + 1).to_mode_mark()
    with session.parts.store.lend(capsule.id) as loan:
        mark_data = loan.host_bytes().clone()
    with pytest.raises(CorruptCapsule, match=r"chunk cursor \d+ / pending \d disagree with its metadata"):
        session.parts.runtime.admit(forged, lambda: mark_data, capsule.id)
    with pytest.raises(CorruptCapsule, match=r"cannot occur under this schedule"):
        session.parts.runtime.admit(ChunkingMark("async", 3, 5, 99, mark_of(capsule).pending).to_mode_mark(),
                              lambda: _with_cursor(session.parts.runtime, mark_data, 99), "x")


def _with_cursor(runtime: PolicyRuntime, data: torch.Tensor, cursor: int) -> torch.Tensor:
    out = data.clone()
    slot = runtime.layout["chunk.cursor"]
    out[slot.offset:slot.end].view(torch.int64)[0] = cursor
    return out


def test_the_auto_delay_is_measured_once_and_recorded(fixtures):
    fixture = fixtures["diffusion"]
    session = build_session(config(fixture, "async", "auto", rate_hz=5.0))      # room for a slow machine
    schedule = session.parts.runtime.mode.schedule
    p99 = max(session.parts.runtime.mode.setup.refill_seconds)
    assert len(session.parts.runtime.mode.setup.refill_seconds) == ChunkingSettings().auto_runs
    assert schedule.delay >= 1 and schedule.delay >= p99 * 5.0          # at least the refill's time in steps
    assert session.loop.control.inference_delay_steps == str(schedule.delay)   # what bags and capsules record
    ticks(session, fixture, 0, range(3))
    assert mark_of(session.verbs.commit()).delay == schedule.delay


def test_an_auto_delay_the_chunk_cannot_take_is_refused_with_the_measurement(fixtures):
    fixture = fixtures["diffusion"]                       # 15 rows: d + e <= 15 and e >= d, so d <= 7
    with pytest.raises(ConfigError, match=r"inference_delay_steps auto measured a refill of [\d.]+ ms \(p99 of 5\) "
                                          r"at control.rate_hz 10000: \d+ steps with its margin; .*none left"):
        build_session(config(fixture, "async", "auto", rate_hz=10000.0))


def test_chunk_schedule_numbers():
    from capsule_ros.runtime.policy import ChunkCadence
    cadence = ChunkCadence(length=100, horizon=100, reads=("x",))
    assert ChunkSchedule.resolve(cadence, "sync", 0).end == 100
    s = ChunkSchedule.resolve(cadence, "async", 6)
    assert (s.delay, s.execution_horizon, s.end) == (6, 94, 100)        # ACT 100/100: 94 rows per chunk
    assert "rows 6..99" in s.describe()
    with pytest.raises(ValueError, match="horizon 0 must be in"):
        ChunkCadence(length=4, horizon=0, reads=("x",))


# -- CUDA: the programs as graphs, the refill on its own stream ------------------------------------

def cuda_runtime(fixture: Fixture, chunking: str, delay: int, graphs: bool, worker: str = "auto") -> PolicyRuntime:
    cfg = config(fixture, chunking, str(delay) if delay else "auto")
    runtime_cfg = dataclasses.replace(cfg.runtime, device="cuda", cuda_graphs=graphs)
    return build_runtime(dataclasses.replace(cfg, runtime=runtime_cfg), worker=worker)


@pytest.mark.cuda
@pytest.mark.parametrize("name", CHUNKING)
@pytest.mark.parametrize("chunking, delay", [("sync", 0), ("async", 3)])
def test_cuda_graph_programs_equal_their_eager_plan_and_stay_close_to_lerobot(name, chunking, delay, fixtures):
    """Every program of the schedule captured as a CUDA graph (async: the refill captured on
    its own stream) gives the eager CUDA plan's actions bit for bit, and LeRobot's CPU actions
    within the CUDA tolerance of test_lerobot_parity (other kernels, TF32 convolutions)."""
    from capsule_ros.chunking.workers import StreamRefill
    fixture = fixtures[name]
    graphed = cuda_runtime(fixture, chunking, delay, graphs=True)
    eager = cuda_runtime(fixture, chunking, delay, graphs=False, worker="inline")
    assert graphed.graphs.captured and set(graphed.graphs._graphs) == set(graphed.graphs.programs)
    if chunking == "async":
        assert isinstance(graphed.mode.worker, StreamRefill) and graphed.mode.worker._plan_graph is not None
    got = {key: np.stack(list(_stepped(runtime, fixture, 0, 40))) for key, runtime in (("graph", graphed),
                                                                                         ("eager", eager))}
    assert got["graph"].tobytes() == got["eager"].tobytes()
    references = load_npz(reference_path(name, "async.npz"))
    reference = fixture.outputs["action"] if chunking == "sync" else references.get(f"action_d{delay}")
    if reference is not None:                              # LeRobot's own loop, on the CPU
        assert float(np.abs(got["graph"] - reference[0, :40]).max()) < 1e-2


@pytest.mark.cuda
def test_cuda_refill_stream_runs_below_the_step_streams_priority(fixtures):
    """A plan in flight (its stream) yields the GPU's free SMs to the consume steps that run
    meanwhile (the step's stream): CUDA's lower number is the higher priority."""
    runtime = cuda_runtime(fixtures["diffusion"], "async", 3, graphs=True)
    worker = runtime.mode.worker
    assert runtime.stream is not None and worker is not None and worker.stream is not None
    assert worker.stream.priority > runtime.stream.priority, (worker.stream.priority, runtime.stream.priority)
    runtime.close()


def _stepped(runtime: PolicyRuntime, fixture: Fixture, episode: int, steps: int):
    runtime.reset(episode=episode, seed=fixture.seed(episode))
    for t in range(steps):
        stage(runtime, fixture, episode, t)
        runtime.load_inputs()
        runtime.step()
        yield runtime.read_outputs().action


@pytest.mark.cuda
@pytest.mark.parametrize("chunking, delay", [("sync", "auto"), ("async", "3")])
def test_cuda_capsules_at_every_row_restore_byte_exactly_and_replay_bit_identically(fixtures, chunking, delay):
    fixture = fixtures["diffusion"]
    params = fixture.serving_params()
    params["control"].update(chunking=chunking, inference_delay_steps=delay, deadline_ms=0.0)
    params["runtime"]["device"] = "cuda"
    session = build_session(ServingConfig.from_params(params))
    assert session.parts.runtime.graphs.captured
    end = session.parts.runtime.mode.schedule.end
    original = ticks(session, fixture, 0, range(3 * end))
    for k in range(end, 2 * end + 1):
        session.verbs.reset()
        ticks(session, fixture, 0, range(k))
        capsule = session.verbs.commit(label=f"row {k}")
        snapshot = session.parts.runtime.arena.storage.clone()
        ticks(session, fixture, 0, range(k, k + 2))
        session.verbs.reenter(capsule.id)
        torch.cuda.synchronize()
        assert torch.equal(session.parts.runtime.arena.storage, snapshot), k
        assert values(ticks(session, fixture, 0, range(k, 3 * end))) == values(original[k:]), k
        session.verbs.drop(capsule.id)
