"""Stateful property test of the capsule lifecycle.

A Hypothesis ``RuleBasedStateMachine`` drives a real ``PolicySession`` (small hybrid
policy, KV ring of 16, token prefix), a real ``CapsuleStore`` of 2 device + 3 host slabs
(so demotion, eviction and a full store all happen) and a real ``CapsuleDirectory`` in a
temporary directory, through random sequences of rules:

  steps (ticks on seeded observations), commit (persist / pin), steps_then_commit,
  interrupt, reenter (own capsule / any id / "" / unknown / malformed), reset, fork,
  save, load, drop (memory / memory and disk / store.move to DISK), forget (drop one
  of this process's capsules and damage or delete its file, maybe re-enter it at once),
  fault (flip a bit / truncate a file, plant a ``.part``, disk full on the next write)
  and restart (crash, crash mid-save leaving a ``.part``, stray ``.part``, or a new
  process with other weights over the same directory).

Capsule files carry no recipe here (``capsules.recipe`` off): the fallback is the input
log's, as the model below knows it; rebuilds from a file's recipe have their own tests
(test_recipe_fallback.py).

The model: for each capsule id the arena bytes (``runtime.arena.storage``) the store's
copy must hold, the file image each save wrote (a file is intact iff it still equals
it), its fingerprint, the session's recompute ledger, and which capsules lie on the
logged timeline (the input log's timeline: root, rollbacks, overflow of
``input_log_steps``).

Invariants, per operation and after every rule:

- every successful restore (reenter, reset, fork or load from memory, an intact file, or
  rebuilt by the recompute fallback) is byte-exact against the model;
- what the model says must succeed does (a copy in memory, an intact file of this graph,
  a capsule on the logged timeline with its root in memory: fallback); what it says must
  be refused is, with the expected typed error (nothing: NotFound; a damaged file:
  CorruptCapsule; another graph: FingerprintMismatch, counted as an
  invalidation), and a corrupted file is never loaded;
- a refused operation (any ``CapsuleRosError``) changes nothing: live arena bytes,
  episode, step, episode state, lineage, interrupt capsule, the store's listing (ids,
  tiers, paths, pins, holds) and the directory's files;
- the store's copies equal the model; a capsule marked persisted holds its file's
  bytes; pinned and held capsules (timeline root, interrupt capsule) are never evicted;
  the timeline root is held; the live state's step and episode are the session's;
  ``list`` is the store plus the directory;
- no orphan files: only ``<known id>.capsule``, ``quarantine/`` and the ``.part`` files
  the test planted; no ``.part`` after a save (even a failed one); after a restart the
  leftovers are in ``quarantine/`` and in ``CapsuleDirectory.recovered``.

Run: ``python -m pytest test/test_capsule_statemachine.py -q -s`` (``-s`` prints the rule
executions and the outcome counts: restores by source, fallbacks, refusals by verb and
error, known-bug hits). 100 examples x 40 steps take ~15 s on 2 cores.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from runtime_fixtures import INPUTS, SMALL, observations, with_overrides

from capsule_ros.capsules import directory as directory_module
from capsule_ros.capsules.directory import PART_SUFFIX, QUARANTINE, SUFFIX, CapsuleDirectory
from capsule_ros.capsules.store import CapsuleStore, CapsuleStoreConfig, Tier
from capsule_ros.errors import (
    Busy,
    CapsuleIOError,
    CapsuleRosError,
    CorruptCapsule,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    WrongState,
)
from capsule_ros.policies.hybrid import HybridPolicy
from capsule_ros.runtime.arena import BufferKind
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.serving.config import ControlConfig
from capsule_ros.serving.files import SaveFailed
from capsule_ros.serving.records import EpisodeState, HoldMode
from capsule_ros.serving.session import PolicySession

torch.set_num_threads(1)

# A KV ring of 16 so the sliding window is reached within an example; a token prefix so
# every reset runs the prefill path.
CFG = with_overrides(SMALL, max_context=16)
PREFIX = (3, 1, 4)
SEEDS = (0, 1)                      # weights: change-weights flips between these
LOG_STEPS = 12                      # control.input_log_steps: many examples outgrow it
DEVICE_SLABS, HOST_SLABS = 2, 3     # the store's budget, in capsules: demotion, eviction, and full
CHUNK_BYTES = 2048                  # several chunks per file (the arena is 6.5 KB)
CONTROL = ControlConfig.from_mapping({"mode": "trigger", "trigger_port": "joints", "autostart": True,
                                      "input_log_steps": LOG_STEPS, "service_timeout_ms": 2000.0})
# The five bugs this machine found (refused commit(persist) keeping its evictions, root ids
# reused across processes, a refused reset or recompute changing the state, the interrupt
# capsule's timeline root left unheld) are fixed; their minimal reproducers are the
# test_regression_* tests at the end of this file.
# Examples follow the Hypothesis profile (test/conftest.py): the same ones on every run by
# default (CI), new ones with HYPOTHESIS_PROFILE=dev, a long hunt with HYPOTHESIS_PROFILE=hunt
# (~40 s per 300 examples on 2 cores). A failure prints its steps and a @reproduce_failure blob.
SETTINGS = settings(stateful_step_count=40, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

REPORT: collections.Counter = collections.Counter()   # printed by the test at the end

# What a damaged (plain) file must answer: every byte is covered by the header digest or a
# chunk tag, and the reader checks sizes and the version first.
DAMAGED = (CorruptCapsule,)

RULES_PER_PROCESS = 6               # at least this many rules between restarts
IDX = st.integers(0, 11)            # which id: 0 = the newest (see CapsuleMachine.pick)

_RUNTIMES: Dict[int, PolicyRuntime] = {}


def counted(fn):
    """Count the rule's executions in REPORT."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        REPORT[f"rule {fn.__name__}"] += 1
        self.since_boot += 1
        return fn(self, *args, **kwargs)
    return wrapper


