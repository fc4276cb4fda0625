"""What reaches the actuators, and honest capsule bookkeeping, at the session level (no ROS):

- a step whose outputs are not finite, or that raises, hands out the safe action, is
  counted, and leaves the state exactly as before it (later steps equal a run that never
  had the bad step);
- a port shape the policy cannot take, or a step that cannot run at all, is refused at
  start with a message naming the input;
- HOLD on a deadline miss holds the last on-time policy action, never a late step's;
- a persisting commit changes the lineage and emits COMMIT at its boundary, whatever
  the steps that run while its file is written;
- a drop that answered success is never undone by a save that was still writing;
- the fingerprint covers what fills each input (a port's fields), not its topic;
- a directory where a capsule file should be is refused with a typed error, leaks no
  file descriptor, and re-entering such a capsule takes the recompute fallback;
- status never waits for a service and never reads the store while one changes it.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_fixtures import default_config, feed, observations

from capsule_ros.capsules import directory as directory_module
from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.errors import ConfigError, CorruptCapsule, FingerprintMismatch, InvalidArgument, NotFound
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import RuntimeConfig
from capsule_ros.runtime.graphs import PolicyStepError
from capsule_ros.runtime.policy import StatefulPolicy, standard_specs
from capsule_ros.serving.factory import build_runtime, build_session
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.records import ActionSource, EventKind, StepFault

torch.set_num_threads(1)


def state_bytes(session) -> bytes:
    """Everything a step writes (the arena minus its inputs)."""
    start, _ = session.parts.runtime.layout.byte_range(BufferKind.KV, BufferKind.RECURRENT, BufferKind.CONV,
                                                 BufferKind.CHUNK, BufferKind.META, BufferKind.OUTPUT)
    return session.parts.runtime.arena.storage[start:].numpy().tobytes()


def values(records) -> list:
    return [r.values.tobytes() for r in records]


# -- a bad step never reaches the actuators, and leaves the state as it was ----------------------

def test_nonfinite_outputs_publish_the_safe_action_count_and_leave_the_state_untouched(tmp_path):
    obs = observations(12, 1)
    reference = feed(build_session(default_config(tmp_path / "ref")), obs)
    session = build_session(default_config(tmp_path / "s"))
    before = feed(session, obs[:5])
    state, step = state_bytes(session), session.episode.step
    # inf in a buffer (a port would refuse it: this is the policy producing NaN on its own)
    session.loop.write_input("joints", np.array([np.inf, 0.0, 0.0, 0.0], np.float32))
    bad = session.loop.tick()
    assert bad.fault == StepFault.NONFINITE and bad.source == ActionSource.HOLD and bad.chunk is None
    assert bad.values.tobytes() == before[-1].values.tobytes() and np.isfinite(bad.values).all()
    assert session.parts.loop.counters.nonfinite_steps == 1 and session.parts.loop.counters.steps == 5
    assert state_bytes(session) == state and session.episode.step == step == bad.step
    after = feed(session, obs[5:])
    assert values(before + after) == values(reference), "the state was not put back as before the bad step"


def test_a_step_that_raises_publishes_the_safe_action_and_is_undone(tmp_path, monkeypatch):
    obs = observations(10, 2)
    reference = feed(build_session(default_config(tmp_path / "ref", deadline_action="zero")), obs)
    session = build_session(default_config(tmp_path / "s", deadline_action="zero"))
    before = feed(session, obs[:4])
    state = state_bytes(session)
    real_step = session.parts.runtime.graphs.step

    def half_then_raise(*args, **kwargs):
        real_step()                                   # the state is written ...
        raise RuntimeError("Kernel size can't be greater than actual input size")   # ... then it fails
    monkeypatch.setattr(session.parts.runtime.graphs, "step", half_then_raise)
    failed = feed(session, obs[4:5])[0]
    monkeypatch.setattr(session.parts.runtime.graphs, "step", real_step)
    assert failed.fault == StepFault.ERROR and failed.source == ActionSource.ZERO
    assert failed.values.tolist() == [0.0, 0.0] and failed.step == 4
    assert session.parts.loop.counters.step_errors == 1 and "Kernel size" in session.parts.loop.counters.last_fault
    assert state_bytes(session) == state
    after = feed(session, obs[4:])
    assert values(before + after) == values(reference)


def test_an_image_port_the_policy_cannot_take_is_refused_at_start_naming_the_port(tmp_path):
    camera = {"topic": "camera/image", "type": "sensor_msgs/msg/Image", "fields": ["data"], "shape": [2, 2, 3],
              "dtype": "uint8"}
    with pytest.raises(ConfigError, match=r"input 'camera' is 2x2 pixels"):
        build_runtime(default_config(tmp_path, ports={"camera": camera}))
    build_runtime(default_config(tmp_path, ports={"camera": {**camera, "shape": [16, 16, 3]}}))


class _NeedsEvenInputs(StatefulPolicy):
    """A policy whose step cannot take an odd-length input (reshape fails)."""

    action_dim, chunk_horizon = 2, 1

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def state_spec(self):
        return [BufferSpec("x", (self.width,), torch.float32, BufferKind.INPUT), *standard_specs(2, 1)]

    def init_state(self, state, *, episode, seed):
        for name, view in state.items():
            if name != "x":
                view.zero_()

    def step(self, state):
        pairs = state["x"].reshape(-1, 2)
        state["action"].copy_(pairs.sum(0))
        state["step"].add_(1)

    def architecture(self):
        return {"policy": "needs-even", "width": self.width}


def test_a_step_that_cannot_run_on_its_inputs_fails_start_up_naming_them():
    build_policy_runtime(_NeedsEvenInputs(4), RuntimeConfig(device="cpu"))
    with pytest.raises(PolicyStepError, match=r"fails on the configured inputs \(x float32\[3\]\).*shape '\[-1, 2\]'"):
        build_policy_runtime(_NeedsEvenInputs(3), RuntimeConfig(device="cpu"))


# -- deadline misses ---------------------------------------------------------------------------------------

def test_hold_on_a_deadline_miss_holds_the_last_on_time_action_never_a_late_one(tmp_path):
    obs = observations(12, 3)
    reference = feed(build_session(default_config(tmp_path / "ref")), obs)
    session = build_session(default_config(tmp_path / "s"))
    on_time = feed(session, obs[:4])
    late = feed(session, obs[4:9], late=True)
    assert all(r.fault == StepFault.LATE and r.source == ActionSource.HOLD and r.chunk is None for r in late)
    assert all(r.values.tobytes() == on_time[-1].values.tobytes() for r in late), \
        "HOLD published something other than the last on-time action"
    assert values(late) != values(reference[4:9])          # the late steps' own outputs were different
    assert [r.step for r in late] == [5, 6, 7, 8, 9]      # a late step keeps its state
    assert session.parts.loop.counters.deadline_misses == 5
    resumed = feed(session, obs[9:])
    assert values(resumed) == values(reference[9:])


def test_the_watchdog_publishes_the_last_on_time_action_while_a_step_overruns(tmp_path, monkeypatch):
    published = []
    session = build_session(default_config(tmp_path, deadline_ms=20.0),
                            options=SessionOptions(on_safe_action=published.append))
    try:
        on_time = feed(session, observations(3, 4))
        assert all(r.source == ActionSource.POLICY for r in on_time) and not published
        real_step = session.parts.runtime.graphs.step
        monkeypatch.setattr(session.parts.runtime.graphs, "step",
                            lambda *a, **kw: (time.sleep(0.1), real_step(*a, **kw)))
        late = feed(session, observations(2, 5))
    finally:
        session.close()
    assert len(published) == 2 and all(r.published and r.fault == StepFault.LATE for r in late)
    assert all(p.values.tobytes() == on_time[-1].values.tobytes() for p in published)
    assert all(r.values.tobytes() == on_time[-1].values.tobytes() for r in late)


# -- persisting commits while the robot steps ------------------------------------------------------------

def test_a_persisting_commit_changes_the_lineage_at_its_boundary_while_steps_run(tmp_path, monkeypatch):
    events = []
    session = build_session(default_config(tmp_path), options=SessionOptions(on_event=events.append))
    del events[:]                                     # the autostart's RESET
    real_write = directory_module.write_capsule

    def slow_write(*args, **kwargs):
        time.sleep(0.15)                              # a large capsule on a slow disk
        real_write(*args, **kwargs)
    monkeypatch.setattr(directory_module, "write_capsule", slow_write)
    feed(session, observations(3, 6))
    done = []
    committer = threading.Thread(target=lambda: done.append(session.verbs.commit("persisting", persist=True)))
    records = []
    committer.start()
    rows = iter(observations(1000, 7))
    while committer.is_alive() or len(records) < 5:
        records += feed(session, [next(rows)])
        time.sleep(0.002)
    committer.join()
    capsule = done[0]
    commit = next(e for e in events if e.kind == EventKind.COMMIT)
    save = next(e for e in events if e.kind == EventKind.SAVE)
    assert commit.step == save.step == capsule.step and capsule.path
    during = [r for r in records if capsule.step < r.step]
    assert len(during) >= 5, "no step ran while the capsule was being saved"
    assert all(r.lineage == capsule.id for r in during), "steps after the boundary carry another lineage"
    assert all(r.lineage != capsule.id for r in records if r.step <= capsule.step)
    assert events.index(commit) < events.index(save)


def _gated_writes(monkeypatch):
    """The next capsule write waits until released: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real_write = directory_module.write_capsule

    def gated(*args, **kwargs):
        entered.set()
        assert release.wait(10)
        real_write(*args, **kwargs)
    monkeypatch.setattr(directory_module, "write_capsule", gated)
    return entered, release


