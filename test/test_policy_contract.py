"""The StatefulPolicy contract, checked at start-up where it can be:

- a policy that keeps state outside its declared buffers (a Python counter, a tensor
  attribute it updates in place) is refused with a ConfigError naming the policy and the
  buffers whose values did not repeat from a snapshot (``runtime.state_check``); a policy
  that keeps the contract passes and its arena keeps its initial bytes; with the check
  off such a policy is served (the documented opt-out);
- on a GPU, a step that cannot be captured as a CUDA graph (``.item()``) fails start-up
  with a PolicyStepError saying how to fix it, and ``runtime.graph_fallback: eager``
  serves it eagerly with a warning.
"""
from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from runtime_fixtures import arena_bytes, default_config, gru_config, logged, make_policy

from capsule_ros.chunking.mode import mode_for
from capsule_ros.chunking.reference import chunked_step
from capsule_ros.chunking.schedule import ChunkingSettings
from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import build_policy_runtime, replica_of, runtime_identity
from capsule_ros.runtime.contract import PolicyStateError
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.runtime.graphs import PolicyStepError
from capsule_ros.runtime.policy import ACTION, STEP, ChunkCadence, StatefulPolicy, chunk_specs, standard_specs
from capsule_ros.serving.factory import build_policy
from capsule_ros.serving.records import ActionSource

torch.set_num_threads(1)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class _Scaler(StatefulPolicy):
    """action = x * gain: keeps the contract (its only state is the standard buffers)."""

    action_dim, chunk_horizon = 2, 1

    def state_spec(self):
        return [BufferSpec("x", (2,), torch.float32, BufferKind.INPUT), *standard_specs(2, 1)]

    def init_state(self, state, *, episode, seed):
        for name, view in state.items():
            if name != "x":
                view.zero_()

    def gain(self, state) -> torch.Tensor:
        return torch.ones((), device=state["x"].device)

    def step(self, state):
        state[ACTION].copy_(state["x"] * self.gain(state))
        state[STEP].add_(1)

    def architecture(self):
        return {"policy": type(self).__name__.strip("_").lower()}


class _CountsCalls:
    """Counts the calls of ``gain`` in a Python attribute: a restored capsule cannot bring it back."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def gain(self, state):
        self.calls += 1
        return torch.full((), float(self.calls), device=state["x"].device)


class _PythonCounter(_CountsCalls, _Scaler):
    """Its step counts its runs in a Python attribute."""


class _HiddenTensor(_Scaler):
    """Counts its steps in a tensor attribute it updates in place: capturable, and a CUDA
    graph replays the update, but it is outside the arena."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def gain(self, state):
        self.calls.add_(1)
        return self.calls


class _Item(_Scaler):
    """Reads a value back to the host in its step: runs eagerly, cannot be captured."""

    def gain(self, state):
        return torch.full((), 1.0 + float(state["x"].abs().max().item()), device=state["x"].device)


class _Chunker(StatefulPolicy):
    """A chunking policy that keeps the contract: plan writes x * (1, 2, 3, 4) * gain as a
    chunk of 4 rows, 2 executed per chunk; observe reads nothing."""

    action_dim, chunk_horizon = 2, 1

    def cadence(self):
        return ChunkCadence(length=4, horizon=2, reads=("x",))

    def state_spec(self):
        x = BufferSpec("x", (2,), torch.float32, BufferKind.INPUT)
        return [x, *standard_specs(2, 1), *chunk_specs(4, 2, [x])]

    def init_state(self, state, *, episode, seed):
        for name, view in state.items():
            if name != "x":
                view.zero_()

    def gain(self, state) -> torch.Tensor:
        return torch.ones((), device=state["x"].device)

    def plan(self, state, chunk):
        rows = torch.arange(1, 5, dtype=torch.float32, device=chunk.device)[:, None]
        chunk.copy_(state["x"][None, :] * rows * self.gain(state))

    def emit(self, state, action, upcoming):
        state[ACTION].copy_(action)
        state[STEP].add_(1)

    def step(self, state):
        chunked_step(self, state, 2)

    def architecture(self):
        return {"policy": type(self).__name__.strip("_").lower()}


class _ChunkerCounter(_CountsCalls, _Chunker):
    """Its network counts its runs in a Python attribute."""


CHUNK_SCHEDULES = {"sync": ChunkingSettings("sync"), "async": ChunkingSettings("async", delay=1, execution_horizon=2)}


