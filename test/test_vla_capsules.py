"""SmolVLA's episode state in capsules, without ROS: the chunk, its cursor, the noise counter,
the task tokens and a pending request (with RTC, the leftover it plans from) are arena bytes.

A capsule at every cursor of a chunk cycle, with and without a refill in flight, restores
byte-exactly and the actions after it are bit-identical (sync, and async with RTC guidance);
one with a refill in flight survives the disk and another runtime; fork and rollback are
exact; restoring without the noise counter or without the queue diverges (both are
load-bearing); the task arrives as a serialized ``std_msgs/msg/String`` through the port, and
bytes that are not UTF-8 are dropped and counted with the state untouched.
"""
from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch
from rclpy.serialization import serialize_message
from std_msgs.msg import String
from vla_fixtures import TASK_PORT, VLAFixture, port_of

from capsule_ros.chunking.mark import ChunkingMark
from capsule_ros.polling import wait_until
from capsule_ros.runtime.policy import CHUNK_ACTIONS, CHUNK_CURSOR, RNG
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_session

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("vla")
    return {name: VLAFixture.load(name, root) for name in ("smolvla_two_cams", "smolvla_bf16_one_cam")}


def config(fx: VLAFixture, chunking: str = "sync", delay: str = "auto", rtc: str = "off", **params) -> ServingConfig:
    values = fx.serving_params(chunking=chunking, inference_delay_steps=delay, rtc=rtc, deadline_ms=0.0)
    for section, settings in params.items():
        values[section].update(settings)
    return ServingConfig.from_params(values)


def task_message(text: str) -> bytes:
    return bytes(serialize_message(String(data=text)))


def mark_of(capsule) -> ChunkingMark:
    return ChunkingMark.parse(capsule.mark, capsule.id)


def ticks(session, fx: VLAFixture, episode: int, steps, wait: bool = True) -> List:
    """Ticks on the fixture's inputs, the task through its port as serialized String messages,
    each after the refill in flight is done (no takeover is late, whatever the load)."""
    out = []
    worker = session.parts.runtime.mode.worker
    for t in steps:
        if worker is not None and wait:
            wait_until(worker.ready, 30.0, "the refill in flight", interval=0.001)
        for key, value in fx.features.items():
            session.loop.write_input(port_of(key), value[episode, t])
        fed = session.loop.feed(TASK_PORT, task_message(fx.task(episode, t)), stage_only=True)
        assert fed.accepted, fed.drop
        out.append(session.loop.tick())
    return out


def values(records) -> bytes:
    return b"".join(r.values.tobytes() for r in records)


@pytest.mark.parametrize("chunking, delay, rtc", [("sync", "auto", "off"), ("async", "2", "guided")])
def test_a_capsule_at_every_cursor_restores_byte_exactly_and_replays_bit_identically(fixtures, chunking, delay,
                                                                                       rtc):
    fx = fixtures["smolvla_two_cams"]
    session = build_session(config(fx, chunking, delay, rtc))
    runtime, verbs = session.parts.runtime, session.verbs
    schedule = runtime.mode.schedule
    episode, steps = 1, range(fx.steps)                          # the task changes at steps 12 and 26
    verbs.reset()
    original = ticks(session, fx, episode, steps)
    seen_pending = False
    for k in range(2 * schedule.end, 3 * schedule.end + 1):      # a whole chunk cycle, mid-episode
        verbs.reset()
        ticks(session, fx, episode, range(k))
        capsule = verbs.commit(label=f"cursor {runtime.mode.cursor}")
        snapshot = runtime.arena.storage.clone()
        seen_pending |= mark_of(capsule).pending
        ticks(session, fx, episode, range(k, k + 4))             # move on, then come back
        verbs.reenter(capsule.id)
        assert torch.equal(runtime.arena.storage, snapshot), f"restore at step {k} not byte-exact"
        again = ticks(session, fx, episode, range(k, fx.steps))
        assert values(again) == values(original[k:]), f"capsule at step {k} ({mark_of(capsule)})"
        verbs.drop(capsule.id)
    assert seen_pending == (chunking == "async")