def test_a_drop_during_a_save_is_never_undone(tmp_path, monkeypatch):
    session = build_session(default_config(tmp_path))
    feed(session, observations(3, 8))
    capsule = session.verbs.commit("to drop")
    entered, release = _gated_writes(monkeypatch)
    outcome = []

    def save():
        try:
            outcome.append(session.verbs.save(capsule.id))
        except NotFound as exc:
            outcome.append(exc)
    saver = threading.Thread(target=save)
    saver.start()
    assert entered.wait(10)
    session.verbs.drop(capsule.id, from_disk=True)          # answers success while the save is writing
    release.set()
    saver.join()
    assert isinstance(outcome[0], NotFound) and "dropped while it was being saved" in str(outcome[0])
    path = session.parts.directory.path_of(capsule.id)
    assert not path.exists() and not list(path.parent.glob("*.part"))
    with pytest.raises(NotFound):
        session.verbs.reenter(capsule.id)
    assert capsule.id not in {c.id for c in session.verbs.list()}


def test_a_drop_after_a_save_removes_the_file(tmp_path):
    session = build_session(default_config(tmp_path))
    feed(session, observations(3, 9))
    capsule = session.verbs.commit("saved then dropped", persist=True)
    assert Path(capsule.path).is_file()
    session.verbs.drop(capsule.id, from_disk=True)
    assert not Path(capsule.path).exists()
    with pytest.raises(NotFound):
        session.verbs.reenter(capsule.id)


