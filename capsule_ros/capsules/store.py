"""The capsule store: snapshot, restore, fork, drop and move execution-state capsules.

A capsule is an immutable copy of a whole ``StateArena`` (every buffer, one copy) plus
metadata, stamped with the fingerprint of the runtime that made it. The store keeps
capsule bytes in tiers:

- DEVICE: slabs on the runtime's device (GPU memory; ordinary memory on a CPU),
- HOST: pinned host slabs (ordinary memory on a CPU),
- DISK: only in the capsule directory (see ``capsule_ros.capsules.directory``).

The face is small, and ``test/test_store.py`` keeps it this size. Five verbs:
``snapshot``, ``restore``, ``fork``, ``drop`` and ``move`` (between tiers; to DISK releases
a persisted capsule's memory copy). Two small objects for callers that work across a lock
or must not fail half-way: a ``Reservation`` (room for one capsule taken ahead,
``reserve``) and a ``Loan`` (a capsule's bytes lent to a reader outside the caller's lock,
``lend``). ``adopt`` lets a capsule read from its file in, ``hold`` is the session's own
pin. Queries: ``get``, ``find``, ``list``, ``stats`` and the ``in`` operator; ``close``
ends the store's lifetime.

Slabs come from fixed pools sized by byte budgets at construction, so the hot verbs
(snapshot, restore) never allocate. Forks share their source's bytes (capsules are
immutable), so a fork costs no copy. When a pool is full, the least-recently-used
unpinned payload is demoted DEVICE -> HOST, and on HOST dropped from memory (it stays
reachable when persisted) or evicted.

On CUDA all copies run on a dedicated high-priority copy stream and are ordered against
the runtime's compute stream with events, never with a host synchronisation: a
snapshot waits for the step that produced the boundary, the next step waits for the
snapshot copy, and a restore waits for the step in flight and is waited on by the next.

Mechanism only: the store decides nothing about when to snapshot or what a rollback
means (that is ``capsule_ros.serving``), and a restore starts no work: it copies bytes.
A capsule carries its runtime's mode mark (``capsule_ros.runtime.marks.ModeMark``), which
the store keeps and never interprets; before a restore's copy the runtime may refuse the
capsule (``ArenaOwner.admit``), and after it the caller tells the runtime
(``PolicyRuntime.after_restore``). It is not thread-safe; callers serialise.

Cost: the verbs cost the same with 10 or 10,000 capsules in memory. The store keeps, per
memory tier, its payloads in least-recently-used order (and each payload's capsules), so
choosing what to demote or evict looks at the oldest payloads only; a scan of every
capsule per snapshot made ~/reset 5x slower after a few thousand episodes.
"""
from __future__ import annotations

import collections
import contextlib
import enum
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple, Union

import torch

from capsule_ros.capsules.config import CapsuleStoreConfig
from capsule_ros.capsules.ids import check_capsule_id, new_capsule_id
from capsule_ros.capsules.recipe import RecipeInfo
from capsule_ros.errors import Busy, FingerprintMismatch, InvalidArgument, NotFound, ResourceExhausted
from capsule_ros.metrics import LatencyWindow
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, StateArena
from capsule_ros.runtime.marks import ModeMark

LOG = logging.getLogger(__name__)
NO_ROOM = ("no room for a new capsule: drop or unpin capsules, or raise capsules.device_budget_mb / "
           "host_budget_mb")


class ArenaOwner(Protocol):
    """What the store needs of a runtime (``capsule_ros.runtime.engine.PolicyRuntime``):
    the arena whose bytes a capsule copies, their layout, the fingerprint a capsule is
    bound to, on CUDA the stream its steps run on (None on a CPU), the mark a capsule of
    the live state carries, and its verdict on a capsule before a restore's copy (``admit``
    raises to refuse; ``data()`` gives the capsule's bytes, read only if needed)."""

    layout: ArenaLayout
    arena: StateArena
    stream: Optional[torch.cuda.Stream]
    numerics: str                         # the CPU numerics level it runs at (runtime/numerics.py)

    @property
    def fingerprint(self) -> str: ...

    def mark(self) -> Optional[ModeMark]: ...

    def admit(self, mark: Optional[ModeMark], data: Callable[[], torch.Tensor], capsule_id: str) -> None: ...