def runtime_for(seed: int) -> PolicyRuntime:
    """One runtime per weight seed, reused across examples and zeroed at every (re)start
    like a fresh process (building one is the slow part of a restart)."""
    if seed not in _RUNTIMES:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            policy = HybridPolicy(CFG, INPUTS)
        _RUNTIMES[seed] = build_policy_runtime(policy, RuntimeConfig(device="cpu", cpu_threads=1))
    runtime = _RUNTIMES[seed]
    runtime.arena.storage.zero_()
    runtime.input_staging.zero_()
    return runtime


def budget_mb(slabs: int, nbytes: int) -> float:
    return (slabs * nbytes + 1) / 2**20


def disk_full(f, header, data, kek, **_):
    """Stands in for fileformat.write_capsule: half a file, then ENOSPC."""
    f.write(b"CAPSULE\x00" + b"\x00" * 100)
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


@dataclasses.dataclass
class DiskEntry:
    data: bytes          # the arena bytes saved
    fingerprint: str
    episode: int
    step: int
    image: bytes         # the whole file as written: the file is intact iff it still equals this
    process: int         # which process (boot) wrote it


@dataclasses.dataclass(frozen=True)
class Made:
    """The recompute ledger of the session, as the model sees it."""

    data: bytes
    episode: int
    step: int