# -- the fingerprint covers the port-to-buffer mapping -------------------------------------------------

def test_reordering_a_ports_fields_changes_the_fingerprint_and_refuses_old_capsules(tmp_path):
    config = default_config(tmp_path)
    swapped = default_config(tmp_path, ports={"joints": {"fields": ["velocity", "position"]}})
    moved = default_config(tmp_path, ports={"joints": {"topic": "robot/joint_states"}})
    first = build_session(config)
    feed(first, observations(3, 10))
    capsule = first.verbs.commit("made with position, velocity", persist=True)
    assert build_runtime(moved).fingerprint == first.parts.runtime.fingerprint      # a topic is not a meaning
    other = build_session(swapped)
    assert other.parts.runtime.fingerprint != first.parts.runtime.fingerprint
    with pytest.raises(FingerprintMismatch):
        other.verbs.load(capsule.id)
    assert other.parts.store.counters.invalidations == 1


# -- files that are not what their name says ------------------------------------------------------------

def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_directory_named_like_a_capsule_is_refused_typed_without_leaking(tmp_path):
    session = build_session(default_config(tmp_path))
    feed(session, observations(3, 11))
    capsule = session.verbs.commit("will become a directory", persist=True)
    path = Path(capsule.path)
    session.verbs.drop(capsule.id)                           # only its file is left ...
    path.unlink()
    path.mkdir()                                       # ... and that is a directory now
    with pytest.raises(CorruptCapsule, match=r"is a directory") as refused:
        session.verbs.load(capsule.id)
    assert str(path) in str(refused.value)
    fds = open_fds()
    for _ in range(500):
        with pytest.raises(CorruptCapsule):
            session.verbs.load(capsule.id)
    assert open_fds() == fds, "loading a directory leaks file descriptors"
    result = session.verbs.reenter(capsule.id)              # the documented fallback: rebuilt from the input log
    assert result.fallback and "is a directory" in result.fallback_reason
    key_dir = tmp_path / "key"
    key_dir.mkdir()
    with pytest.raises(InvalidArgument, match=r"key file .* is a directory"):
        CapsuleDirectory(tmp_path / "enc", key_file=str(key_dir), max_file_bytes=1 << 20)


