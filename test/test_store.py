"""Capsule store policy: slab pools, LRU demotion and eviction of unpinned capsules,
pins, forks sharing bytes, counters."""
from __future__ import annotations

import pytest
from runtime_fixtures import arena_bytes, make_runtime, make_store, observations, run

from capsule_ros.capsules.store import Tier
from capsule_ros.errors import InvalidArgument, NotFound, ResourceExhausted


def slabs_mb(runtime, n):
    return n * runtime.layout.nbytes / 2**20 + 1e-6


def test_full_device_pool_demotes_the_least_recently_used_to_host_then_evicts():
    runtime = make_runtime()
    evicted = []
    store = make_store(runtime, device_mb=slabs_mb(runtime, 2), host_mb=slabs_mb(runtime, 1))
    store.on_evict = evicted.append
    a = store.snapshot(runtime, episode_id=1, step=1)
    b = store.snapshot(runtime, episode_id=1, step=2)
    store.restore(a.id, runtime)                      # a is now more recently used than b
    c = store.snapshot(runtime, episode_id=1, step=3)
    assert (store.get(a.id).tier, store.get(b.id).tier, store.get(c.id).tier) == (Tier.DEVICE, Tier.HOST, Tier.DEVICE)
    assert store.counters.demotions == 1
    d = store.snapshot(runtime, episode_id=1, step=4)  # a -> host needs room: b (host LRU) is evicted
    assert b.id not in store and [e.id for e in evicted] == [b.id]
    assert store.get(a.id).tier == Tier.HOST and store.get(d.id).tier == Tier.DEVICE
    assert store.counters.evictions == 1


def test_pinned_and_held_capsules_are_never_evicted():
    runtime = make_runtime()
    store = make_store(runtime, device_mb=slabs_mb(runtime, 1), host_mb=slabs_mb(runtime, 1))
    pinned = store.snapshot(runtime, episode_id=1, step=1, pinned=True)
    held = store.snapshot(runtime, episode_id=1, step=2, held=True)
    with pytest.raises(ResourceExhausted):
        store.snapshot(runtime, episode_id=1, step=3)
    assert pinned.id in store and held.id in store and len(store.list()) == 2


def test_fork_shares_the_bytes_and_outlives_its_source():
    runtime = make_runtime()
    store = make_store(runtime, device_mb=slabs_mb(runtime, 2), host_mb=0)
    run(runtime, observations(5, 1))
    before = arena_bytes(runtime)
    source = store.snapshot(runtime, episode_id=1, step=5)
    free = store.stats().free_slabs[Tier.DEVICE]
    fork = store.fork(source.id, label="branch")
    assert store.stats().free_slabs[Tier.DEVICE] == free and fork.parent_id == source.id
    store.drop(source.id)
    assert store.stats().free_slabs[Tier.DEVICE] == free      # still referenced by the fork
    run(runtime, observations(5, 2))
    store.restore(fork.id, runtime)
    assert arena_bytes(runtime) == before
    store.drop(fork.id)
    assert store.stats().free_slabs[Tier.DEVICE] == free + 1


def test_unknown_and_malformed_ids_are_refused_and_counted():
    runtime = make_runtime()
    store = make_store(runtime)
    with pytest.raises(NotFound):
        store.restore("e1.s1.abcdef", runtime)
    with pytest.raises(InvalidArgument):
        store.restore("../escape", runtime)
    with pytest.raises(InvalidArgument):
        store.snapshot(runtime, episode_id=1, step=1, capsule_id="bad/id")
    assert store.counters.misses == 1


# The store's face: five verbs, the two small objects it hands out, letting a file's
# capsule in, the session's pin, the queries. Growing it is a decision, not a drift.
STORE_FACE = {"snapshot", "restore", "fork", "drop", "move",          # the verbs
              "reserve", "lend", "adopt", "hold",                     # reservations, loans, files, the session's pin
              "get", "find", "list", "stats", "close"}                # queries and lifetime


def public_methods(cls) -> set:
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def test_the_store_keeps_its_small_face_and_the_package_uses_all_of_it():
    import re
    from pathlib import Path

    from capsule_ros.capsules.store import CapsuleStore, Loan, Reservation
    assert public_methods(CapsuleStore) == STORE_FACE
    assert public_methods(Reservation) == {"release"} and public_methods(Loan) == {"host_bytes", "copy", "end"}
    package = Path(__file__).resolve().parents[1] / "capsule_ros"
    code = "\n".join(p.read_text() for p in package.rglob("*.py") if p.name != "store.py")
    unused = sorted(name for name in STORE_FACE | {"release", "host_bytes", "copy", "end"}
                    if not re.search(rf"\.{name}\(", code))
    assert unused == [], f"public only for the tests: {unused}"


def test_the_store_knows_no_execution_mode():
    """A capsule carries its runtime's mode mark opaquely: no member of the store's face,
    of a capsule or of what the store asks of a runtime names chunking, and the capsules
    package imports nothing of a mode."""
    import ast
    import dataclasses
    from pathlib import Path

    from capsule_ros.capsules.store import ArenaOwner, Capsule, CapsuleStore
    names = set(vars(CapsuleStore)) | {f.name for f in dataclasses.fields(Capsule)} | set(vars(ArenaOwner)) \
        | set(ArenaOwner.__annotations__)
    assert [name for name in names if "chunk" in name.lower()] == []
    package = Path(__file__).resolve().parents[1] / "capsule_ros" / "capsules"
    imported = {node.module for path in package.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module}
    assert not [m for m in imported if m.startswith("capsule_ros.chunking") or m == "capsule_ros.runtime.mode"]