class CapsuleMachine(RuleBasedStateMachine):

    # -- set-up ---------------------------------------------------------------------------------
    @initialize()
    def start(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="capsule-sm-"))
        self.root = self.tmp / "capsules"
        self.seed = SEEDS[0]
        self.ids: List[str] = []                    # every id seen, in order (choices index it)
        self.disk: Dict[str, DiskEntry] = {}
        self.parts: List[str] = []                  # planted .part names still in the root
        self.quarantined = 0
        self.process = 0
        self.tolerated: set = set()
        self.session: Optional[PolicySession] = None
        self.boot()

    def teardown(self):
        shutil.rmtree(getattr(self, "tmp", "/nonexistent"), ignore_errors=True)

    def boot(self):
        """A new process: runtime, store, directory, session (as build_session does)."""
        runtime = runtime_for(self.seed)
        nbytes = runtime.layout.nbytes
        store = CapsuleStore(nbytes, runtime.fingerprint, runtime.device,
                             CapsuleStoreConfig(device_budget_mb=budget_mb(DEVICE_SLABS, nbytes),
                                                host_budget_mb=budget_mb(HOST_SLABS, nbytes),
                                                directory=str(self.root), recipe=False))
        directory = CapsuleDirectory(self.root, chunk_bytes=CHUNK_BYTES, max_file_bytes=1 << 20)
        planted = sorted(self.parts)
        recovered = sorted(p.name for p in directory.recovered)
        assert len(recovered) == len(planted), (recovered, planted)
        for path in directory.recovered:
            assert path.parent == self.root / QUARANTINE and any(path.name.startswith(p) for p in planted)
        self.quarantined += len(recovered)
        self.parts = []
        self.session = PolicySession(runtime, store, CONTROL, directory=directory, prefix=PREFIX)
        # the model of this process's memory
        self.mem: Dict[str, bytes] = {}            # bytes the store's copy of an id must hold
        self.made: Dict[str, Made] = {}            # ledger: capsules this process made
        self.pinned: set = set()                   # pinned, not dropped/released by the user
        self.released: set = set()                 # memory released by the user (store.move to DISK)
        self.since_boot = 0
        self.process += 1
        self.session.verbs.reset()
        self.next_episode = 2
        self.new_timeline(self.session.parts.recompute.root_id)
        REPORT["sessions started"] += 1

    # -- model helpers ---------------------------------------------------------------------------
    @property
    def fp(self) -> str:
        return self.session.parts.runtime.fingerprint

    def live(self) -> bytes:
        return self.session.parts.runtime.arena.storage.numpy().tobytes()

    def note(self, capsule_id: str) -> None:
        if capsule_id not in self.ids:
            self.ids.append(capsule_id)

    def pick(self, index: int) -> str:
        """Index 0 is the newest id (recent capsules are the interesting ones, and
        examples shrink towards them)."""
        return self.ids[-1 - index % len(self.ids)]

    def path(self, capsule_id: str) -> Path:
        return self.root / (capsule_id + SUFFIX)

    def intact(self, capsule_id: str) -> bool:
        entry, path = self.disk.get(capsule_id), self.path(capsule_id)
        return entry is not None and path.is_file() and path.read_bytes() == entry.image

    def file_ok(self, capsule_id: str) -> bool:
        """The file exists, is intact and was made by this graph: loading must work."""
        return self.intact(capsule_id) and self.disk[capsule_id].fingerprint == self.fp

    def in_memory(self, capsule_id: str) -> bool:
        found = self.session.parts.store.find(capsule_id)
        return found is not None and found.payload is not None

    def remember(self, capsule, data: bytes) -> None:
        """A capsule this process made: in memory and in its ledger."""
        self.note(capsule.id)
        self.mem[capsule.id] = data
        self.made[capsule.id] = Made(data, capsule.episode_id, capsule.step)
        entry = self.disk.get(capsule.id)
        if entry is not None and entry.data != data:
            REPORT["id collision: a new capsule took the id of an existing file with another state"] += 1

    def created(self, capsule, data: bytes) -> None:
        """A capsule made at the live boundary (commit, interrupt, fork of the live state)."""
        self.remember(capsule, data)
        if not self.tl_overflow:
            self.on_tl[capsule.id] = capsule.step

    def new_timeline(self, root_id: str, was_interrupt: bool = False) -> None:
        """The session started a timeline at ``root_id`` (reset, or re-entering a capsule
        that is not on the logged timeline)."""
        s = self.session
        self.tl_root, self.tl_base, self.tl_len, self.tl_overflow = root_id, s.episode.step, 0, False
        self.on_tl: Dict[str, int] = {}
        capsule = s.parts.store.get(root_id)
        assert s.parts.recompute.root_id == root_id
        assert capsule.held, f"the timeline root {root_id} is not held"
        self.remember(capsule, self.live())
        self.on_tl[root_id] = capsule.step

    def recomputable(self, capsule_id: str) -> bool:
        root = self.session.parts.store.find(self.tl_root)
        return (capsule_id in self.on_tl and not self.tl_overflow and LOG_STEPS > 0
                and root is not None and root.payload is not None)

    def observe(self):
        s = self.session
        listing = tuple(sorted((c.id, c.tier, c.path, c.pinned, c.held) for c in s.parts.store.list()))
        files = tuple(sorted(os.listdir(self.root)))
        e = s.episode
        return (self.live(), e.episode_id, e.step, e.state, e.lineage, interrupt_id(s), listing, files)

    def attempt(self, verb: str, call):
        """Run a verb; a refusal must change nothing. Returns (result, error)."""
        before = self.observe()
        try:
            result = call()
        except CapsuleRosError as exc:
            after = self.observe()
            assert after == before, (f"refused {verb} ({type(exc).__name__}: {exc}) changed the state:\n"
                                     f"{_diff(before, after)}")
            REPORT[f"refused {verb}: {type(exc).__name__}"] += 1
            return None, exc
        return result, None

    def store_full(self) -> bool:
        """No slab can be freed: every payload in memory belongs to a pinned or held capsule."""
        store = self.session.parts.store
        stats = store.stats()
        if any(stats.free_slabs.values()):
            return False
        protected = {id(c.payload) for c in store.list() if c.payload is not None and (c.pinned or c.held)}
        return len(protected) >= sum(stats.capacity.values())

    def expect_refusal(self, exc, *types):
        assert exc is not None, f"expected a refusal with {[t.__name__ for t in types]}, got success"
        assert isinstance(exc, types), f"expected {[t.__name__ for t in types]}, got {type(exc).__name__}: {exc}"

    def restore_expectation(self, capsule_id: str):
        """What restoring ``capsule_id`` without a fallback must give: ('memory', bytes),
        ('disk', bytes) or ('none', why)."""
        if self.in_memory(capsule_id):
            return "memory", self.mem[capsule_id]
        if self.file_ok(capsule_id):
            return "disk", self.disk[capsule_id].data
        return "none", None

    def refusal_types(self, capsule_id: str):
        """The errors a capsule that is neither in memory nor loadable may answer."""
        entry = self.disk.get(capsule_id)
        if entry is None or not self.path(capsule_id).is_file():
            return (NotFound,)
        if not self.intact(capsule_id):
            return DAMAGED + ((FingerprintMismatch,) if entry.fingerprint != self.fp else ())
        return (FingerprintMismatch,)

    # -- rules: the control loop -----------------------------------------------------------------
    @rule(n=st.integers(1, 8), seed=st.integers(0, 2**16))
    @counted
    def steps(self, n, seed):
        s = self.session
        for row in observations(n, seed):
            s.loop.write_input("joints", row[:4])
            s.loop.write_input("goal", row[4:])
            running, step, before = s.episode.state == EpisodeState.RUNNING, s.episode.step, self.live()
            record = s.loop.tick()
            if running:
                assert record is not None and record.step == step + 1 == s.episode.step
                if self.tl_overflow or self.tl_len >= LOG_STEPS:
                    self.tl_overflow = True
                else:
                    self.tl_len += 1
                REPORT["policy steps"] += 1
            else:
                assert self.live() == before, "a tick while interrupted changed the state"

    # -- rules: capsule verbs --------------------------------------------------------------------
    @rule(persist=st.booleans(), pin=st.sampled_from([False, False, False, True]))
    @counted
    def commit(self, persist, pin):
        s = self.session
        data, state = self.live(), s.episode.state
        capsule, exc = self.attempt("commit", lambda: s.verbs.commit("c", persist=persist, pin=pin))
        if state not in (EpisodeState.RUNNING, EpisodeState.INTERRUPTED):
            return self.expect_refusal(exc, WrongState)
        if exc is not None:
            assert isinstance(exc, ResourceExhausted) and self.store_full(), exc
            return
        assert (capsule.episode_id, capsule.step, capsule.pinned) == (s.episode.episode_id, s.episode.step, pin)
        assert self.live() == data and s.episode.lineage == capsule.id
        self.created(capsule, data)
        if pin:
            self.pinned.add(capsule.id)
        if persist:
            assert capsule.path == str(self.path(capsule.id))
            self.saved(capsule.id, data, capsule)
        REPORT["commits"] += 1

    def saved(self, capsule_id, data, capsule):
        self.disk[capsule_id] = DiskEntry(data, self.fp, capsule.episode_id, capsule.step,
                                          self.path(capsule_id).read_bytes(), self.process)

    @rule(commit=st.booleans(), mode=st.sampled_from(list(HoldMode)))
    @counted
    def interrupt(self, commit, mode):
        s = self.session
        data, state = self.live(), s.episode.state
        capsule, exc = self.attempt("interrupt", lambda: s.verbs.interrupt(mode, commit=commit))
        if state != EpisodeState.RUNNING:
            return self.expect_refusal(exc, WrongState)
        if exc is not None:
            assert isinstance(exc, ResourceExhausted) and commit and self.store_full(), exc
            return
        assert s.episode.state == EpisodeState.INTERRUPTED and self.live() == data
        if commit:
            assert capsule.held and interrupt_id(s) == capsule.id
            self.created(capsule, data)
        else:
            assert capsule is None and interrupt_id(s) == ""
        REPORT["interrupts"] += 1

    @rule(index=IDX, which=st.sampled_from(["own", "any", "interrupt", "unknown", "malformed"]))
    @counted
    def reenter(self, index, which):
        """Re-enter: one of this process's capsules (in its ledger), any id seen, "" (the
        interrupt capsule), an unknown id or a malformed one."""
        s = self.session
        if which == "own" and self.made:
            made = list(self.made)
            return self.do_reenter(made[-1 - index % len(made)])
        if which in ("own", "any") and self.ids:
            return self.do_reenter(self.pick(index))
        if which == "interrupt" and interrupt_id(s):
            return self.do_reenter(interrupt_id(s), by_id=False)
        if which == "interrupt":
            state, data = s.episode.state, self.live()
            result, exc = self.attempt("reenter ''", lambda: s.verbs.reenter(""))
            if state == EpisodeState.INTERRUPTED:     # no capsule: resume the untouched live state
                assert exc is None and result.capsule is None and s.episode.state == EpisodeState.RUNNING
                assert self.live() == data
                REPORT["reenter '': resumed without a capsule"] += 1
            else:
                self.expect_refusal(exc, WrongState)
            return
        capsule_id = "../escape" if which == "malformed" else "e9.s9.unknown"
        _, exc = self.attempt("reenter", lambda: s.verbs.reenter(capsule_id))
        self.expect_refusal(exc, InvalidArgument if which == "malformed" else NotFound)

    def do_reenter(self, capsule_id: str, by_id: bool = True):
        s = self.session
        how, expected = self.restore_expectation(capsule_id)
        recomputable = self.recomputable(capsule_id)
        covered = capsule_id in self.on_tl and not self.tl_overflow
        prev_episode, prev_step = s.episode.episode_id, s.episode.step
        invalidations = s.parts.store.counters.invalidations
        was_interrupt = capsule_id == interrupt_id(s)

        result, exc = self.attempt("reenter", lambda: s.verbs.reenter(capsule_id if by_id else ""))
        if how != "none":
            if exc is not None:
                assert isinstance(exc, ResourceExhausted) and how == "disk" and self.store_full(), \
                    f"reenter {capsule_id} ({how}) refused: {type(exc).__name__}: {exc}"
                return
            assert not result.fallback, f"reenter {capsule_id} from {how} fell back: {result.fallback_reason}"
            assert self.live() == expected, f"reenter {capsule_id} from {how} is not byte-exact"
            REPORT[f"reenter: restored from {how}"] += 1
        elif recomputable:
            if isinstance(exc, ResourceExhausted) and self.store_full():
                return                            # no slab for the recompute's scratch copy
            assert exc is None, f"reenter {capsule_id}: on the logged timeline, yet refused: {exc}"
            assert result.fallback and result.fallback_reason and result.recompute_seconds > 0
            assert self.live() == self.made[capsule_id].data, f"recompute of {capsule_id} is not byte-exact"
            expected = self.made[capsule_id].data
            REPORT["reenter: recompute fallback"] += 1
        else:
            self.expect_refusal(exc, *self.refusal_types(capsule_id))
            if isinstance(exc, FingerprintMismatch):
                assert s.parts.store.counters.invalidations > invalidations, "a foreign capsule was not counted"
            return
        # success: the session follows the capsule
        capsule = result.capsule
        assert capsule.id == capsule_id and s.episode.state == EpisodeState.RUNNING
        e = s.episode
        assert (e.episode_id, e.step, e.lineage) == (capsule.episode_id, capsule.step, capsule_id)
        assert result.rollback == (capsule.episode_id == prev_episode and capsule.step < prev_step)
        self.mem[capsule_id] = expected
        if capsule_id in self.pinned and not s.parts.store.get(capsule_id).pinned:
            self.pinned.discard(capsule_id)      # rebuilt by the fallback: a new, unpinned copy
        self.next_episode = max(self.next_episode, capsule.episode_id + 1)
        if covered:                               # a rollback on the logged timeline
            self.on_tl = {k: v for k, v in self.on_tl.items() if v <= capsule.step}
            self.tl_len = min(self.tl_len, capsule.step - self.tl_base)
        else:
            self.new_timeline(capsule_id, was_interrupt)

    @rule(data=st.data())
    @counted
    def reset(self, data):
        s = self.session
        capsule_id = data.draw(st.sampled_from([""] + self.ids), label="capsule")
        how, expected = self.restore_expectation(capsule_id) if capsule_id else ("initial", None)
        episode = self.next_episode
        result, exc = self.attempt("reset", lambda: s.verbs.reset(capsule_id))
        if how == "none":          # reset has no recompute fallback
            return self.expect_refusal(exc, *self.refusal_types(capsule_id))
        if exc is not None:
            assert isinstance(exc, ResourceExhausted) and self.store_full(), exc
            return
        assert result[0] == episode == s.episode.episode_id and s.episode.state == EpisodeState.RUNNING
        assert interrupt_id(s) == ""
        if capsule_id:
            kept = s.parts.store.find(capsule_id)        # a reset restores from a file without caching it, and
            if kept is not None and kept.payload is not None:   # may evict its source to make room for the root
                self.mem[capsule_id] = expected
            else:
                self.mem.pop(capsule_id, None)
            live = np.frombuffer(self.live(), np.uint8)
            source = np.frombuffer(expected, np.uint8)
            # byte-exact but for the relabelled episode id
            differ = np.nonzero(live != source)[0]
            lo, hi = s.parts.runtime.layout.byte_range(BufferKind.META)
            assert ((differ >= lo) & (differ < hi)).all(), "reset from a capsule is not byte-exact"
            assert result[1].id == capsule_id and s.episode.step == result[1].step
            REPORT[f"reset: from {how}"] += 1
        else:
            REPORT["reset: initial state"] += 1
        self.next_episode = episode + 1
        self.new_timeline(s.parts.recompute.root_id)

    @rule(data=st.data())
    @counted
    def fork(self, data):
        s = self.session
        capsule_id = data.draw(st.sampled_from([""] + self.ids), label="capsule")
        if not capsule_id:
            state, live = s.episode.state, self.live()
            capsule, exc = self.attempt("fork", lambda: s.verbs.fork(""))
            if state == EpisodeState.IDLE:
                return self.expect_refusal(exc, WrongState)
            if exc is not None:
                assert isinstance(exc, ResourceExhausted) and self.store_full(), exc
                return
            self.created(capsule, live)
            REPORT["fork: live state"] += 1
            return
        how, expected = self.restore_expectation(capsule_id)
        capsule, exc = self.attempt("fork", lambda: s.verbs.fork(capsule_id))
        if how == "none":          # fork has no recompute fallback
            return self.expect_refusal(exc, *self.refusal_types(capsule_id))
        if exc is not None:
            assert isinstance(exc, ResourceExhausted) and self.store_full(), exc
            return
        self.mem[capsule_id] = expected
        assert capsule.parent_id == capsule_id and not capsule.pinned and capsule.path is None
        ledger = self.made.get(capsule_id)
        self.note(capsule.id)
        self.mem[capsule.id] = expected
        if ledger is not None:
            self.made[capsule.id] = ledger
            if capsule_id in self.on_tl:
                self.on_tl[capsule.id] = self.on_tl[capsule_id]
        REPORT[f"fork: from {how}"] += 1

    @precondition(lambda self: self.ids)
    @rule(index=IDX)
    @counted
    def save(self, index):
        capsule_id = self.pick(index)
        s = self.session
        part = self.root / (capsule_id + PART_SUFFIX)
        in_memory = self.in_memory(capsule_id)
        capsule, exc = self.attempt("save", lambda: s.verbs.save(capsule_id))
        if not in_memory:
            return self.expect_refusal(exc, NotFound, *DAMAGED)   # only on disk already / nothing
        if part.exists():
            return self.expect_refusal(exc, Busy)
        assert exc is None, f"save {capsule_id}: {exc}"
        assert capsule.path == str(self.path(capsule_id))
        self.saved(capsule_id, self.mem[capsule_id], capsule)
        REPORT["saves"] += 1

    @precondition(lambda self: self.ids)
    @rule(index=IDX)
    @counted
    def load(self, index):
        capsule_id = self.pick(index)
        s = self.session
        was_in_memory, ok = self.in_memory(capsule_id), self.file_ok(capsule_id)
        capsule, exc = self.attempt("load", lambda: s.verbs.load(capsule_id))
        if not ok:                        # load reads and verifies the file, in memory or not
            return self.expect_refusal(exc, *self.refusal_types(capsule_id))
        if was_in_memory:
            assert exc is None, f"load {capsule_id} (in memory, intact file): {exc}"
            REPORT["load: already in memory, file verified"] += 1
            return
        if exc is not None:
            assert isinstance(exc, ResourceExhausted) and self.store_full(), exc
            return
        assert capsule.path == str(self.path(capsule_id)) and capsule.payload is not None
        self.mem[capsule_id] = self.disk[capsule_id].data
        REPORT["load: from disk"] += 1

    @precondition(lambda self: self.ids)
    @rule(index=IDX, how=st.sampled_from(["memory", "disk", "move_to_disk"]))
    @counted
    def drop(self, index, how):
        """session.drop (memory, or memory and disk) or store.move(..., Tier.DISK)."""
        if how == "move_to_disk":
            return self.move_to_disk(self.pick(index))
        from_disk = how == "disk"
        capsule_id = self.pick(index)
        s = self.session
        in_store = s.parts.store.find(capsule_id) is not None
        on_disk = from_disk and self.path(capsule_id).is_file()
        interrupt = s.episode.state == EpisodeState.INTERRUPTED and capsule_id == interrupt_id(s)
        _, exc = self.attempt("drop", lambda: s.verbs.drop(capsule_id, from_disk=from_disk))
        if interrupt:
            return self.expect_refusal(exc, WrongState)
        if not in_store and not on_disk:
            return self.expect_refusal(exc, NotFound)
        assert exc is None, exc
        assert s.parts.store.find(capsule_id) is None
        self.mem.pop(capsule_id, None)
        self.pinned.discard(capsule_id)
        if on_disk:
            assert not self.path(capsule_id).exists()
            self.disk.pop(capsule_id, None)
        if not self.path(capsule_id).exists():   # gone from memory and disk: forgotten, no recompute
            self.on_tl.pop(capsule_id, None)
        REPORT["drops"] += 1

    def move_to_disk(self, capsule_id):
        store = self.session.parts.store
        found = store.find(capsule_id)
        _, exc = self.attempt("move_to_disk", lambda: store.move(capsule_id, Tier.DISK))
        if found is None:
            return self.expect_refusal(exc, NotFound)
        if found.path is None:
            return self.expect_refusal(exc, InvalidArgument)
        assert exc is None and store.get(capsule_id).tier == Tier.DISK
        self.pinned.discard(capsule_id)
        self.released.add(capsule_id)
        REPORT["memory released (disk-only)"] += 1

    @rule(n=st.integers(1, 8), seed=st.integers(0, 2**16), persist=st.booleans())
    @counted
    def steps_then_commit(self, n, seed, persist):
        """The common pattern (and a second way to step, so that steps are frequent)."""
        self.steps.__wrapped__(self, n, seed)
        self.commit.__wrapped__(self, persist, False)

    @rule(index=IDX, damage=st.sampled_from(["none", "flip", "truncate", "delete"]),
          where=st.integers(0, 1 << 20), then_reenter=st.booleans())
    @counted
    def forget(self, index, damage, where, then_reenter):
        """Make one of this process's capsules unreachable in memory (drop it) and maybe
        damage or delete its file: what the recompute fallback is for (``then_reenter``:
        re-enter it right away)."""
        s = self.session
        # this process's capsules still in memory, but not the timeline root (the drop rule
        # covers that) nor the interrupt capsule; those on the logged timeline first
        candidates = [c for c in reversed(list(self.made)) if s.parts.store.find(c) is not None and c != self.tl_root
                      and not (s.episode.state == EpisodeState.INTERRUPTED and c == interrupt_id(s))]
        if not candidates:
            REPORT["forget: nothing to forget"] += 1
            return
        candidates.sort(key=lambda c: c not in self.on_tl)
        capsule_id = candidates[index % len(candidates)]
        s.verbs.drop(capsule_id, from_disk=damage == "delete")
        self.mem.pop(capsule_id, None)
        self.pinned.discard(capsule_id)
        if damage == "delete":
            self.disk.pop(capsule_id, None)
        if not self.path(capsule_id).is_file():   # dropped from memory and disk: forgotten for good
            self.on_tl.pop(capsule_id, None)
        elif damage != "none" and capsule_id in self.disk and self.path(capsule_id).is_file():
            self.corrupt(capsule_id, damage == "truncate", where)
        if then_reenter:
            self.do_reenter(capsule_id)

    # -- rules: faults and restarts ----------------------------------------------------------------
    @rule(kind=st.sampled_from(["flip", "truncate", "plant_part", "disk_full_commit", "disk_full_save"]),
          index=IDX, where=st.integers(0, 1 << 20))
    @counted
    def fault(self, kind, index, where):
        """Damage a capsule file (flip a bit, truncate), plant a ``.part`` file (a save of
        that id in progress: saving it is Busy), or make the next write fail (ENOSPC)."""
        if kind in ("flip", "truncate") and self.disk:
            self.corrupt(list(self.disk)[-1 - index % len(self.disk)], kind == "truncate", where)
        elif kind == "plant_part" and self.ids:
            name = self.pick(index) + PART_SUFFIX
            if name not in self.parts:
                (self.root / name).write_bytes(b"CAPSULE\x00 half a file")
                self.parts.append(name)
        elif kind.startswith("disk_full"):
            self.disk_full(kind == "disk_full_commit", index)

    def corrupt(self, capsule_id: str, truncate: bool, where: int) -> None:
        path = self.path(capsule_id)
        blob = bytearray(path.read_bytes())
        if not blob:
            blob = bytearray(b"\x00")              # already truncated to nothing: now junk
        elif truncate:
            blob = blob[:where % len(blob)]
        else:
            blob[where % len(blob)] ^= 1 << (where % 8)
        with open(path, "r+b") as f:
            f.write(blob)
            f.truncate()
        REPORT["files corrupted"] += 1

    def disk_full(self, persist_commit: bool, index: int) -> None:
        """The next write fails with ENOSPC: the verb is refused and leaves no file."""
        s = self.session
        saved = directory_module.write_capsule
        directory_module.write_capsule = disk_full
        try:
            if persist_commit:
                return self.commit_on_a_full_disk()
            else:
                capsule_id = self.pick(index) if self.ids else self.tl_root
                _, exc = self.attempt("save (disk full)", lambda: s.verbs.save(capsule_id))
                allowed = (CapsuleIOError, NotFound, Busy, *DAMAGED)
        finally:
            directory_module.write_capsule = saved
        self.expect_refusal(exc, *allowed)

    def commit_on_a_full_disk(self) -> None:
        """A persisting commit whose save fails: the capsule is committed at the boundary (in
        memory, lineage changed) and the call answers SaveFailed naming it; no file, no .part."""
        s = self.session
        data, state = self.live(), s.episode.state
        if state == EpisodeState.IDLE or self.store_full():
            _, exc = self.attempt("commit (disk full)", lambda: s.verbs.commit("full", persist=True))
            return self.expect_refusal(exc, WrongState if state == EpisodeState.IDLE else ResourceExhausted)
        files = sorted(os.listdir(self.root))
        with pytest.raises(SaveFailed) as failed:
            s.verbs.commit("full", persist=True)
        capsule = failed.value.capsule
        assert failed.value.code == CapsuleIOError.code and capsule.id in str(failed.value)
        assert s.episode.lineage == capsule.id and self.live() == data and capsule.path is None
        assert sorted(os.listdir(self.root)) == files          # nothing written, no .part left
        self.created(capsule, data)
        REPORT["commits whose save failed (kept in memory)"] += 1

    @precondition(lambda self: self.since_boot >= RULES_PER_PROCESS)
    @rule(kind=st.sampled_from(["crash", "crash mid-save", "crash, stray .part", "change weights"]), index=IDX)
    @counted
    def restart(self, kind, index):
        """The process dies (maybe mid-save, leaving a .part) and a new one starts over the
        same directory: memory is gone, files stay, leftovers go to quarantine/. With
        "change weights" the new process has other weights: every old capsule is then
        foreign (FingerprintMismatch, counted as an invalidation), never restored."""
        if kind == "crash mid-save" and self.disk:
            capsule_id = list(self.disk)[index % len(self.disk)]
            name = capsule_id + PART_SUFFIX
            if name not in self.parts:       # half of a real file: what a crash mid-write leaves
                blob = self.path(capsule_id).read_bytes()
                (self.root / name).write_bytes(blob[:len(blob) // 2])
                self.parts.append(name)
        elif kind == "crash, stray .part":
            name = f"crash{len(self.parts)}.s1.abcdef{PART_SUFFIX}"
            if name not in self.parts:
                (self.root / name).write_bytes(b"CAPSULE\x00")
                self.parts.append(name)
        old = self.fp
        if kind == "change weights":
            self.seed = SEEDS[1] if self.seed == SEEDS[0] else SEEDS[0]
        self.boot()
        if kind == "change weights":
            assert self.fp != old
            REPORT["weight changes"] += 1
        else:
            REPORT["crash-restarts"] += 1

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def store_matches_model(self):
        s = self.session
        for capsule in s.parts.store.list():
            if capsule.payload is not None:
                data = capsule_bytes(s, capsule.id)
                assert data == self.mem.get(capsule.id), f"the store's copy of {capsule.id} is not the model's"
                if capsule.path is not None and self.intact(capsule.id):
                    assert self.disk[capsule.id].data == data, \
                        f"{capsule.id} is marked persisted but its file holds another state"
            else:
                assert capsule.path is not None, f"{capsule.id} has neither bytes nor a file"
            if capsule.path is not None:
                assert capsule.path == str(self.path(capsule.id)) and self.path(capsule.id).is_file(), \
                    f"{capsule.id}: its file {capsule.path} is gone"
            assert capsule.fingerprint == self.fp

    @invariant()
    def protected_capsules_stay_in_memory(self):
        s = self.session
        for capsule_id in self.pinned:
            found = s.parts.store.find(capsule_id)
            assert found is not None and found.payload is not None and found.pinned, f"pinned {capsule_id} evicted"
        for capsule in s.parts.store.list():
            if capsule.payload is not None:
                self.released.discard(capsule.id)
            elif capsule.held:
                assert capsule.id in self.released, f"held {capsule.id} was evicted"

    @invariant()
    def live_state_matches_session(self):
        s = self.session
        out = s.parts.runtime.read_outputs()
        assert (out.step, out.episode) == (s.episode.step, s.episode.episode_id)

    @invariant()
    def listing_is_memory_and_disk(self):
        s = self.session
        listed = {c.id for c in s.verbs.list()}
        in_store = {c.id for c in s.parts.store.list()}
        on_disk = {n[:-len(SUFFIX)] for n in os.listdir(self.root) if n.endswith(SUFFIX)}
        assert in_store <= listed <= in_store | on_disk, (listed, in_store, on_disk)

    @invariant()
    def no_orphan_files(self):
        names = set(os.listdir(self.root))
        for name in names:
            if name == QUARANTINE:
                assert (self.root / name).is_dir()
            elif name.endswith(PART_SUFFIX):
                assert name in self.parts, f"orphan .part file {name}"
            elif name.endswith(SUFFIX):
                assert name[:-len(SUFFIX)] in self.disk, f"orphan capsule file {name}"
            else:
                raise AssertionError(f"unexpected file {name} in the capsule directory")
        for capsule_id in self.disk:
            assert capsule_id + SUFFIX in names, f"the file of {capsule_id} is gone"
        for name in self.parts:
            assert name in names
        quarantine = self.root / QUARANTINE
        count = len(os.listdir(quarantine)) if quarantine.is_dir() else 0
        assert count == self.quarantined, f"{count} files in quarantine, expected {self.quarantined}"


def interrupt_id(session: PolicySession) -> str:
    """The interrupt capsule's id ("" when there is none)."""
    capsule = session.episode.interrupt_capsule
    return capsule.id if capsule is not None else ""

def capsule_bytes(session: PolicySession, capsule_id: str) -> bytes:
    """A capsule's bytes, through a loan (the store's way to read them)."""
    with session.parts.store.lend(capsule_id) as loan:
        return loan.copy().numpy().tobytes()


def _diff(before, after) -> str:
    names = ("arena", "episode", "step", "state", "lineage", "interrupt capsule", "store listing", "files")
    out = []
    for name, a, b in zip(names, before, after, strict=True):
        if a != b:
            if name == "store listing":
                out.append(f"  store listing: removed {sorted(set(a) - set(b))}, added {sorted(set(b) - set(a))}")
            elif name == "arena":
                out.append("  arena bytes differ")
            else:
                out.append(f"  {name}: {a!r} -> {b!r}")
    return "\n".join(out)


def test_capsule_state_machine():
    import time
    REPORT.clear()
    start = time.perf_counter()
    run_state_machine_as_test(CapsuleMachine, settings=SETTINGS)
    seconds = time.perf_counter() - start
    rules = sum(v for k, v in REPORT.items() if k.startswith("rule "))
    print(f"\ncapsule state machine: {SETTINGS.max_examples} examples x up to {SETTINGS.stateful_step_count} "
          f"steps in {seconds:.1f} s: {rules} rule executions")
    restores = sum(v for k, v in REPORT.items() if ": restored from " in k or k.startswith(("reset: from", "fork: from",
                                                                                          "load: from")))
    refusals = sum(v for k, v in REPORT.items() if k.startswith("refused "))
    print(f"  outcomes: {restores} restores (memory or file), {REPORT['reenter: recompute fallback']} recompute "
          f"fallbacks, {refusals} refusals")
    for key in sorted(REPORT):
        print(f"  {REPORT[key]:6d}  {key}")


# -- regression tests: the minimal reproducers of the bugs this machine found ---------------------------
def _machine() -> CapsuleMachine:
    machine = CapsuleMachine()
    machine.start()
    return machine


def _feed(session: PolicySession, n: int, seed: int) -> None:
    for row in observations(n, seed):
        session.loop.write_input("joints", row[:4])
        session.loop.write_input("goal", row[4:])
        session.loop.tick()


@pytest.fixture
def machine():
    m = _machine()
    yield m
    m.teardown()


def test_regression_a_refused_persisting_commit_evicts_nothing(machine, monkeypatch):
    """A persisting commit refused before it commits (no room: every slab pinned) loses
    nothing; one whose save fails is committed in memory like any commit (the LRU fork
    makes room, as it would for an in-memory commit) and answers SaveFailed naming it."""
    s = machine.session
    forks = [s.verbs.fork("", label="pinned").id for _ in range(DEVICE_SLABS + HOST_SLABS - 1)]
    for capsule_id in forks:
        s.parts.store.get(capsule_id).pinned = True                 # the root + these fill every slab
    with pytest.raises(ResourceExhausted):
        s.verbs.commit("no room", persist=True)
    assert [f for f in forks if f not in s.parts.store] == [], "a refused commit evicted (lost) a capsule"
    for capsule_id in forks:
        s.parts.store.get(capsule_id).pinned = False
    monkeypatch.setattr(directory_module, "write_capsule", disk_full)
    with pytest.raises(SaveFailed) as failed:
        s.verbs.commit("disk full", persist=True)
    kept = failed.value.capsule
    assert kept.id in s.parts.store and s.episode.lineage == kept.id and kept.path is None
    assert sum(f not in s.parts.store for f in forks) == 1          # the least recently used fork made room


def test_regression_root_capsules_of_two_processes_never_share_an_id(machine):
    s = machine.session
    _feed(s, 3, 1)
    s.verbs.reset()
    first_root = s.parts.recompute.root_id
    s.verbs.save(first_root)
    machine.boot()                                 # crash-restart, same weights, same directory
    s = machine.session
    _feed(s, 3, 2)
    s.verbs.reset()                                      # the same episode number in the new process
    assert s.parts.recompute.root_id != first_root
    mine = capsule_bytes(s, s.parts.recompute.root_id)
    theirs = s.verbs.load(first_root)                    # the old process's root loads as its own capsule
    assert theirs.id == first_root and capsule_bytes(s, first_root) != mine


def test_regression_a_refused_reset_leaves_the_live_state(machine):
    s = machine.session
    _feed(s, 4, 1)
    for _ in range(DEVICE_SLABS + HOST_SLABS - 1):
        s.verbs.commit("pinned", pin=True)               # the root (held) + these: nothing can be evicted
    before = (machine.live(), s.episode.episode_id, s.episode.step, s.episode.lineage)
    with pytest.raises(ResourceExhausted):
        s.verbs.reset()
    assert (machine.live(), s.episode.episode_id, s.episode.step, s.episode.lineage) == before


def test_regression_a_refused_fallback_keeps_the_capsule_entry(machine):
    s = machine.session
    _feed(s, 3, 1)
    capsule = s.verbs.commit("x", persist=True)
    s.parts.store.move(capsule.id, Tier.DISK)            # disk-only entry
    path = machine.path(capsule.id)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    for _ in range(DEVICE_SLABS + HOST_SLABS - 1):
        s.verbs.commit("pinned", pin=True)
    listing = sorted(c.id for c in s.parts.store.list())
    with pytest.raises(ResourceExhausted):
        s.verbs.reenter(capsule.id)
    assert sorted(c.id for c in s.parts.store.list()) == listing


def test_regression_a_reentered_interrupt_capsule_stays_a_held_root(machine):
    s = machine.session
    _feed(s, LOG_STEPS + 1, 1)                     # the episode outgrows the input log
    interrupt = s.verbs.interrupt(commit=True)
    s.verbs.reenter("")                                  # not on the logged timeline: it becomes the root
    assert s.parts.recompute.root_id == interrupt.id
    assert s.parts.store.get(interrupt.id).held, "the new timeline's root is evictable"