# -- status ---------------------------------------------------------------------------------------------------

def test_status_never_waits_for_a_service_nor_reads_the_store_meanwhile(tmp_path):
    session = build_session(default_config(tmp_path))
    feed(session, observations(2, 12))
    first = session.status()
    held, done = threading.Event(), threading.Event()

    def service():
        with session.parts.boundary.held():           # a verb that holds the boundary a while
            held.set()
            parts = session.parts
            parts.store.snapshot(parts.runtime, label="meanwhile", episode_id=1, step=session.episode.step)
            done.wait(5)
    thread = threading.Thread(target=service)
    thread.start()
    assert held.wait(5)
    start = time.monotonic()
    during = session.status()
    assert time.monotonic() - start < 0.05 and during is first      # the last consistent picture
    done.set()
    thread.join()
    after = session.status()
    assert sum(after.capsules.values()) == sum(first.capsules.values()) + 1


def test_an_input_log_over_its_memory_limit_fails_start_up_saying_what_fits(tmp_path):
    """Camera inputs make a step's row large; the default steps of them would take tens of
    GiB. Start-up refuses with the size, the limit and the steps that fit, before allocating."""
    import dataclasses

    from runtime_fixtures import default_config

    from capsule_ros.errors import ConfigError
    from capsule_ros.serving.factory import build_session
    config = default_config(tmp_path)
    row_bytes = build_session(config).parts.runtime.input_staging.numel()
    limit_mb = 1000 * row_bytes / 2**20                         # room for 1,000 steps
    tight = dataclasses.replace(config, control=dataclasses.replace(
        config.control, input_log_steps=1001, input_log_max_mb=limit_mb))
    with pytest.raises(ConfigError) as refused:
        build_session(tight)
    message = str(refused.value)
    assert "control.input_log_steps = 1001" in message and "control.input_log_max_mb" in message, message
    assert "at most 1000" in message, message
    fits = dataclasses.replace(tight, control=dataclasses.replace(tight.control, input_log_steps=1000))
    assert build_session(fits).parts.recompute.log is not None