def test_a_reservation_is_all_or_nothing_and_given_back_once():
    runtime = make_runtime()
    store = make_store(runtime, device_mb=slabs_mb(runtime, 1), host_mb=0)
    room = store.reserve()
    assert store.stats().free_slabs[Tier.DEVICE] == 0
    with pytest.raises(ResourceExhausted):
        store.reserve()                               # nothing left, nothing changed
    capsule = store.snapshot(runtime, episode_id=1, step=0, into=room)
    room.release()                                    # used: a no-op
    assert store.stats().free_slabs[Tier.DEVICE] == 0 and capsule.id in store
    with pytest.raises(InvalidArgument):
        store.snapshot(runtime, episode_id=1, step=1, into=room)
    store.drop(capsule.id)
    unused = store.reserve()
    unused.release()
    unused.release()
    assert store.stats().free_slabs[Tier.DEVICE] == 1


def test_a_loan_keeps_a_dropped_capsules_bytes_until_it_ends():
    runtime = make_runtime()
    store = make_store(runtime, device_mb=slabs_mb(runtime, 1), host_mb=0)
    run(runtime, observations(3, 4))
    before = runtime.arena.storage.numpy().tobytes()
    capsule = store.snapshot(runtime, episode_id=1, step=3)
    with store.lend(capsule.id) as loan:
        store.drop(capsule.id)
        assert store.stats().free_slabs[Tier.DEVICE] == 0       # the slab stays with the loan
        with pytest.raises(ResourceExhausted):
            store.snapshot(runtime, episode_id=1, step=4)
        assert loan.copy().numpy().tobytes() == before
    assert store.stats().free_slabs[Tier.DEVICE] == 1


def test_move_between_tiers_and_to_disk():
    runtime = make_runtime()
    store = make_store(runtime, device_mb=slabs_mb(runtime, 1), host_mb=slabs_mb(runtime, 1))
    capsule = store.snapshot(runtime, episode_id=1, step=0)
    assert store.move(capsule.id, Tier.HOST).tier == Tier.HOST
    with pytest.raises(InvalidArgument, match="not persisted"):
        store.move(capsule.id, Tier.DISK)            # it would be lost
    capsule.path = "/capsules/x.capsule"              # as a save records it
    assert store.move(capsule.id, Tier.DISK).tier == Tier.DISK
    assert store.stats().free_slabs == {Tier.DEVICE: 1, Tier.HOST: 1, Tier.DISK: 0}
    with pytest.raises(NotFound, match="only on disk"):
        store.move(capsule.id, Tier.DEVICE)

def _expected_victims(store, tier):
    """By definition: the least recently used payload of ``tier`` that may move (no pin,
    no hold, no loan), computed from every capsule (what the store's index must agree with)."""
    groups = {}
    for capsule in store.list():
        if capsule.payload is not None and capsule.payload.tier == tier:
            groups.setdefault(id(capsule.payload), (capsule.payload, []))[1].append(capsule)
    movable = [(p, cs) for p, cs in groups.values() if p.loans == 0 and not any(c.pinned or c.held for c in cs)]
    return min(movable, key=lambda pc: pc[0].last_used) if movable else None


def test_demotion_and_eviction_follow_last_use_exactly_through_a_long_random_history():
    """The store keeps payloads in least-recently-used order per tier instead of scanning
    every capsule (a reset after thousands of episodes cost milliseconds that way): the
    order must stay exact through restores of host capsules, forks, holds and drops."""
    import random
    runtime = make_runtime()
    store = make_store(runtime, device_mb=slabs_mb(runtime, 3), host_mb=slabs_mb(runtime, 4))
    evicted = []
    store.on_evict = evicted.append
    rng = random.Random(7)
    for step in range(1, 400):
        live = [c for c in store.list() if c.payload is not None]
        op = rng.random()
        if op < 0.45 or not live:
            device_full = store.stats().free_slabs[Tier.DEVICE] == 0
            expected = _expected_victims(store, Tier.DEVICE) if device_full else None
            host_victim = (_expected_victims(store, Tier.HOST)
                           if device_full and store.stats().free_slabs[Tier.HOST] == 0 else None)
            before = len(evicted)
            try:
                made = store.snapshot(runtime, episode_id=1, step=step, held=rng.random() < 0.05)
            except ResourceExhausted:
                assert expected is None or host_victim is None
                continue
            if expected is not None:                               # it made room on the device
                assert made.tier == Tier.DEVICE and all(c.tier != Tier.DEVICE for c in expected[1]), step
            if host_victim is not None and len(evicted) > before:
                assert {c.id for c in evicted[before:]} <= {c.id for c in host_victim[1]}, step
        elif op < 0.7:
            store.restore(rng.choice(live).id, runtime)           # touches it, on either tier
        elif op < 0.8:
            store.fork(rng.choice(live).id, label="f")
        elif op < 0.9:
            store.drop(rng.choice(live).id)
        else:
            capsule = rng.choice(live)
            store.hold(capsule.id, not capsule.held)
    assert store.counters.demotions > 20 and store.counters.evictions > 20
    in_memory = {id(c.payload) for c in store.list() if c.payload is not None}
    assert len(in_memory) <= 7                                       # the 3 + 4 slabs hold every capsule in memory
