"""The recompute fallback, on the default policy (config/policy.yaml's shape,
random weights: the shipped weights do not change the cost).

- A corrupted capsule re-entered mid-episode is rebuilt from the timeline root and the
  input log, byte-exact, and the actions that follow are bit-identical to those after
  re-entering an intact copy (and to the original timeline's).
- When the input log does not reach the capsule (the episode outgrew
  ``control.input_log_steps``, the log is off, a rollback replaced the inputs, or the
  capsule comes from another process) and its file has no recipe that can (recipes off, or
  cut for the same reason), re-entering answers the capsule's own error code with the
  reasons, and the live state is untouched. (Rebuilds from a file's recipe, in another
  process too: test_recipe_fallback.py.)
- The cost: recompute vs restore (memory / disk) at k = 50, 200, 800 steps, printed with
  ``-s``; docs/capsule-format.md section 8 quotes these figures.

Run: ``python -m pytest test/test_fallback.py -q -s`` (~20 s on 2 CPU cores).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import List

import numpy as np
import pytest
import torch
from runtime_fixtures import default_config, observations

from capsule_ros.errors import CorruptCapsule, ErrorCode, NotFound, error_code_of
from capsule_ros.serving.factory import build_session
from capsule_ros.serving.records import EpisodeState
from capsule_ros.serving.session import PolicySession

torch.set_num_threads(1)
KS = tuple(int(k) for k in os.environ.get("CAPSULE_FALLBACK_KS", "50,200,800").split(","))
REPS = 3


def feed(session: PolicySession, obs: np.ndarray) -> np.ndarray:
    """One tick per row (trigger mode); the actions, as float32 rows."""
    out = []
    for row in obs:
        session.loop.write_input("joints", row[:4])
        session.loop.write_input("goal", row[4:])
        record = session.loop.tick()
        assert record is not None and not record.late
        out.append(record.values)
    return np.stack(out)


def arena(session: PolicySession) -> bytes:
    return session.parts.runtime.arena.storage.numpy().tobytes()


def live(session: PolicySession):
    e = session.episode
    return arena(session), e.episode_id, e.step, e.state, e.lineage


def corrupt(session: PolicySession, capsule_id: str) -> None:
    """Flip one bit of the state in the capsule's file (its last chunk: the state section
    comes last, after the recipe's, and a plain chunk's tag is its last 32 bytes)."""
    path = session.parts.directory.path_of(capsule_id)
    blob = bytearray(path.read_bytes())
    blob[-64] ^= 0x10
    path.write_bytes(bytes(blob))


def without_recipes(config):
    """``config`` with capsules.recipe off: the fallback has the input log only."""
    return dataclasses.replace(config, capsules=dataclasses.replace(config.capsules, recipe=False))


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


# -- the fallback gives the intact capsule's behaviour ----------------------------------------------
def test_corrupted_capsule_reentered_mid_episode_acts_like_the_intact_one(tmp_path):
    session = build_session(default_config(tmp_path))
    k, n, m = 50, 90, 40
    obs = observations(n + m, seed=11)
    feed(session, obs[:k])
    capsule = session.verbs.commit("k", persist=True)
    at_commit = arena(session)
    intact = session.verbs.fork(capsule.id, label="intact copy")        # same bytes, in memory
    original = feed(session, obs[k:n])                             # the original timeline, k..n

    session.verbs.drop(capsule.id)                                       # forget memory: disk only
    assert session.parts.store.find(capsule.id) is None and session.parts.directory.exists(capsule.id)
    corrupt(session, capsule.id)
    with pytest.raises(CorruptCapsule):                            # the file really is bad
        session.verbs.load(capsule.id)

    result = fallback = session.verbs.reenter(capsule.id)
    assert result.fallback is True and result.capsule.id == capsule.id
    assert "checksum" in result.fallback_reason or "corrupt" in result.fallback_reason.lower(), \
        result.fallback_reason
    assert result.recompute_seconds > 0 and result.restore_seconds == 0
    assert result.rollback and (session.episode.episode_id, session.episode.step) == (capsule.episode_id, k)
    assert session.episode.state == EpisodeState.RUNNING and session.episode.lineage == capsule.id
    assert arena(session) == at_commit, "the rebuilt state is not byte-exact"
    assert session.parts.loop.counters.fallback_recomputes == 1
    after_fallback = feed(session, obs[k:n + m])

    result = session.verbs.reenter(intact.id)
    assert not result.fallback and result.restore_seconds > 0
    assert arena(session) == at_commit
    after_intact = feed(session, obs[k:n + m])

    np.testing.assert_array_equal(bits(after_fallback), bits(after_intact))
    np.testing.assert_array_equal(bits(after_fallback[:n - k]), bits(original))
    print(f"\nfallback at k={k} ({fallback.recompute_seconds * 1e3:.1f} ms): the {n + m - k} actions after it are "
          f"bit-identical to the intact copy's and to the original timeline's\n  reason: {fallback.fallback_reason}")


# -- when the input log does not reach -----------------------------------------------------------------
def _refused_untouched(session: PolicySession, capsule_id: str, why: str):
    before = live(session)
    listing = sorted(c.id for c in session.parts.store.list())
    with pytest.raises(CorruptCapsule) as info:
        session.verbs.reenter(capsule_id)
    assert error_code_of(info.value) == ErrorCode.CORRUPT
    message = str(info.value)
    assert "no recompute fallback" in message and why in message, message
    assert live(session) == before, "a refused reenter changed the live state"
    assert sorted(c.id for c in session.parts.store.list()) == listing
    return message


def test_reenter_refused_when_the_input_log_is_outgrown(tmp_path):
    session = build_session(default_config(tmp_path, input_log_steps=16))
    obs = observations(30, seed=3)
    feed(session, obs[:20])                                        # 20 steps > 16 logged
    capsule = session.verbs.commit("late", persist=True)
    feed(session, obs[20:])
    session.verbs.drop(capsule.id)
    corrupt(session, capsule.id)
    message = _refused_untouched(session, capsule.id, "outgrew the input log (16 steps)")
    feed(session, obs[:3])                                         # and it keeps running
    print(f"\nrefused: {message}")


def test_reenter_refused_when_the_input_log_is_off(tmp_path):
    session = build_session(default_config(tmp_path, input_log_steps=0))
    obs = observations(12, seed=4)
    feed(session, obs[:5])
    capsule = session.verbs.commit("c", persist=True)
    feed(session, obs[5:])
    session.verbs.drop(capsule.id)
    corrupt(session, capsule.id)
    _refused_untouched(session, capsule.id, "control.input_log_steps is 0")


def test_reenter_refused_when_a_rollback_replaced_the_inputs(tmp_path):
    session = build_session(without_recipes(default_config(tmp_path)))
    obs, other = observations(40, seed=5), observations(25, seed=6)   # the branch passes step 30
    feed(session, obs[:10])
    early = session.verbs.commit("early")
    feed(session, obs[10:30])
    late = session.verbs.commit("late", persist=True)
    session.verbs.reenter(early.id)                                      # rollback to step 10
    feed(session, other)                                           # a different branch
    session.verbs.drop(late.id)
    corrupt(session, late.id)
    _refused_untouched(session, late.id, "a rollback to step 10 replaced the inputs")


def test_reenter_refused_for_a_capsule_of_another_process(tmp_path):
    config = without_recipes(default_config(tmp_path))
    first = build_session(config)
    obs = observations(20, seed=7)
    feed(first, obs[:8])
    capsule = first.verbs.commit("from the first process", persist=True)
    bad = first.verbs.commit("to be damaged", persist=True)
    del first                                                      # the process ends
    second = build_session(config)                                 # same weights, same directory
    feed(second, obs[8:])
    corrupt(second, bad.id)
    message = _refused_untouched(second, bad.id, "this process did not make the capsule")
    assert "has no recipe" in message, message
    result = second.verbs.reenter(capsule.id)                            # an intact one restores fine
    assert not result.fallback and second.episode.step == 8
    with pytest.raises(NotFound) as info:                          # and nothing at all: NotFound
        second.verbs.reenter("e1.s3.ffffff")
    assert error_code_of(info.value) == ErrorCode.NOT_FOUND


# -- the cost ---------------------------------------------------------------------------------------------
def _median_ms(samples: List[float]) -> float:
    return statistics.median(samples) * 1e3


def test_recompute_cost_against_restore(tmp_path):
    """Restore (memory, disk) vs recompute at k steps into the episode, default policy."""
    session = build_session(default_config(tmp_path))
    nbytes = session.parts.runtime.layout.nbytes
    obs = observations(max(KS) + 20, seed=9)
    rows = []
    # warm-up: the session's first fallback builds its scratch runtime (timed apart)
    feed(session, obs[:5])
    first = session.verbs.commit("warm-up", persist=True)
    session.verbs.drop(first.id)
    corrupt(session, first.id)
    cold = session.verbs.reenter(first.id)
    assert cold.fallback
    done = 5
    for k in KS:
        feed(session, obs[done:k])
        done = k
        at_k = arena(session)
        on_disk = session.verbs.commit(f"disk {k}", persist=True)
        damaged = session.verbs.commit(f"damaged {k}", persist=True)
        corrupt(session, damaged.id)
        session.verbs.drop(damaged.id)                                   # disk only, damaged
        feed(session, obs[k:k + 10])                               # move on, then come back
        memory_s, disk_s, disk_wall, recompute_s, recompute_wall = [], [], [], [], []
        for _ in range(REPS):
            result = session.verbs.reenter(on_disk.id)                   # in memory
            assert not result.fallback and arena(session) == at_k
            memory_s.append(result.restore_seconds)
            session.verbs.drop(on_disk.id)                               # disk only, intact
            start = time.perf_counter()
            result = session.verbs.reenter(on_disk.id)
            disk_wall.append(time.perf_counter() - start)
            assert not result.fallback and arena(session) == at_k
            disk_s.append(result.restore_seconds)
            start = time.perf_counter()
            result = session.verbs.reenter(damaged.id)
            recompute_wall.append(time.perf_counter() - start)
            assert result.fallback and arena(session) == at_k, "the recompute is not byte-exact"
            recompute_s.append(result.recompute_seconds)
            session.verbs.drop(damaged.id)                               # the rebuilt copy: forget it again
        rows.append((k, _median_ms(memory_s), _median_ms(disk_s), _median_ms(disk_wall), _median_ms(recompute_s),
                     _median_ms(recompute_wall)))
    print(f"\nrecompute fallback vs restore: default policy ({nbytes} B arena), CPU, 1 thread, "
          f"median of {REPS}; ms")
    print(f"{'k':>5} {'restore mem':>12} {'restore disk':>13} {'disk reenter':>13} {'recompute':>10} "
          f"{'fb reenter':>11} {'per step':>9} {'x disk':>7}")
    for k, mem, disk, disk_wall, rec, rec_wall in rows:
        print(f"{k:5d} {mem:12.3f} {disk:13.3f} {disk_wall:13.3f} {rec:10.1f} {rec_wall:11.1f} "
              f"{rec / k:9.3f} {rec_wall / disk_wall:7.0f}")
    print(f"first fallback of the session (5 steps, builds the scratch runtime): "
          f"{cold.recompute_seconds * 1e3:.1f} ms")
    for (_, *_a, r1, _w1), (_, *_b, r2, _w2) in zip(rows, rows[1:], strict=False):
        assert r2 > r1, "recompute cost should grow with k"
