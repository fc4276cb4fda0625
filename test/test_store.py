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
    assert pinned.id in store and held.id in store and len(store) == 2


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