class Tier(enum.IntEnum):
    """Where a capsule's bytes are; values match CapsuleInfo.TIER_*."""

    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass
class Payload:
    """The bytes of one or more capsules (forks share), in exactly one memory tier."""

    slab: torch.Tensor
    tier: Tier
    ready: Optional[torch.cuda.Event] = None   # completion of the copy that filled the slab
    refs: int = 0
    last_used: int = 0
    loans: int = 0                               # readers outside the caller's lock (see Loan)

    def wait(self) -> None:
        """Until the copy that filled the slab is done (before the slab is read on the host or reused)."""
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class Capsule:
    """Metadata of one capsule; ``payload`` is None when it lives only on disk."""

    id: str
    label: str
    parent_id: str
    episode_id: int
    step: int
    nbytes: int
    fingerprint: str
    stamp_ns: int
    pinned: bool = False                  # by the user: never evicted until unpinned or dropped
    held: bool = False                    # by the session (interrupt capsule, timeline root): never evicted
    payload: Optional[Payload] = field(default=None, repr=False)
    path: Optional[str] = None            # persisted copy in the capsule directory
    numerics: str = ""                    # CPU numerics level of the runtime that made it ('' = unknown)
    mark: Optional[ModeMark] = None       # its runtime's mode mark (opaque here: the runtime's to read)
    recipe: Optional[RecipeInfo] = None   # its file's recipe, when known (read from or written to it)
    stale: str = ""                       # a listed file of another graph: why ('' = restorable here)

    @property
    def tier(self) -> Tier:
        return self.payload.tier if self.payload is not None else Tier.DISK

    @property
    def persisted(self) -> bool:
        return self.path is not None


def _bytes_of(payload: Payload) -> Callable[[], torch.Tensor]:
    """A payload's bytes for ``ArenaOwner.admit``, once the copy that filled them is done."""
    def read() -> torch.Tensor:
        payload.wait()
        return payload.slab
    return read