def runtime_of(policy: StatefulPolicy, config: RuntimeConfig,
               settings: ChunkingSettings = ChunkingSettings()) -> PolicyRuntime:  # noqa: B008 - frozen
    """The policy's runtime in its mode (chunking under ``settings`` for a policy with a cadence)."""
    return build_policy_runtime(policy, config, mode=mode_for(policy, settings, device=config.resolve_device()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", sorted(CHUNK_SCHEDULES))
def test_the_check_runs_every_program_of_a_chunk_schedule(device, mode):
    """The repeated steps cover the schedule's every program: async mode includes an
    episode's first (synchronous) refill, not only the refill worker's plans."""
    from capsule_ros.runtime.contract import check_state_contract
    runtime = runtime_of(_Chunker(), RuntimeConfig(device=device), CHUNK_SCHEDULES[mode])
    before = arena_bytes(runtime)
    programs = check_state_contract(runtime)
    if mode == "sync":
        assert programs == ["consume", "refill"]
    else:                        # d = 1, e = 2: refill, consume, request at row 2, adopt at row 3 = end
        assert programs == ["refill", "consume", "request", "adopt"]
    assert arena_bytes(runtime) == before


class _PlanCounter(_Chunker):
    """``_Chunker`` counting its plans from outside the state (only this test reads it)."""

    def __init__(self):
        super().__init__()
        self.plans = 0

    def plan(self, state, chunk):
        self.plans += 1
        super().plan(state, chunk)


def test_on_a_cpu_the_state_check_is_the_programs_first_run():
    """Start-up runs the planning network where it must: with the state check, only the
    check's steps (the refill repeated twice; the step before its snapshot consumes);
    without it, one run per program to check they run at all. It once ran both, and the
    step before the snapshot planned too (a second or more of a camera policy's CPU
    start-up per plan)."""
    checked, unchecked = _PlanCounter(), _PlanCounter()
    runtime_of(checked, RuntimeConfig(device="cpu"), CHUNK_SCHEDULES["sync"])
    runtime_of(unchecked, RuntimeConfig(device="cpu", state_check=False), CHUNK_SCHEDULES["sync"])
    assert (checked.plans, unchecked.plans) == (2, 1)


def test_a_step_failing_in_the_state_check_is_reported_as_at_preparation():
    """Where the check is a program's first run, a step that cannot run on the configured
    inputs is the same PolicyStepError as without the check, naming the inputs."""
    for state_check in (True, False):
        with pytest.raises(PolicyStepError, match=r"the policy's step.* fails on the configured inputs \(x float32"
                                                  r"\[2\]\).*RuntimeError: broken"):
            runtime_of(_Broken(), RuntimeConfig(device="cpu", state_check=state_check), CHUNK_SCHEDULES["sync"])


class _Broken(_Chunker):
    def plan(self, state, chunk):
        raise RuntimeError("broken")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", sorted(CHUNK_SCHEDULES))
def test_a_chunking_policy_with_state_outside_its_buffers_is_refused(device, mode):
    """A Python counter in the network: the repeated refill (sync) or the repeated request
    and its adopted chunk (async, planned by the refill worker) write other actions."""
    with pytest.raises(PolicyStateError, match=r"policy chunkercounter keeps state outside its declared buffers: "
                                               r".*\['action'\] after repeated step"):
        runtime_of(_ChunkerCounter(), RuntimeConfig(device=device), CHUNK_SCHEDULES[mode])
    runtime_of(_ChunkerCounter(), RuntimeConfig(device=device, state_check=False),
               CHUNK_SCHEDULES[mode])          # the documented opt-out serves it


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy, hidden", [(_PythonCounter, "a Python counter"), (_HiddenTensor, "a tensor")])
def test_state_outside_the_declared_buffers_is_refused_at_start_naming_it(device, policy, hidden):
    with pytest.raises(PolicyStateError) as refused:
        build_policy_runtime(policy(), RuntimeConfig(device=device))
    message = str(refused.value)
    assert isinstance(refused.value, ConfigError), "the node must exit 2 with one line"
    assert message.startswith(f"policy {policy.__name__.strip('_').lower()} keeps state outside its declared "
                              "buffers"), message
    assert "['action'] after repeated step 1" in message and "runtime.state_check: false" in message, message


def test_the_check_runs_when_start_up_brings_its_fingerprint():
    """The node's activate builds the runtime with the fingerprint computed at configure;
    only a replica (whose policy passed with the original) skips the check."""
    with pytest.raises(PolicyStateError):
        build_policy_runtime(_PythonCounter(), RuntimeConfig(),
                             identity=dataclasses.replace(runtime_identity(_PythonCounter(), RuntimeConfig()),
                                                          fingerprint="f" * 64))
    original = build_policy_runtime(_Scaler(), RuntimeConfig())
    assert replica_of(original).fingerprint == original.fingerprint


def test_policies_that_keep_the_contract_pass_and_keep_their_initial_arena(tmp_path):
    for config in (default_config(tmp_path / "default"), gru_config(tmp_path / "gru")):
        checked = runtime_of(build_policy(config), config.runtime)
        unchecked = runtime_of(build_policy(config), dataclasses.replace(config.runtime, state_check=False))
        assert arena_bytes(checked) == arena_bytes(unchecked)
    scaler = build_policy_runtime(_Scaler(), RuntimeConfig())
    assert scaler.read_outputs().step == 0


def test_with_the_check_off_such_a_policy_is_served():
    runtime = build_policy_runtime(_PythonCounter(), RuntimeConfig(state_check=False))
    runtime.staging["x"][:] = [1.0, 2.0]
    runtime.load_inputs()
    runtime.step()
    assert runtime.read_outputs().action.tolist() == [1.0 * runtime.policy.calls, 2.0 * runtime.policy.calls]


def test_the_check_costs_a_few_steps_of_the_reference_policy():
    """Five steps and three arena copies: measured against the step itself."""
    import time
    policy = make_policy()
    runtime = build_policy_runtime(policy, RuntimeConfig(state_check=False))
    start = time.perf_counter()
    for _ in range(20):
        runtime.step()
    step = (time.perf_counter() - start) / 20
    from capsule_ros.runtime.contract import check_state_contract
    costs = []
    for _ in range(3):                      # the best of three: a busy shared CPU stalls single runs
        start = time.perf_counter()
        check_state_contract(runtime)
        costs.append(time.perf_counter() - start)
    cost = min(costs)
    print(f"\nstate check {cost * 1e3:.1f} ms = {cost / step:.1f} steps of {step * 1e3:.2f} ms")
    assert cost < 20 * step, f"the check took {cost / step:.1f} steps"


# -- steps that cannot be captured -------------------------------------------------------------

@pytest.mark.cuda
def test_a_step_that_cannot_be_captured_fails_start_up_saying_how_to_go_on():
    with pytest.raises(PolicyStepError, match=r"cannot be captured as a CUDA graph .*"
                                              r"runtime.graph_fallback: eager") as refused:
        build_policy_runtime(_Item(), RuntimeConfig(device="cuda"))
    assert ".item()" in str(refused.value)
    assert build_policy_runtime(_Item(), RuntimeConfig(device="cuda", cuda_graphs=False)).graphs.captured is False


@pytest.mark.cuda
def test_graph_fallback_eager_serves_it_without_a_graph_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="capsule_ros.runtime.graphs"):
        runtime = build_policy_runtime(_Item(), RuntimeConfig(device="cuda", graph_fallback="eager"))
    assert not runtime.graphs.captured
    assert any("runtime.graph_fallback is eager" in r.getMessage() for r in caplog.records), caplog.text
    x = np.array([0.5, -2.0], np.float32)
    runtime.staging["x"][:] = x
    runtime.load_inputs()
    runtime.step()
    assert runtime.read_outputs().action.tolist() == (x * np.float32(3.0)).tolist()


# -- the state check beside serving (runtime.state_check_timing) ------------------------------------------------

def _stamped(stamp_s: int, **fields) -> SimpleNamespace:
    """A message-like object with a header (port adapters read attributes of any object)."""
    return SimpleNamespace(header=SimpleNamespace(stamp=SimpleNamespace(sec=stamp_s, nanosec=0)), **fields)


def _gru_prepared(tmp_path, timing: str):
    from runtime_fixtures import gru_config

    from capsule_ros.serving.factory import prepare_serving
    config = gru_config(tmp_path)
    return prepare_serving(dataclasses.replace(config, runtime=dataclasses.replace(config.runtime,
                                                                                   state_check_timing=timing)))


@pytest.mark.parametrize("timing", ["auto", "while_serving", "before_serving"])
def test_the_state_check_beside_serving_leaves_the_live_policy_unplanned_and_restores_wait_for_it(tmp_path, timing):
    """policy_node's start (``check_beside``): on a CPU a chunking policy's check runs on a copy of
    the policy while serving starts (``auto`` and ``while_serving``): the live runtime plans no
    chunk at start-up (the check plans twice, and before serving so does the live one). A restore
    waits for the verdict and is exact."""
    from capsule_ros.serving.factory import checks_state_while_serving, start_session
    prepared = _gru_prepared(tmp_path, timing)
    beside = timing != "before_serving"
    assert checks_state_while_serving(prepared.config, prepared.policy) == beside
    session = start_session(prepared, check_beside=True)
    try:
        runtime = session.parts.runtime
        assert runtime.mode.counters.refills == (0 if beside else 2)
        capsule = session.verbs.commit("home")
        before = arena_bytes(runtime)
        session.verbs.reenter(capsule.id)
        assert arena_bytes(runtime) == before
    finally:
        session.release()


def test_a_failed_state_check_beside_serving_refuses_restores_and_the_policy_keeps_acting(tmp_path):
    """A chunking policy that counts its plans in a Python attribute, started with the check
    beside serving: activation succeeds, the failure is logged, every restore (reset or
    re-enter from a capsule) is refused with WRONG_STATE naming the check, the live state is
    untouched, and commits and a plain reset still work."""
    from capsule_ros.errors import WrongState
    from capsule_ros.serving.factory import start_session
    prepared = _gru_prepared(tmp_path, "while_serving")
    policy = prepared.policy

    class _CountingPlans(type(policy)):        # type: ignore[misc]
        def plan(self, state, chunk):
            super().plan(state, chunk)
            self.plans_run = getattr(self, "plans_run", 0) + 1
            chunk.add_(float(self.plans_run))

    policy.__class__ = _CountingPlans
    with logged("capsule_ros.serving.statecheck", logging.ERROR) as errors:
        session = start_session(prepared, check_beside=True)
        try:
            capsule = session.verbs.commit("home")
            live = arena_bytes(session.parts.runtime)
            for restore in (lambda: session.verbs.reenter(capsule.id), lambda: session.verbs.reset(capsule.id)):
                with pytest.raises(WrongState, match=r"capsule restores are refused: the start-up state check failed "
                                                     r"\(PolicyStateError: policy .* keeps state outside"):
                    restore()
                assert arena_bytes(session.parts.runtime) == live
            assert any("state check failed, beside serving: policy gru_chunk keeps state outside" in r.getMessage()
                       for r in errors), [r.getMessage() for r in errors]
            session.verbs.commit("still")
            assert session.verbs.reset().episode_id == 2
            for stamp in range(1, 4):                      # it acts: the policy's own actions, not safe ones
                session.loop.feed("goal", _stamped(stamp, point=SimpleNamespace(x=0.3, y=0.4, z=0.0)))
                fed = session.loop.feed("joints", _stamped(stamp, name=[], position=[0.1, 0.2], velocity=[0.0, 0.0]))
                assert fed.record is not None and fed.record.source == ActionSource.POLICY
        finally:
            session.release()


def test_closing_a_session_stops_its_state_check_beside_serving_before_the_next_step(tmp_path, monkeypatch):
    """A node's Ctrl-C must not wait for the rest of a check running beside serving (seconds of
    plans for a camera policy on a CPU): the session's release stops it after the step in
    progress. The check's copy of the policy blocks in its first plan until the release has
    asked the check to stop and waits for it; after that plan the check runs no further step,
    and no check thread is left."""
    import threading

    from capsule_ros.serving.factory import start_session
    from capsule_ros.serving.statecheck import StateCheckBeside
    prepared = _gru_prepared(tmp_path, "while_serving")
    policy = prepared.policy
    checking = "capsule-state-check"

    class _GatedPlans(type(policy)):           # type: ignore[misc]
        entered = threading.Event()             # class attributes: the check's deep copy shares them
        go = threading.Event()
        check_plans: list = []

        def plan(self, state, chunk):
            if threading.current_thread().name == checking:
                self.check_plans.append(1)
                self.entered.set()
                assert self.go.wait(60), "the test never let the check's plan go on"
            super().plan(state, chunk)

    policy.__class__ = _GatedPlans
    original_close = StateCheckBeside.close

    def close(self):                            # the plan goes on once close has set the stop and waits
        join = self._thread.join

        def go_then_join(*args):
            _GatedPlans.go.set()
            join(*args)
        self._thread.join = go_then_join
        original_close(self)

    monkeypatch.setattr(StateCheckBeside, "close", close)
    session = start_session(prepared, check_beside=True)
    assert _GatedPlans.entered.wait(60)        # the check is in its first plan
    session.release()
    assert _GatedPlans.check_plans == [1]       # a full check plans twice (test above)
    assert not [t for t in threading.enumerate() if t.name == checking]


def test_a_runtime_the_state_check_refuses_leaves_no_thread_running():
    """The refill worker of an async chunking policy (a thread on a CPU) is closed with the runtime
    the check refused: a node whose check ran beside serving keeps serving, and must not keep a
    second policy's worker alive."""
    import threading
    before = set(threading.enumerate())
    with pytest.raises(PolicyStateError) as refused:      # the error (and what it references) stays alive
        runtime_of(_ChunkerCounter(), RuntimeConfig(device="cpu"), CHUNK_SCHEDULES["async"])
    assert "keeps state outside" in str(refused.value)
    assert [t.name for t in set(threading.enumerate()) - before] == []