def test_a_refill_in_flight_survives_disk_another_runtime_and_a_fork(fixtures, tmp_path):
    fx = fixtures["smolvla_bf16_one_cam"]
    cfg = config(fx, "async", "3", "guided", capsules={"directory": str(tmp_path / "capsules")})
    session = build_session(cfg)
    schedule = session.parts.runtime.mode.schedule
    at = 2 * schedule.end + schedule.execution_horizon + 1
    session.verbs.reset()
    ticks(session, fx, 2, range(at))                                     # a request is out
    capsule = session.verbs.commit(label="in flight", persist=True)
    assert mark_of(capsule).pending and mark_of(capsule).delay == 3
    expected = ticks(session, fx, 2, range(at, fx.steps))
    fork = session.verbs.fork(capsule.id, label="branch")
    session.verbs.reenter(fork.id)                                       # a rollback, through a fork
    assert values(ticks(session, fx, 2, range(at, fx.steps))) == values(expected)
    other = build_session(cfg)                                           # another runtime, from the file
    loaded = other.verbs.load(capsule.id)
    assert mark_of(loaded) == mark_of(capsule)
    other.verbs.reenter(capsule.id)
    assert values(ticks(other, fx, 2, range(at, fx.steps))) == values(expected)


@pytest.mark.parametrize("ablated", [RNG, CHUNK_ACTIONS])
def test_restoring_without_the_noise_counter_or_the_queue_diverges(fixtures, ablated):
    """Restore a capsule, then put one buffer back as the live state had it: the noise
    counter (the next chunk draws other noise) or the queue (the next rows are other actions)."""
    fx = fixtures["smolvla_two_cams"]
    session = build_session(config(fx))
    runtime = session.parts.runtime
    session.verbs.reset()
    k = 7                                                         # mid-chunk: 2 rows executed of the second
    ticks(session, fx, 0, range(k))
    capsule = session.verbs.commit()
    expected = ticks(session, fx, 0, range(k, 20))
    live = runtime.arena[ablated].clone()
    session.verbs.reenter(capsule.id)
    runtime.arena[ablated].copy_(live)
    assert runtime.arena[CHUNK_CURSOR].item() == runtime.mode.cursor
    got = ticks(session, fx, 0, range(k, 20))
    assert values(got) != values(expected)
    first = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True))
                 if a.values.tobytes() != b.values.tobytes())
    # the queue is read at once; the noise only by the next chunk (n_action_steps 5: at step 10)
    assert first == (0 if ablated == CHUNK_ACTIONS else 10 - k)


def test_task_messages_through_the_port(fixtures):
    """A String message is tokenised into the port; bytes that are not UTF-8 and messages
    that are not Strings are dropped and counted, leaving the staged tokens as they were."""
    fx = fixtures["smolvla_two_cams"]
    session = build_session(config(fx))
    runtime = session.parts.runtime
    encode = runtime.policy.text_inputs()[TASK_PORT].encode
    staged = runtime.staging[TASK_PORT]
    assert np.array_equal(staged, encode(fx.tasks[0]))           # policy.task until a message arrives
    assert runtime.texts[TASK_PORT] == fx.tasks[0]
    assert session.loop.feed(TASK_PORT, task_message("open the drawer"), stage_only=True).accepted
    assert np.array_equal(staged, encode("open the drawer")) and runtime.texts[TASK_PORT] == "open the drawer"
    before = staged.copy()
    raw = bytearray(task_message("abcd"))
    raw[8] = 0xFF                                                 # not UTF-8
    for bad in (bytes(raw), b"\x00\x01\x00\x00\xff\xff\xff\x7f", b"", String(data="x").data):
        fed = session.loop.feed(TASK_PORT, bad, stage_only=True)
        assert not fed.accepted and fed.drop is not None and fed.drop.reason == "type"
    assert np.array_equal(staged, before) and runtime.texts[TASK_PORT] == "open the drawer"
    assert session.parts.loop.ports[TASK_PORT].counters.dropped["type"] == 4
    record = ticks(session, fx, 0, range(1))[0]
    assert np.isfinite(record.values).all()
