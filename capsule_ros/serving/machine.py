"""The episode state machine: what each verb changes, made under the session's boundary.

Episode states: IDLE (no episode), RUNNING (each tick steps the policy), INTERRUPTED (each
tick hands out the safe action; the state waits at its boundary). A part of
``PolicySession``, with one job: the episode verbs over the capsule set and the recompute
fallback. Every method here runs with the boundary held by its caller (the session,
``capsule_ros.serving.session``, which also does the file reads and the rebuilds outside
it); none takes the boundary or calls back into the session.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from capsule_ros.capsules.store import Capsule, CapsuleStore, Reservation, Tier
from capsule_ros.errors import CapsuleRosError, WrongState
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.runtime.schema import KIND_ORDER, BufferKind
from capsule_ros.serving.capsule_set import CapsuleSet, DirectoryWatch
from capsule_ros.serving.episode import Episode, Events
from capsule_ros.serving.files import Fetched, SaveJob, Source
from capsule_ros.serving.loop import ControlLoop
from capsule_ros.serving.recompute import RebuildJob, Recompute
from capsule_ros.serving.records import EpisodePicture, EpisodeStart, EpisodeState, EventKind, HoldMode, ReenterResult


class EpisodeMachine:
    """See the module docstring."""

    def __init__(self, runtime: PolicyRuntime, store: CapsuleStore, episode: Episode, events: Events,
                 loop: ControlLoop, capsules: CapsuleSet, recompute: Recompute, prefix: Sequence[int],
                 watch: Optional[DirectoryWatch]):
        self._runtime = runtime
        self._store = store
        self._episode = episode
        self._events = events
        self._loop = loop
        self._capsules = capsules
        self._recompute = recompute
        self.prefix = tuple(prefix)
        self._watch = watch
        self._resume_when_served = False        # suspend interrupted the episode

    def picture(self, suspended: str) -> EpisodePicture:
        """The episode now (also without the boundary: a dict lookup for the interrupt capsule)."""
        e = self._episode
        capsule = self._store.find(e.interrupt_capsule_id) if e.interrupt_capsule_id else None
        return EpisodePicture(e.state, e.episode_id, e.step, e.lineage, e.hold_mode, capsule, suspended)

    @property
    def episode_id(self) -> int:
        return self._episode.episode_id

    def require(self, *states: EpisodeState, verb: str) -> None:
        state = self._episode.state
        if state not in states:
            raise WrongState(f"cannot {verb} while {state.name} (allowed in {' / '.join(s.name for s in states)})")

    # -- verbs that change the episode -------------------------------------------------------------
    def commit(self, label: str, pin: bool) -> Capsule:
        self.require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="commit")
        capsule = self._snapshot(label, pinned=pin)
        self._episode.lineage = capsule.id
        self._events.emit(EventKind.COMMIT, capsule, detail=label)
        return capsule

    def start(self, source: Optional[Source]) -> EpisodeStart:
        """A new episode from the initial state or ``source``'s, and its root capsule, with
        room for the root reserved before anything changes."""
        capsule, runtime, episode = source.capsule if source else None, self._runtime, self._episode
        room: Optional[Reservation]
        if source is None:
            room = self._store.reserve()
        else:          # from memory, or straight from its file's bytes (not kept in a pool)
            room = self._store.restore(source.capsule, runtime, data=source.data, reserve=True).room
            runtime.after_restore(source.capsule.mark)
        number = episode.next_episode
        episode.next_episode += 1
        if capsule is None:
            runtime.reset(episode=number)
            if self.prefix:
                runtime.prefill(self.prefix)
            step, lineage = runtime.read_outputs().step, ""
        else:
            runtime.set_episode(number)
            step, lineage = capsule.step, capsule.id
        episode.last_action = runtime.read_outputs().action
        episode.episode_id, episode.step, episode.lineage = number, step, lineage
        self._release_interrupt_capsule()
        root = self._store.snapshot(runtime, label=f"episode {number} start", parent_id=lineage,
                                    episode_id=number, step=step, held=True, into=room)
        self._recompute.start(root)
        self._loop.inputs.reset_ordering()
        episode.state = EpisodeState.RUNNING
        self._events.emit(EventKind.RESET, capsule, detail=f"episode {number}")
        return EpisodeStart(number, capsule)

    def interrupt(self, mode: HoldMode, commit: bool) -> Optional[Capsule]:
        """Stop acting at this boundary (RUNNING), with the boundary capsule if ``commit``;
        the INTERRUPT event carries the hold mode's safe action."""
        capsule = self._snapshot("interrupt", held=True) if commit else None
        self._release_interrupt_capsule()
        episode = self._episode
        if capsule is not None:
            episode.interrupt_capsule_id = episode.lineage = capsule.id
        episode.hold_mode = mode
        episode.state = EpisodeState.INTERRUPTED
        self._events.emit(EventKind.INTERRUPT, capsule, detail=mode.name, action=self._loop.safe_record(mode))
        return capsule

    def suspend(self, mode: HoldMode) -> Optional[Capsule]:
        """The node's deactivate: interrupt a RUNNING episode (committing its capsule), which
        ``resume`` re-enters."""
        self._resume_when_served = self._episode.state == EpisodeState.RUNNING
        return self.interrupt(mode, True) if self._resume_when_served else None

    def resume(self) -> Optional[ReenterResult]:
        """The node's activate: the episode ``suspend`` interrupted resumes (None: none was)."""
        result = None
        if self._resume_when_served and self._episode.state == EpisodeState.INTERRUPTED:
            result = self.resume_interrupted()
        self._resume_when_served = False
        return result

    def resume_interrupted(self) -> ReenterResult:
        """``reenter("")``: the interrupt capsule, or the untouched live state after an
        interrupt without one."""
        episode = self._episode
        if episode.interrupt_capsule_id:          # held: always in memory
            capsule = self._store.get(episode.interrupt_capsule_id)
            seconds = self._store.restore(capsule.id, self._runtime).seconds
            self._runtime.after_restore(capsule.mark)
            return self._resumed(capsule, "", seconds, 0.0)
        if episode.state != EpisodeState.INTERRUPTED:
            raise WrongState(f"reenter without a capsule id needs an interrupt capsule "
                             f"(episode is {episode.state.name})")
        episode.state = EpisodeState.RUNNING     # no capsule: resume the untouched live state
        self._events.emit(EventKind.REENTER, None, detail="resume")
        return ReenterResult(None, False, False, "", 0.0, 0.0)

    def reenter(self, source: Source) -> ReenterResult:
        """Restore ``source``'s capsule (adopting its file's bytes) and resume from it."""
        capsule = self._capsules.in_store(source)
        seconds = self._store.restore(capsule.id, self._runtime,
                                      count_as=Tier.DISK if source.data is not None else None).seconds
        self._runtime.after_restore(capsule.mark)
        return self._resumed(capsule, "", seconds, 0.0)

    def adopt(self, capsule_id: str, job: RebuildJob, cause: CapsuleRosError, seconds: float) -> ReenterResult:
        """The recompute fallback's rebuilt state becomes the capsule, and the live state."""
        capsule = self._recompute.adopt(capsule_id, job, cause, seconds)
        self._loop.counters.fallback_recomputes += 1
        self._store.restore(capsule.id, self._runtime)
        self._runtime.after_restore(capsule.mark)
        return self._resumed(capsule, str(cause), 0.0, seconds)

    def fork_live(self, label: str) -> Capsule:
        self.require(EpisodeState.RUNNING, EpisodeState.INTERRUPTED, verb="fork the live state")
        capsule = self._snapshot(label)
        self._events.emit(EventKind.FORK, capsule, detail=label)
        return capsule

    def fork(self, source: Source, label: str) -> Capsule:
        parent = self._capsules.in_store(source)
        capsule = self._store.fork(parent.id, label=label)
        self._recompute.remember(capsule, like=parent.id)
        self._events.emit(EventKind.FORK, capsule, detail=label)
        return capsule

    def snapshot_live(self, label: str) -> Capsule:
        """A held capsule of the live state (an ablation's, dropped after it)."""
        e = self._episode
        return self._store.snapshot(self._runtime, label=label, episode_id=e.episode_id, step=e.step, held=True)

    def restore_kinds(self, capsule_id: str, only: Sequence[BufferKind]) -> None:
        """Put back every buffer kind but ``only`` from a capsule (an ablation's live state)."""
        mark = self._store.get(capsule_id).mark
        for kinds in _runs_without(only):
            self._store.restore(capsule_id, self._runtime, kinds=kinds)
            self._runtime.after_restore(mark, kinds)

    def release(self) -> None:
        self._episode.state = EpisodeState.IDLE

    # -- verbs on the capsule set (they leave the live state alone) --------------------------------
    def drop(self, capsule_id: str, from_disk: bool, has_file: bool) -> None:
        episode = self._episode
        if episode.state == EpisodeState.INTERRUPTED and capsule_id == episode.interrupt_capsule_id:
            raise WrongState(f"capsule {capsule_id!r} is the interrupt capsule: re-enter or reset first")
        capsule = self._capsules.drop(capsule_id, from_disk, has_file)
        if from_disk and self._watch is not None:
            self._watch.removed(capsule_id)
        self._events.emit(EventKind.DROP, capsule, capsule_id=capsule_id,
                          detail="memory and disk" if from_disk else "memory")

    def loaded(self, fetched: Fetched) -> Capsule:
        """A capsule file read outside the boundary, now in memory (or its typed error)."""
        capsule = self._capsules.in_store(self._capsules.reader.raise_error(fetched))
        self._events.emit(EventKind.LOAD, capsule, detail=capsule.path or "")
        return capsule

    def saved(self, job: SaveJob, path: str) -> None:
        """A save's file is written: its loan ends, the capsule knows its file."""
        self._capsules.require_saver().end(job)
        job.capsule.path = path
        if self._watch is not None:
            self._watch.saved(job.capsule.id, job.written)
        self._events.emit(EventKind.SAVE, job.capsule, detail=path)

    # -- internals -------------------------------------------------------------------------------
    def _snapshot(self, label: str, pinned: bool = False, held: bool = False) -> Capsule:
        e = self._episode
        capsule = self._store.snapshot(self._runtime, label=label, parent_id=e.lineage, episode_id=e.episode_id,
                                       step=e.step, pinned=pinned, held=held)
        self._recompute.remember(capsule)
        return capsule

    def _resumed(self, capsule: Capsule, fallback_reason: str, restore_s: float, recompute_s: float) -> ReenterResult:
        """After the live state became ``capsule``'s: log, state, event."""
        episode = self._episode
        rollback = capsule.episode_id == episode.episode_id and capsule.step < episode.step
        self._release_interrupt_capsule()      # a later reenter("") needs a new interrupt
        self._recompute.resumed_at(capsule)
        episode.last_action = self._runtime.read_outputs().action    # HOLD_LAST holds the capsule's action
        episode.episode_id, episode.step, episode.lineage = capsule.episode_id, capsule.step, capsule.id
        episode.next_episode = max(episode.next_episode, capsule.episode_id + 1)
        episode.state = EpisodeState.RUNNING
        self._events.emit(EventKind.REENTER, capsule, rollback=rollback, fallback=bool(fallback_reason),
                          detail=fallback_reason)
        return ReenterResult(capsule, rollback, bool(fallback_reason), fallback_reason, restore_s, recompute_s)

    def _release_interrupt_capsule(self) -> None:
        episode = self._episode
        if episode.interrupt_capsule_id:
            if episode.interrupt_capsule_id != self._recompute.root_id:   # a log root stays held
                self._store.hold(episode.interrupt_capsule_id, False)
            episode.interrupt_capsule_id = ""


def _runs_without(kinds: Sequence[BufferKind]) -> List[Tuple[BufferKind, ...]]:
    """The buffer kinds not in ``kinds``, as runs contiguous in the arena's layout order."""
    runs: List[List[BufferKind]] = [[]]
    for kind in KIND_ORDER:
        if kind in kinds:
            runs.append([])
        else:
            runs[-1].append(kind)
    return [tuple(run) for run in runs if run]
