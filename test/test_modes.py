"""Execution modes (``capsule_ros.runtime.mode``) and the invariants they keep, on CPU:

- the runtime core starts no thread: an every-step runtime and a sync chunking runtime run
  without one; only an async chunking mode on a CPU has a thread (its refill worker's),
  which goes with the runtime;
- the live programs touch only what their runtime owns: with ``runtime.debug_checks`` a
  program that reads another object's tensor is refused at start-up naming it, and the
  async chunking mode, whose adopt reads the refill's chunk from the arena's scratch,
  passes and runs;
- a restore starts no work: the store copies the bytes and refuses a capsule the runtime
  does not admit; the pending refill of a restored capsule is re-issued only when its
  caller tells the runtime (``after_restore``), and the actions after it are the
  original's;
- the chunk schedule, an ``auto`` delay included, is settled before the runtime is built,
  and what the session records is that schedule's;
- a plan may read the chunk it replaces (real-time chunking's extension point).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import List, Set

import numpy as np
import pytest
import torch
from runtime_fixtures import gru_config, make_policy, observations, run

from capsule_ros.capsules.store import CapsuleStore
from capsule_ros.chunking.mark import ChunkingMark
from capsule_ros.chunking.mode import Chunking, ChunkingMode, mode_for
from capsule_ros.chunking.reference import chunked_step
from capsule_ros.chunking.schedule import ChunkingSettings
from capsule_ros.errors import CorruptCapsule
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.runtime.graphs import GraphAddressError
from capsule_ros.runtime.mode import STEP_PROGRAM, ExecutionMode, ModeContext
from capsule_ros.runtime.policy import (
    ACTION,
    CHUNK_ACTIONS,
    CHUNK_CURSOR,
    STEP,
    ChunkCadence,
    StatefulPolicy,
    chunk_specs,
    standard_specs,
)
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_runtime, prepare_serving, settle_mode, start_session

torch.set_num_threads(1)


def gru(tmp_path: Path, chunking: str = "sync", delay: str = "auto", **runtime) -> ServingConfig:
    config = gru_config(tmp_path)
    control = dataclasses.replace(config.control, chunking=chunking, inference_delay_steps=delay)
    return dataclasses.replace(config, control=control,
                               runtime=dataclasses.replace(config.runtime, **runtime))


def step_all(runtime: PolicyRuntime, obs: np.ndarray) -> List[bytes]:
    out = []
    for row in obs:
        runtime.staging["joints"][:] = row[:4]
        runtime.staging["goal"][:] = row[4:]
        runtime.load_inputs()
        runtime.step()
        o = runtime.read_outputs()
        out.append(o.action.tobytes() + o.chunk.tobytes())
    return out


def threads() -> Set[threading.Thread]:
    return set(threading.enumerate())


# -- the core owns no thread ---------------------------------------------------------------------------

def test_the_core_starts_no_thread_only_an_async_chunking_mode_has_one(tmp_path):
    before = threads()
    every_step = build_policy_runtime(make_policy(), RuntimeConfig())
    sync = build_runtime(gru(tmp_path))
    assert isinstance(sync.mode, ChunkingMode) and sync.mode.worker is None
    run(every_step, observations(12, 1))
    step_all(sync, observations(20, 1))                    # two refills and their consume steps
    assert threads() == before, "a runtime without an async mode started a thread"
    async_ = build_runtime(gru(tmp_path, "async", "2"))
    step_all(async_, observations(20, 1))                   # requests went to the refill worker's thread
    started = threads() - before
    assert started and all(t.name.startswith("capsule-refill") for t in started), started
    async_.close()
    assert not any(t.is_alive() for t in started), "the mode's thread outlived its runtime"


# -- the live programs touch only what their runtime owns ------------------------------------------------

class _ReadsElsewhereMode(ExecutionMode):
    def programs(self):
        views, elsewhere = self.context.arena.views, self.setup.elsewhere
        return {STEP_PROGRAM: lambda: views[ACTION].copy_(elsewhere)}


@dataclasses.dataclass(frozen=True, eq=False)
class _ReadsElsewhere:
    """A mode whose program reads a tensor of another object (as the adopt program once
    read the refill worker's own buffer)."""

    elsewhere: torch.Tensor

    def scratch(self, policy: StatefulPolicy) -> List[BufferSpec]:
        return []

    def bind(self, context: ModeContext) -> ExecutionMode:
        return _ReadsElsewhereMode(self, context)

    def for_replica(self) -> _ReadsElsewhere:
        return self


def test_a_live_program_that_reads_a_foreign_tensor_is_refused_with_debug_checks():
    policy = make_policy()
    foreign = _ReadsElsewhere(torch.full((policy.action_dim,), 3.0))
    with pytest.raises(GraphAddressError, match=r"program 'step' touches memory its runtime does not own: "
                                                r"aten.copy_.default on a float32\[\d+\] tensor"):
        build_policy_runtime(policy, RuntimeConfig(debug_checks=True, state_check=False), mode=foreign)
    # without the debug checks nothing looks (the check costs one more run of each program)
    runtime = build_policy_runtime(make_policy(), RuntimeConfig(state_check=False), mode=foreign)
    runtime.step()
    assert runtime.read_outputs().action.tolist() == [3.0] * policy.action_dim


def test_the_async_chunking_modes_programs_read_only_their_arena(tmp_path):
    """The adopt program reads the refill's chunk from the arena's scratch buffer, which
    the replay-time address check covers too; the runtime steps through takeovers."""
    runtime = build_runtime(gru(tmp_path, "async", "2", debug_checks=True))
    assert {"arena chunk.fresh", "arena chunk.rows"} <= set(runtime.graphs.addresses())
    reference = build_runtime(gru(tmp_path, "async", "2"))
    obs = observations(30, 2)
    assert step_all(runtime, obs) == step_all(reference, obs)
    assert runtime.mode.counters.refills >= 3
    runtime.arena.scratch_views["chunk.fresh"] = runtime.arena.scratch_views["chunk.fresh"].clone()   # moved
    with pytest.raises(GraphAddressError, match=r"buffers moved since capture: \['arena chunk.fresh'\]"):
        runtime.step()


# -- a restore starts no work ------------------------------------------------------------------------------

def test_a_restore_starts_no_work_the_runtime_reissues_the_refill_when_told(tmp_path):
    runtime = build_runtime(gru(tmp_path, "async", "2"))
    assert isinstance(runtime.mode, ChunkingMode)
    schedule = runtime.mode.schedule
    store = CapsuleStore(runtime.layout.nbytes, runtime.fingerprint, runtime.device)
    obs = observations(3 * schedule.end, 3)
    in_flight = schedule.execution_horizon + 1              # a request is out
    step_all(runtime, obs[:in_flight])
    assert runtime.mode.pending
    capsule = store.snapshot(runtime, episode_id=1, step=in_flight)
    expected = step_all(runtime, obs[in_flight:])
    mirror, carried = (runtime.mode.cursor, runtime.mode.pending), ChunkingMark.parse(capsule.mark)
    assert mirror != (carried.cursor, carried.pending)
    submitted: List[int] = []
    worker = runtime.mode.worker
    submit = worker.submit
    worker.submit = lambda *a, **kw: (submitted.append(1), submit(*a, **kw))
    store.restore(capsule.id, runtime)
    assert submitted == [] and (runtime.mode.cursor, runtime.mode.pending) == mirror    # bytes only
    runtime.after_restore(capsule.mark)
    assert submitted == [1] and runtime.mode.pending                                    # now re-issued
    assert step_all(runtime, obs[in_flight:]) == expected


def test_a_capsule_the_runtime_does_not_admit_is_refused_before_the_copy(tmp_path):
    runtime = build_runtime(gru(tmp_path, "async", "2"))
    store = CapsuleStore(runtime.layout.nbytes, runtime.fingerprint, runtime.device)
    step_all(runtime, observations(5, 4))
    capsule = store.snapshot(runtime, episode_id=1, step=5)
    store.get(capsule.id).mark = None                       # a capsule that lost its mark
    live = runtime.arena.storage.clone()
    with pytest.raises(CorruptCapsule, match="carries no chunk schedule"):
        store.restore(capsule.id, runtime)
    assert torch.equal(runtime.arena.storage, live) and store.counters.restores == 0


# -- the schedule is settled before the runtime exists --------------------------------------------------------

def test_an_auto_delay_is_settled_before_the_runtime_is_built_and_passed_down(tmp_path):
    config = gru(tmp_path, "async", "auto")
    prepared = settle_mode(prepare_serving(config))
    assert isinstance(prepared.mode, Chunking) and prepared.mode.refill_seconds
    delay = prepared.mode.schedule.delay
    assert prepared.config.control.inference_delay_steps == str(delay)        # what bags and capsules record
    session = start_session(prepared)
    assert session.parts.runtime.mode.schedule == prepared.mode.schedule
    assert session.parts.loop.control.inference_delay_steps == str(delay)
    session.release()


def test_scratch_buffers_are_no_state(tmp_path):
    """The scratch is beside the state: capsules, the layout and the fingerprint do not
    cover it, and a policy's ``views`` do not include it."""
    runtime = build_runtime(gru(tmp_path, "async", "2"))
    assert set(runtime.arena.scratch_views) == {"chunk.rows", "chunk.fresh"}
    assert not set(runtime.arena.scratch_views) & set(runtime.arena.views)
    assert runtime.arena.storage.numel() == runtime.layout.nbytes
    assert not set(runtime.arena.scratch_views) & {slot.spec.name for slot in runtime.layout}
    sync = build_runtime(gru(tmp_path))
    assert sync.fingerprint == runtime.fingerprint          # the schedule is not part of the graph's identity


# -- the extension point for real-time chunking: a plan that reads the chunk it replaces ------------------

class _Continuer(StatefulPolicy):
    """A plan that continues the previous chunk (real-time chunking's leftover rows): it reads
    ``chunk.actions`` and ``chunk.cursor`` (named in ``reads``) and writes, for each row i,
    the previous chunk's row ``cursor + i`` (the last one held) plus the observation."""

    action_dim, chunk_horizon, length = 2, 2, 6

    def __init__(self, continues: bool = True):
        super().__init__()
        self.continues = continues

    def cadence(self) -> ChunkCadence:
        reads = ("x", CHUNK_ACTIONS, CHUNK_CURSOR) if self.continues else ("x",)
        return ChunkCadence(length=self.length, horizon=3, reads=reads)

    def state_spec(self) -> List[BufferSpec]:
        x = BufferSpec("x", (2,), torch.float32, BufferKind.INPUT)
        chunk = chunk_specs(self.length, 2, [])
        reads = [x, *chunk[:2]] if self.continues else [x]
        return [x, *standard_specs(2, self.chunk_horizon), *chunk_specs(self.length, 2, reads)]

    def init_state(self, state, *, episode, seed):
        for name, view in state.items():
            if name != "x":
                view.zero_()

    def plan(self, state, chunk):
        rows = torch.arange(self.length, device=chunk.device)
        if self.continues:          # read all of the old chunk before writing the new one (sync: the same buffer)
            rows_then = torch.clamp(state[CHUNK_CURSOR] + rows, max=self.length - 1)
            previous = state[CHUNK_ACTIONS].index_select(0, rows_then)
        else:
            previous = torch.zeros_like(chunk)
        chunk.copy_(previous + state["x"][None, :] * (1.0 + rows[:, None]))

    def emit(self, state, action, upcoming):
        state[ACTION].copy_(action)
        state["chunk"].copy_(upcoming)
        state[STEP].add_(1)

    def step(self, state):
        chunked_step(self, state, 3)

    def architecture(self):
        return {"policy": "continuer", "continues": self.continues}


def continued(policy: _Continuer, settings: ChunkingSettings, slow_plans: bool = False) -> bytes:
    runtime = build_policy_runtime(policy, RuntimeConfig(), mode=mode_for(policy, settings))
    if slow_plans:              # the live cursor moves on while the worker plans: it must plan from its copy
        plan = runtime.mode.worker.run_plan
        runtime.mode.worker.run_plan = lambda: (time.sleep(0.02), plan())
    out = []
    for x in np.random.default_rng(7).normal(size=(24, 2)).astype(np.float32):
        runtime.staging["x"][:] = x
        runtime.load_inputs()
        runtime.step()
        out.append(runtime.read_outputs().action.tobytes())
    runtime.close()
    return b"".join(out)


@pytest.mark.parametrize("timing", ["sync", "async"])
def test_a_plan_may_read_the_chunk_it_replaces(timing):
    """``reads`` may name ``chunk.actions`` and ``chunk.cursor``: an async request copies
    them with the rest, so the worker (on its own thread, slowed) plans from the request
    step's chunk and cursor exactly as an inline plan does; and the old chunk does change
    the actions (the plan really reads it)."""
    settings = ChunkingSettings(timing, delay=2 if timing == "async" else None, worker="inline")
    inline = continued(_Continuer(), settings)
    if timing == "async":
        assert continued(_Continuer(), dataclasses.replace(settings, worker="auto"), slow_plans=True) == inline
    assert continued(_Continuer(continues=False), settings) != inline


# -- on a GPU ----------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("timing", ["sync", "async"])
def test_cuda_chunking_programs_pass_the_debug_checks_and_a_moved_scratch_is_caught(timing):
    """With the debug checks on a GPU, every program of the chunking mode (the adopt's read
    of the refill's chunk from the scratch included) touches only what its runtime owns;
    the captured graphs give the eager programs' bits, the refill planned on its own stream;
    a scratch buffer that moved after capture is caught."""
    settings = ChunkingSettings(timing, delay=2 if timing == "async" else None)
    policy = _Continuer()
    graphed = build_policy_runtime(policy, RuntimeConfig(device="cuda", debug_checks=True),
                                   mode=mode_for(policy, settings, device=torch.device("cuda")))
    assert graphed.graphs.captured
    eager = build_policy_runtime(_Continuer(), RuntimeConfig(device="cuda", cuda_graphs=False),
                                 mode=mode_for(policy, dataclasses.replace(settings, worker="inline"),
                                               device=torch.device("cuda")))
    xs = np.random.default_rng(9).normal(size=(24, 2)).astype(np.float32)
    actions = []
    for runtime in (graphed, eager):
        out = []
        for x in xs:
            runtime.staging["x"][:] = x
            runtime.load_inputs()
            runtime.step()
            out.append(runtime.read_outputs().action.tobytes())
        actions.append(out)
    assert actions[0] == actions[1]
    graphed.arena.scratch_views["chunk.rows"] = graphed.arena.scratch_views["chunk.rows"].clone()
    with pytest.raises(GraphAddressError, match="chunk.rows"):
        graphed.step()