class SlabPool:
    """Fixed-size slabs of one tier, allocated up front (no allocation on the hot path)."""

    def __init__(self, tier: Tier, slab_bytes: int, budget_bytes: int, device: torch.device, pin: bool):
        self.tier = tier
        self.slab_bytes = slab_bytes
        count = int(budget_bytes // slab_bytes) if slab_bytes else 0
        self._free: List[torch.Tensor] = [
            torch.empty(slab_bytes, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(count)]
        self.capacity = count

    def acquire(self) -> Optional[torch.Tensor]:
        return self._free.pop() if self._free else None

    def release(self, slab: torch.Tensor) -> None:
        self._free.append(slab)

    def give_back(self, payload: Payload) -> None:
        """A payload's slab, once nothing refers to it and its last copy is done."""
        payload.wait()
        self.release(payload.slab)

    @property
    def free(self) -> int:
        return len(self._free)

    def close(self) -> None:
        """Drop every free slab (the store drops the capsules' slabs first)."""
        self._free.clear()
        self.capacity = 0


class Reservation:
    """Room for one capsule, taken ahead (``CapsuleStore.reserve``): a caller that must
    not fail half-way reserves first, changes the state, then snapshots into it
    (``snapshot(into=...)``), or gives it back with ``release`` (a no-op once used)."""

    def __init__(self, payload: Payload, pool: SlabPool):
        self._payload: Optional[Payload] = payload
        self._pool = pool

    def _take(self) -> Payload:
        """The reserved payload, once (the store's ``snapshot``)."""
        if self._payload is None:
            raise InvalidArgument("this reservation was used or released already")
        payload, self._payload = self._payload, None
        return payload

    def release(self) -> None:
        """Give the room back (unused)."""
        if self._payload is not None:
            payload, self._payload = self._payload, None
            self._pool.give_back(payload)


class Loan:
    """A capsule's bytes lent to a reader that works outside the store's lock (a save to
    disk, a rebuild's copy of its root): until ``end`` the slab is neither moved, evicted
    nor reused, even if the capsule is dropped meanwhile. ``end`` runs under the lock
    again; a ``with`` block ends it too."""

    def __init__(self, capsule: Capsule, payload: Payload, pools: Dict[Tier, SlabPool]):
        self.capsule = capsule
        self._payload = payload
        self._ready = payload.ready          # the copy that filled the slab, as of the loan
        self._pools = pools
        self._ended = False
        payload.loans += 1

    def host_bytes(self, staging: Optional[torch.Tensor] = None,
                   stream: Optional[torch.cuda.Stream] = None) -> torch.Tensor:
        """The bytes on the host: the slab itself when it is host memory, else a copy into
        ``staging`` (pinned, the slab's size) on ``stream``, complete on return. Safe
        without the store's lock: it touches only this loan's slab."""
        slab = self._payload.slab
        if self._ready is not None:
            self._ready.synchronize()
        if slab.device.type == "cpu":
            return slab
        out = staging if staging is not None else torch.empty(slab.numel(), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            out.copy_(slab, non_blocking=True)
        (stream or torch.cuda.current_stream(slab.device)).synchronize()
        return out

    def copy(self) -> torch.Tensor:
        """A private host copy of the bytes (valid after the loan ends)."""
        data = self.host_bytes()
        return data.clone() if data is self._payload.slab else data

    def end(self) -> None:
        """The reader is done (under the lock): a slab whose capsules were all dropped
        meanwhile is freed now. Ending twice is a no-op."""
        if self._ended:
            return
        self._ended = True
        payload = self._payload
        payload.loans -= 1
        if payload.loans == 0 and payload.refs == 0:
            self._pools[payload.tier].release(payload.slab)

    def __enter__(self) -> Loan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


@dataclass
class StoreCounters:
    snapshots: int = 0
    restores: int = 0
    hits: Dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    invalidations: int = 0


@dataclass(frozen=True)
class StoreStats:
    """A picture of the store (``CapsuleStore.stats``): capsules and free slabs by tier,
    a copy of the counters, restore latency percentiles (ms)."""

    capsules: Dict[Tier, int]
    free_slabs: Dict[Tier, int]
    capacity: Dict[Tier, int]
    counters: StoreCounters
    restore_ms: Dict[float, float]


@dataclass(frozen=True)
class RestoreReport:
    capsule: Capsule
    tier: Tier
    seconds: float                     # host-side time of the call (on CUDA the copy itself is timed by events)
    room: Optional[Reservation] = None  # with ``restore(reserve=True)``: room for one new capsule


class CapsuleStore:
    """Capsules of one runtime fingerprint (see the module docstring)."""

    def __init__(self, nbytes: int, fingerprint: str, device: torch.device,
                 config: CapsuleStoreConfig = CapsuleStoreConfig(),  # noqa: B008 - frozen: shared safely
                 on_evict: Optional[Callable[[Capsule], None]] = None):
        self.nbytes = nbytes
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self.config = config
        self.on_evict = on_evict
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self._pools = {
            Tier.DEVICE: SlabPool(Tier.DEVICE, nbytes, int(config.device_budget_mb * 2**20), self.device, False),
            Tier.HOST: SlabPool(Tier.HOST, nbytes, int(config.host_budget_mb * 2**20), torch.device("cpu"), cuda),
        }
        self._capsules: Dict[str, Capsule] = {}
        # per memory tier: id(payload) -> payload, least recently used first; and its capsules
        self._lru: Dict[Tier, collections.OrderedDict[int, Payload]] = {
            Tier.DEVICE: collections.OrderedDict(), Tier.HOST: collections.OrderedDict()}
        self._holders: Dict[int, List[Capsule]] = {}
        self._clock = 0
        self.counters = StoreCounters()
        self.restore_latency = LatencyWindow()    # copy time: CUDA events on GPU, wall time on CPU
        self.snapshot_latency = LatencyWindow()
        self._pending_timings: List[Tuple[torch.cuda.Event, torch.cuda.Event, LatencyWindow]] = []
        LOG.info("capsule pools: %d device slab(s), %d host slab(s) of %d bytes",
                 self._pools[Tier.DEVICE].capacity, self._pools[Tier.HOST].capacity, nbytes)

    def close(self) -> None:
        """Forget every capsule in memory and free both pools (lifecycle ``cleanup``;
        capsule files stay on disk). The store holds nothing afterwards."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        self._capsules.clear()
        self._holders.clear()
        for order in self._lru.values():
            order.clear()
        self._pending_timings.clear()
        for pool in self._pools.values():
            pool.close()

    # -- queries ------------------------------------------------------------------------------
    def __contains__(self, capsule_id: str) -> bool:
        return capsule_id in self._capsules

    def get(self, capsule_id: str) -> Capsule:
        check_capsule_id(capsule_id)
        try:
            return self._capsules[capsule_id]
        except KeyError:
            raise NotFound(f"no capsule {capsule_id!r}") from None

    def find(self, capsule_id: str) -> Optional[Capsule]:
        """The capsule, or None (no id check, no miss counted)."""
        return self._capsules.get(capsule_id)

    def list(self) -> List[Capsule]:
        """All capsules, newest first."""
        return sorted(self._capsules.values(), key=lambda c: c.stamp_ns, reverse=True)

    def stats(self) -> StoreStats:
        """Capsules and free slabs by tier, the counters and restore percentiles; moves
        completed CUDA copy timings into their windows first (non-blocking)."""
        self._flush_timings()
        capsules = dict.fromkeys(Tier, 0)
        for capsule in self._capsules.values():
            capsules[capsule.tier] += 1
        return StoreStats(capsules=capsules,
                          free_slabs={t: self._pools[t].free if t in self._pools else 0 for t in Tier},
                          capacity={t: self._pools[t].capacity if t in self._pools else 0 for t in Tier},
                          counters=replace(self.counters, hits=dict(self.counters.hits)),
                          restore_ms=self.restore_latency.percentiles_ms(50, 95, 99))

    # -- the verbs ------------------------------------------------------------------------------
    def snapshot(self, runtime: ArenaOwner, *, label: str = "", parent_id: str = "", episode_id: int, step: int,
                 pinned: bool = False, held: bool = False, capsule_id: Optional[str] = None,
                 into: Optional[Reservation] = None) -> Capsule:
        """Copy the runtime's whole arena into a new capsule (asynchronous on CUDA), into
        the reserved room ``into`` when given."""
        self._check_target(runtime, self.fingerprint, self.nbytes)
        capsule_id = check_capsule_id(capsule_id) if capsule_id else new_capsule_id(episode_id, step)
        if capsule_id in self._capsules:
            raise InvalidArgument(f"capsule id {capsule_id!r} already exists")
        payload = into._take() if into is not None else self._new_payload(protect=())
        self._copy(dst=payload.slab, src=runtime.arena.storage, runtime=runtime, payload=payload,
                   timing=self.snapshot_latency)
        capsule = Capsule(capsule_id, label, parent_id, episode_id, step, self.nbytes, self.fingerprint,
                          time.time_ns(), pinned, held, None, numerics=runtime.numerics, mark=runtime.mark())
        self._attach(capsule, payload)
        self.counters.snapshots += 1
        return capsule

    def restore(self, capsule: Union[str, Capsule], runtime: ArenaOwner, *, data: Optional[torch.Tensor] = None,
                kinds: Optional[Sequence[BufferKind]] = None, count_as: Optional[Tier] = None,
                reserve: bool = False) -> RestoreReport:
        """Copy a capsule (an id, or a Capsule) back into the runtime's arena.

        ``data``: the verified bytes of the capsule's file, restored without keeping them
        in a pool (counted as a DISK hit). ``kinds`` restores only those buffer kinds (an
        ablation: e.g. (BufferKind.KV,) for KV-only). ``count_as`` attributes the hit to
        another tier (DISK, when the caller just loaded the capsule from its file).
        ``reserve``: also take room for one new capsule (``report.room``), all or nothing:
        ResourceExhausted before anything changed when there is none (the source's own
        slab may be the one that makes room: it is restored first).

        Refuses, with the live state untouched, an unknown id, a disk-only capsule without
        ``data`` (load it first), a capsule of another fingerprint, or one the runtime does
        not admit (``ArenaOwner.admit``: its mode mark). Starts no work on the runtime:
        the caller passes the capsule's mark on (``PolicyRuntime.after_restore``)."""
        start = time.perf_counter()
        if data is not None:
            if not isinstance(capsule, Capsule):
                raise InvalidArgument("restoring file bytes needs the capsule's metadata, not only its id")
            return self._restore_bytes(capsule, data, runtime, start, reserve)
        try:
            known = self.get(capsule if isinstance(capsule, str) else capsule.id)
        except NotFound:
            self.counters.misses += 1
            raise
        self._check_target(runtime, known.fingerprint, known.nbytes)
        payload = known.payload
        if payload is None:
            raise NotFound(f"capsule {known.id!r} is only on disk ({known.path}); load it first")
        runtime.admit(known.mark, _bytes_of(payload), known.id)
        room = None
        if reserve:
            if self._room_for(1, protect=[payload]):
                room = self.reserve(protect=[payload])
            elif not self._room_for(1):
                raise ResourceExhausted(NO_ROOM)
        lo, hi = (0, self.nbytes) if not kinds else runtime.layout.byte_range(*kinds)
        self._copy(dst=runtime.arena.storage[lo:hi], src=payload.slab[lo:hi], runtime=runtime,
                   payload=payload, timing=self.restore_latency)
        self._touch(payload)
        self.counters.restores += 1
        self.counters.hits[count_as if count_as is not None else payload.tier] += 1
        if reserve and room is None:
            room = self.reserve()          # the restored source's slab may be the one freed
        return RestoreReport(known, payload.tier, time.perf_counter() - start, room)

    def fork(self, capsule_id: str, *, label: str = "", new_id: Optional[str] = None,
             pinned: bool = False) -> Capsule:
        """A new capsule id for the same state; shares the bytes (capsules are immutable)."""
        source = self.get(capsule_id)
        new_id = check_capsule_id(new_id) if new_id else new_capsule_id(source.episode_id, source.step)
        if new_id in self._capsules:
            raise InvalidArgument(f"capsule id {new_id!r} already exists")
        capsule = replace(source, id=new_id, label=label, parent_id=source.id, stamp_ns=time.time_ns(),
                          pinned=pinned, held=False, payload=None, path=None)
        if source.payload is not None:
            self._attach(capsule, source.payload)
            self._touch(source.payload)
        else:
            capsule.path = source.path   # the file holds the same bytes
            self._capsules[new_id] = capsule
        return capsule

    def drop(self, capsule_id: str) -> Capsule:
        """Forget a capsule from memory (its file, if any, is the directory's business)."""
        capsule = self.get(capsule_id)
        del self._capsules[capsule_id]
        self._detach(capsule)
        return capsule

    def move(self, capsule_id: str, tier: Tier) -> Capsule:
        """Move a capsule's bytes (and its forks') to ``tier``. DEVICE / HOST: a copy
        into a slab of that pool (making room there as a snapshot would). DISK: release
        the memory copy of a persisted capsule, which stays listed on the DISK tier."""
        capsule = self.get(capsule_id)
        if tier == Tier.DISK:
            if capsule.path is None:
                raise InvalidArgument(f"capsule {capsule_id!r} is not persisted; releasing it would lose it")
            self._detach(capsule)          # a lent slab is freed when its loan ends
            return capsule
        if capsule.payload is None:
            raise NotFound(f"capsule {capsule_id!r} is only on disk; load it first")
        if capsule.payload.loans:
            raise Busy(f"capsule {capsule_id!r} is being read (e.g. saved): move it afterwards")
        if capsule.payload.tier != tier and not self._move_payload(capsule.payload, tier,
                                                                   protect=(capsule.payload,)):
            raise ResourceExhausted(f"no room on the {tier.name} tier for capsule {capsule_id!r}")
        return capsule

    # -- reservations, loans, capsules from files, the session's pin -----------------------------
    def reserve(self, protect: Sequence[Payload] = ()) -> Reservation:
        """Room for one capsule, taken now (demoting or evicting as a snapshot would, but
        never ``protect``); ResourceExhausted, with nothing changed, when there is none."""
        payload = self._new_payload(protect=tuple(protect))
        return Reservation(payload, self._pools[payload.tier])

    def lend(self, capsule_id: str) -> Loan:
        """Lend a capsule's in-memory bytes to a reader outside the lock (see ``Loan``);
        every loan must end (``Loan.end`` or its ``with`` block)."""
        capsule = self.get(capsule_id)
        if capsule.payload is None:
            raise NotFound(f"capsule {capsule_id!r} is only on disk ({capsule.path})")
        return Loan(capsule, capsule.payload, self._pools)

    def adopt(self, capsule: Capsule, data: Optional[torch.Tensor]) -> Capsule:
        """Let in a capsule read from its file: ``data`` (host uint8, nbytes) goes into a
        slab (HOST preferred), or None lists it as disk-only. A capsule already in memory
        is returned as it is (and learns its file's path).

        The fingerprint must be this store's: a foreign capsule is refused and counted as
        an invalidation, and nothing is inserted.
        """
        check_capsule_id(capsule.id)
        if capsule.fingerprint != self.fingerprint or capsule.nbytes != self.nbytes:
            self.counters.invalidations += 1
            raise FingerprintMismatch(
                f"capsule {capsule.id!r} was made by graph {capsule.fingerprint[:12]} ({capsule.nbytes} bytes); "
                f"this runtime is {self.fingerprint[:12]} ({self.nbytes} bytes)")
        existing = self._capsules.get(capsule.id)
        if existing is not None and existing.payload is not None:
            existing.path = existing.path or capsule.path
            return existing
        capsule.payload = None
        if data is not None:
            if data.numel() != self.nbytes:
                raise InvalidArgument(f"capsule {capsule.id!r}: {data.numel()} bytes, expected {self.nbytes}")
            payload = self._new_payload(protect=(), prefer=Tier.HOST)
            self._copy(dst=payload.slab, src=data, runtime=None, payload=payload)
            self._attach(capsule, payload)
        else:
            self._capsules[capsule.id] = capsule
        return capsule

    def hold(self, capsule_id: str, held: bool = True) -> None:
        """The session's own pin (interrupt capsule, timeline root): a held capsule is
        never demoted or evicted. No-op for unknown ids."""
        capsule = self._capsules.get(capsule_id)
        if capsule is not None:
            capsule.held = held

    # -- internals -------------------------------------------------------------------------------
    def _restore_bytes(self, capsule: Capsule, data: torch.Tensor, runtime: ArenaOwner, start: float,
                       reserve: bool) -> RestoreReport:
        """``restore`` of a file's verified bytes, not kept in a pool (a one-off restore
        that must not need room for the bytes themselves: a reset from a disk capsule)."""
        self._check_target(runtime, capsule.fingerprint, capsule.nbytes)
        if data.numel() != self.nbytes:
            raise InvalidArgument(f"capsule {capsule.id!r}: {data.numel()} bytes, expected {self.nbytes}")
        runtime.admit(capsule.mark, lambda: data, capsule.id)
        room = self.reserve() if reserve else None
        scratch = Payload(slab=data, tier=Tier.DISK)
        try:
            self._copy(dst=runtime.arena.storage, src=data, runtime=runtime, payload=scratch,
                       timing=self.restore_latency)
            scratch.wait()                          # ``data`` is the caller's: done with it on return
        except BaseException:
            if room is not None:
                room.release()
            raise
        self.counters.restores += 1
        self.counters.hits[Tier.DISK] += 1
        return RestoreReport(capsule, Tier.DISK, time.perf_counter() - start, room)

    def _room_for(self, count: int, protect: Sequence[Optional[Payload]] = ()) -> bool:
        """Whether ``count`` new capsules fit without touching ``protect``: free slabs plus
        slabs that demotion or eviction can free (unpinned, unheld). Changes nothing."""
        protected = {id(p) for p in protect if p is not None}
        needed = count - sum(pool.free for pool in self._pools.values())
        for tier in (Tier.DEVICE, Tier.HOST):
            for key, (p, cs) in self._payloads(tier):
                if needed <= 0:
                    return True
                if key not in protected and self._movable(p, cs):
                    needed -= 1
        return needed <= 0

    def _flush_timings(self) -> None:
        """Move completed CUDA copy timings into their latency windows (non-blocking)."""
        still = []
        for start, end, window in self._pending_timings:
            if end.query():
                window.record(start.elapsed_time(end) / 1e3)
            else:
                still.append((start, end, window))
        self._pending_timings = still

    def _check_target(self, runtime: ArenaOwner, fingerprint: str, nbytes: int) -> None:
        if runtime.fingerprint != fingerprint or runtime.layout.nbytes != nbytes:
            self.counters.invalidations += 1
            raise FingerprintMismatch(
                f"capsule graph {fingerprint[:12]} ({nbytes} bytes) does not match the runtime's graph "
                f"{runtime.fingerprint[:12]} ({runtime.layout.nbytes} bytes): other weights, shapes, dtype "
                "or device kind")

    def _touch(self, payload: Payload) -> None:
        """``payload`` is the most recently used of its tier (it must hold a capsule)."""
        self._clock += 1
        payload.last_used = self._clock
        order = self._lru[payload.tier]
        order[id(payload)] = payload
        order.move_to_end(id(payload))

    def _attach(self, capsule: Capsule, payload: Payload) -> None:
        capsule.payload = payload
        payload.refs += 1
        self._holders.setdefault(id(payload), []).append(capsule)
        self._touch(payload)
        self._capsules[capsule.id] = capsule

    def _detach(self, capsule: Capsule) -> None:
        payload, capsule.payload = capsule.payload, None
        if payload is not None:
            payload.refs -= 1
            holders = self._holders[id(payload)]
            holders.remove(capsule)
            if not holders:
                self._forget(payload)
            if payload.refs == 0 and payload.loans == 0:    # a lent slab is freed when its loan ends
                self._pools[payload.tier].give_back(payload)

    def _forget(self, payload: Payload) -> None:
        """No capsule holds ``payload`` any more: out of the LRU order."""
        del self._holders[id(payload)]
        del self._lru[payload.tier][id(payload)]

    def _retier(self, payload: Payload, tier: Tier) -> None:
        """``payload`` moved to ``tier``, where it keeps its place by last use: usually the
        newest (only a least recently used payload is demoted), else the tier is re-sorted."""
        del self._lru[payload.tier][id(payload)]
        payload.tier = tier
        order = self._lru[tier]
        newest = next(reversed(order.values()), None)
        order[id(payload)] = payload
        if newest is not None and newest.last_used > payload.last_used:
            ordered = sorted(order.values(), key=lambda p: p.last_used)
            order.clear()
            order.update((id(p), p) for p in ordered)

    def _payloads(self, tier: Tier) -> Iterable[Tuple[int, Tuple[Payload, List[Capsule]]]]:
        """(key, (payload, its capsules)) of ``tier``, least recently used first."""
        return ((key, (p, self._holders[key])) for key, p in self._lru[tier].items())

    @staticmethod
    def _movable(payload: Payload, capsules: List[Capsule]) -> bool:
        """Whether demotion or eviction may take this payload's slab."""
        return payload.loans == 0 and not any(c.pinned or c.held for c in capsules)

    def _lru_victim(self, tier: Tier, protect: Iterable[Payload]) -> Optional[Tuple[Payload, List[Capsule]]]:
        protected = {id(p) for p in protect}
        return next(((p, cs) for key, (p, cs) in self._payloads(tier)
                     if key not in protected and self._movable(p, cs)), None)

    def _free_slab(self, tier: Tier, protect: Sequence[Payload]) -> Optional[torch.Tensor]:
        """A free slab of ``tier``, making room by demotion / eviction when needed."""
        pool = self._pools[tier]
        if pool.capacity == 0:
            return None
        slab = pool.acquire()
        if slab is not None:
            return slab
        victim = self._lru_victim(tier, protect)
        if victim is None:
            return None
        payload, capsules = victim
        if tier == Tier.DEVICE and self._move_payload(payload, Tier.HOST, protect=protect):
            self.counters.demotions += 1
            return pool.acquire()
        # HOST (or DEVICE with no room on HOST): drop the bytes from memory.
        self._forget(payload)
        for capsule in list(capsules):
            if capsule.path is None:
                del self._capsules[capsule.id]
                self.counters.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(capsule)
            capsule.payload = None
        pool.give_back(payload)
        return pool.acquire()

    def _new_payload(self, protect: Sequence[Payload], prefer: Tier = Tier.DEVICE) -> Payload:
        order = (Tier.DEVICE, Tier.HOST) if prefer == Tier.DEVICE else (Tier.HOST, Tier.DEVICE)
        for tier in order:
            slab = self._free_slab(tier, protect)
            if slab is not None:
                return Payload(slab=slab, tier=tier)
        raise ResourceExhausted(
            f"no room for a {self.nbytes}-byte capsule: device pool {self._pools[Tier.DEVICE].capacity} slab(s), "
            f"host pool {self._pools[Tier.HOST].capacity} slab(s), all holding pinned capsules; drop some or "
            "raise capsules.device_budget_mb / host_budget_mb")

    def _move_payload(self, payload: Payload, tier: Tier, protect: Sequence[Payload]) -> bool:
        slab = self._free_slab(tier, tuple(protect) + (payload,))
        if slab is None:
            return False
        old_slab, old_tier = payload.slab, payload.tier
        self._copy(dst=slab, src=old_slab, runtime=None, payload=payload)
        payload.wait()   # the old slab returns to its pool: the copy out of it must be done
        payload.slab = slab
        self._retier(payload, tier)
        self._pools[old_tier].release(old_slab)
        return True

    def _copy(self, *, dst: torch.Tensor, src: torch.Tensor, runtime: Optional[ArenaOwner], payload: Payload,
              timing: Optional[LatencyWindow] = None) -> None:
        """dst <- src, ordered after the runtime's in-flight work and before its next step.
        With ``timing``, the copy's own duration goes to that window (CUDA events on a GPU)."""
        if self._copy_stream is None:
            start = time.perf_counter()
            dst.copy_(src)
            if timing is not None:
                timing.record(time.perf_counter() - start)
            return
        stream = self._copy_stream
        if runtime is not None and runtime.stream is not None:
            stream.wait_stream(runtime.stream)          # the step that made the boundary
        if payload.ready is not None:
            stream.wait_event(payload.ready)            # the copy that filled the source slab
        timed = None
        if timing is not None:
            timed = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timed[0].record(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        done = timed[1] if timed is not None else torch.cuda.Event()
        done.record(stream)
        if timed is not None and timing is not None:
            self._pending_timings.append((timed[0], timed[1], timing))
        if runtime is not None and runtime.stream is not None:
            runtime.stream.wait_event(done)             # the next step waits for this copy
        payload.ready = done
