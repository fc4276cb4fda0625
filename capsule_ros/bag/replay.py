"""The replay engine behind ``capsule-ros replay`` (``capsule_ros.cli.replay_cmd``): drive
the recorded policy step by step from a bag's sensor messages and compare every action
with the recorded one, bit for bit.

Steps follow the bag, never the wall clock: in trigger mode the policy steps on each
trigger-port message; a timer-mode bag (in-process only) steps where the node acted.
Capsule events are re-enacted where they took effect (``capsule_ros.bag.schedule``):
COMMIT commits (recorded capsule ids map to the replay's), REENTER re-enters the mapped
capsule, RESET resets, INTERRUPT interrupts with the recorded hold mode, FORK and DROP
as recorded, LOAD reads a capsule file the bag did not make; SAVE and EVICT change
nothing a replay can check. CLOCK_JUMP (the node's clock went back, e.g. a looping bag's
/clock) makes the in-process target's clock jump there too, so its ports take and drop
the stamps after it as the node's did.

Verification needs a known starting state, an *anchor*: the initial state (the bag's
first action is step 1 of a fresh scan), a RESET, a REENTER into a capsule the bag
committed or whose file is in the capsule directory, or ``--from-capsule ID`` (the
saved capsule, re-entered where the bag committed it). The verdict's *scope* runs from
the first anchor to the end of the bag: recorded actions before it are reported as
before the anchor; an in-scope action that could not be compared (the replay lost its
anchor, e.g. a re-entry into a capsule it does not have) is *skipped*.

Recorded safe actions of steps that missed their deadline (or failed) are re-enacted,
not skipped: in process the replay tells the session the step was late and compares the
safe action it then hands out (through ``--node`` that cannot be done: they are skipped).
A recording stopped between a step's input and its action ends with an input whose
action was never recorded: the replay's action for it is reported as the recording's
end, not as a divergence.

Exit status: 0 every recorded action in scope was compared and is bit-identical (with
``--partial``: every compared one); 1 a divergence (with ``--verify``; without it the
table is printed and the status is 0); 3 no divergence, but some in-scope actions were
skipped (with ``--verify`` and without ``--partial``); 2 the bag is bad (unreadable,
truncated, garbled, missing topics or config), the replay cannot start, or nothing
could be verified; always with a one-line reason and no traceback.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import enum
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional, Tuple

from capsule_ros.bag.ablation import ABLATIONS
from capsule_ros.bag.errors import ReplaySetupError
from capsule_ros.bag.reader import (
    EVENT,
    SENSOR,
    ActionInfo,
    BagScan,
    Entry,
    RecordedEvent,
    Recording,
    capsule_id_position,
)
from capsule_ros.bag.schedule import Scheduler, stream_key
from capsule_ros.bag.targets import InProcessTarget, ReplayTarget
from capsule_ros.bag.verdict import Act, Divergence, Verdict, differences, max_abs_diff
from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.errors import CapsuleRosError
from capsule_ros.runtime import numerics
from capsule_ros.runtime.schema import BufferKind
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.records import ActionSource, EventKind, HoldMode, clock_jump_delta
from capsule_ros.serving.verbs import VERBS


@dataclass(frozen=True)
class ReplayOptions:
    """What ``capsule-ros replay`` was asked to do."""

    from_capsule: str = ""
    node: bool = False
    params_file: Optional[Path] = None
    capsule_dir: Optional[Path] = None
    ablation: str = ""
    timeout_s: float = 60.0
    partial: bool = False               # a verdict that skipped actions is acceptable


@dataclass
class _Pending:
    """A replayed action waiting for its recorded counterpart."""

    act: Act
    tick: int                       # the replay's tick count when it was made
    port: str
    time: int = -1                  # log time of the message that made it
    inputs: List[str] = field(default_factory=list)


def starts_initial(scan: BagScan) -> bool:
    """Whether the bag's first action is the first step from an initial state (and no
    RESET / REENTER came before it): then the replay's fresh state is the anchor."""
    first_state_event = next((e.time for e in scan.events if e.kind in (EventKind.RESET, EventKind.REENTER)),
                             None)
    first = scan.actions[0] if scan.actions else None
    return (first is not None and (first_state_event is None or first.time < first_state_event)
            and first.step == 1 and first.lineage == "" and first.source == ActionSource.POLICY)


class Anchor(enum.Enum):
    """What the replay knows of the target's state (the module docstring's *anchor*)."""

    NONE = "none"                                  # no anchor yet: recorded actions are before the anchor
    AFTER_INITIAL_INPUTS = "after initial inputs"  # the initial state, once the recording's initial inputs are in
    HELD = "held"                                  # the target's state is the recording's: actions are compared
    LOST = "lost"                                  # verification paused until the next anchor: actions are skipped


class Replayer:
    """Replays one opened recording on one target (see the module docstring)."""

    def __init__(self, recording: Recording, target: ReplayTarget, options: ReplayOptions):
        self.recording = recording
        self.target = target
        self.options = options
        self.verdict = Verdict(bag=str(recording.path), storage=recording.storage, target=target.kind,
                               mode=recording.config.control.mode, messages=recording.scan().messages,
                               fingerprint_recorded=recording.meta.fingerprint, fingerprint_replay=target.fingerprint,
                               versions_recorded=dict(recording.meta.versions))
        self._scan = recording.scan()
        self._mode = recording.config.control.mode
        self._trigger = recording.config.control.trigger_port
        self._anchor = Anchor.NONE
        self._recorded_hold: Optional[HoldMode] = None   # the recording is interrupted, with this hold mode
        self._hold_unknown = False                 # a skipped deadline miss: the node's HOLD values are unknown
        self._capsules: Dict[str, str] = {}        # recorded capsule id -> the replay's
        self._episodes: Dict[int, int] = {}        # recorded episode id -> the replay's
        self._fifo: Deque[_Pending] = collections.deque()
        self._ticks = 0
        self._sensors_seen = 0
        self._inputs: List[str] = []               # ports with messages since the last step
        self._action_times = [a.time for a in self._scan.actions]
        self._handlers: Dict[EventKind, Callable[[RecordedEvent], bool]] = {
            verb.event: getattr(self, f"_{verb.name}") for verb in VERBS if verb.replayed and verb.event is not None}
        self._handlers[EventKind.CLOCK_JUMP] = self._clock_jump          # the node's clock, not a verb

    # -- driving -----------------------------------------------------------------------------------
    def run(self) -> Verdict:
        start = time.perf_counter()
        self._initial_anchor()
        schedule = iter(Scheduler(self._scan, self._mode).schedule())
        pending = next(schedule, None)
        for entry in self.recording.entries():
            if entry.kind == EVENT:
                continue                            # events come from the schedule
            key = stream_key(entry.time)
            while pending is not None and pending[0] < key:
                self._apply(pending[1])
                pending = next(schedule, None)
            if entry.kind == SENSOR:
                self._sensor(entry)
            else:
                self._action(entry)
        while pending is not None:
            self._apply(pending[1])
            pending = next(schedule, None)
        # What is left answers the last ticks (``_flush_stale`` leaves none older): their inputs
        # were recorded and the recording stopped before their actions. The last recorded action
        # may answer an earlier trigger and still come after theirs: a fleet steps a robot's
        # waiting request when its next message comes, so the bag can end trigger, trigger,
        # action of the first.
        self.verdict.steps_unrecorded += len(self._fifo)
        self._fifo.clear()
        if self.verdict.steps_unrecorded:
            self.verdict.notes.append(f"the recording ended before the action of its last "
                                      f"{self.verdict.steps_unrecorded} "
                                      "input(s): not compared")
        self.verdict.seconds = time.perf_counter() - start
        self._version_notes()
        return self.verdict

    # -- the anchor ------------------------------------------------------------------------------
    def _move(self, to: Anchor, why: str = "") -> None:
        """Every change of the anchor: HELD (``why``: where; the verdict's start, the first
        time), LOST (``why``: the reason, noted; only an anchor that was held is lost), or
        AFTER_INITIAL_INPUTS (from NONE). Pending replayed actions go when it is lost."""
        if to is Anchor.HELD:
            if self._anchor is not Anchor.HELD and self.verdict.start == "bag start":
                self.verdict.start = why
            self._anchor = Anchor.HELD
        elif to is Anchor.LOST:
            if self._anchor is Anchor.HELD:
                self.verdict.notes.append(f"verification paused (the actions until the next anchor are skipped): "
                                          f"{why}")
                self._anchor = Anchor.LOST
            self._fifo.clear()
        elif to is Anchor.AFTER_INITIAL_INPUTS and self._anchor is Anchor.NONE:
            self._anchor = to

    def _initial_anchor(self) -> None:
        option = self.options.from_capsule
        if option:
            known = {e.capsule_id for e in self._scan.events
                     if e.kind in (EventKind.COMMIT, EventKind.REENTER, EventKind.RESET)}
            if option not in known:
                raise ReplaySetupError(f"--from-capsule {option}: the bag never commits, re-enters or resets to it "
                                       f"(capsules in the bag: {sorted(c for c in known if c) or 'none'})")
            return
        if starts_initial(self._scan):
            if self.recording.meta.initial_inputs and not self.target.stages_without_stepping:
                self._move(Anchor.AFTER_INITIAL_INPUTS)     # see _sensor
                return
            if not self.recording.config.control.autostart:
                self.target.reset("")
            self._move(Anchor.HELD, "the initial state")

    def _anchor_at_initial_state(self) -> None:
        """After the inputs' state at the start went to a target that steps on every trigger
        message (a node): those steps are not the recording's, so start over from the initial
        state with the inputs staged."""
        self.target.settle()
        self.target.reset("")
        self._move(Anchor.HELD, "the initial state")

    def _settle(self) -> None:
        """Before a new anchor: what a node still publishes from unverified steps is dropped."""
        if self._anchor is not Anchor.HELD:
            self.target.settle()
            self._fifo.clear()

    # -- lateness ----------------------------------------------------------------------------------
    def _recorded_miss(self, source: int) -> bool:
        """Whether a recorded action of ``source`` is a faulted step's safe action: the
        recording published a safe action for a step although it was not interrupted (the
        step missed its deadline, or failed, there)."""
        return source != ActionSource.POLICY and self._recorded_hold is None

    def _late(self, source: Optional[int]) -> bool:
        """Whether the target must re-enact a recorded miss at the step whose recorded action
        has ``source`` (None: no action recorded); the in-process target does, so the safe
        action it hands out can be compared."""
        return source is not None and self._recorded_miss(source) and self.target.reenacts_deadline_misses

    # -- the message stream ------------------------------------------------------------------------
    def _sensor(self, entry: Entry) -> None:
        try:
            msg = self.recording.decode(entry)
        except Exception:  # noqa: BLE001 - the node drops undecodable messages the same way
            msg = None
        self._inputs.append(entry.port)
        self._sensors_seen += 1
        initial = self._sensors_seen <= self.recording.meta.initial_inputs   # the inputs' state at the start
        if self._anchor is not Anchor.HELD or initial:
            self.target.feed(entry.port, entry.data, msg, tick=False, log_ns=entry.time)   # not verified
            if self._anchor is Anchor.AFTER_INITIAL_INPUTS and \
                    self._sensors_seen == self.recording.meta.initial_inputs:
                self._anchor_at_initial_state()
            return
        tick = self._mode == "trigger" and entry.port == self._trigger
        late = False
        if tick:
            self._flush_stale()
            self._ticks += 1
            action = self._next_action(entry.time)
            late = self._late(action.source if action is not None else None)
        acts = self.target.feed(entry.port, entry.data, msg, tick=tick, expect=tick and self._expects(entry.time),
                                log_ns=entry.time, late=late)
        self._queue(acts, entry.port, entry.time)

    def _queue(self, acts: List[Act], port: str, time_ns: int = -1) -> None:
        for act in acts:
            self._fifo.append(_Pending(act, self._ticks, port, time_ns, list(dict.fromkeys(self._inputs))))
        if acts:
            self._inputs = []

    def _next_action(self, t: int) -> Optional[ActionInfo]:
        """The first recorded action after log time ``t`` (None at the end)."""
        i = bisect.bisect_right(self._action_times, t)
        return self._scan.actions[i] if i < len(self._scan.actions) else None

    def _expects(self, t: int) -> bool:
        """Whether the recording has an action after the trigger at ``t`` and before the next one."""
        i = bisect.bisect_right(self._action_times, t)
        if i >= len(self._action_times):
            return False
        triggers = self._scan.trigger_times
        j = bisect.bisect_right(triggers, t)
        return j >= len(triggers) or self._action_times[i] < triggers[j]

    def _flush_stale(self) -> None:
        """A replayed action two steps old that nothing recorded matched: the replay acted
        where the recording did not."""
        while self._fifo and self._fifo[0].tick <= self._ticks - 1:
            self._diverge("extra", self._fifo.popleft(), None, detail="the replay acted where the recording did not")

    def _action(self, entry: Entry) -> None:
        """A recorded action: compared with the replayed action it answers (or counted as
        not verified, missing, or a fault the target could not re-enact)."""
        recorded = Act.of_msg(self.recording.decode_own(entry))
        if self._anchor is not Anchor.HELD:
            if self._anchor is Anchor.LOST:
                self.verdict.steps_skipped += 1
            else:
                self.verdict.steps_before_anchor += 1
            return
        if not self._fifo and self._mode == "timer":
            self._ticks += 1
            late = self._late(recorded.source)
            self._queue(self.target.step(late=late, log_ns=entry.time), self._inputs[-1] if self._inputs else "",
                        entry.time)
        if not self._fifo:
            missing = self.target.missing_inputs()
            self._diverge("missing", None, recorded, entry=entry,
                          detail="the recording acted where the replay did not" + (
                              f"; the bag gave no value before this step for input(s) {missing} (recording started "
                              "after they were sent?)" if missing else ""))
            return
        pending = self._fifo.popleft()
        if not self._unreenacted_fault(recorded, pending.act):
            self._compare(pending, recorded, entry)

    def _unreenacted_fault(self, recorded: Act, replayed: Act) -> bool:
        """Count a recorded miss; True (the step is skipped) when the target could not
        re-enact it (a node decides lateness by its own clock), and for the HOLD actions
        after it, which held values the node replaced with the late step's."""
        if self._recorded_miss(recorded.source):
            self.verdict.deadline_misses += 1
            if replayed.source == ActionSource.POLICY and recorded.step in (replayed.step - 1, replayed.step):
                self.verdict.steps_skipped += 1
                self._hold_unknown = True
                return True
        if self._hold_unknown and recorded.source == ActionSource.HOLD:
            self.verdict.steps_skipped += 1
            return True
        if recorded.source == ActionSource.POLICY:
            self._hold_unknown = False
        return False

    def _compare(self, pending: _Pending, recorded: Act, entry: Entry) -> None:
        replayed = pending.act
        episode = self._episodes.setdefault(recorded.episode, replayed.episode)
        lineage = self._capsules.get(recorded.lineage) if recorded.lineage else ""
        diffs = differences(recorded, replayed, episode, lineage)
        if diffs:
            self._diverge("/".join(diffs), pending, recorded, entry=entry)
        else:
            self.verdict.steps_compared += 1
            self.verdict.steps_matched += 1

    def _diverge(self, what: str, pending: Optional[_Pending], recorded: Optional[Act], *,
                 entry: Optional[Entry] = None, detail: str = "") -> None:
        """Count a compared step that differs; keep the first one's details."""
        self.verdict.steps_compared += 1
        self.verdict.steps_diverged += 1
        if self.verdict.first_divergence is not None:
            return
        replayed = pending.act if pending else None
        ref = recorded or replayed
        diff = None
        if recorded is not None and replayed is not None:
            diff = max(max_abs_diff(recorded.values, replayed.values), max_abs_diff(recorded.chunk, replayed.chunk))
        self.verdict.first_divergence = Divergence(
            what=what, step=ref.step if ref else -1, episode=ref.episode if ref else -1,
            bag_index=entry.index if entry else -1, time_ns=entry.time if entry else -1,
            port=pending.port if pending else (self._inputs[-1] if self._inputs else ""),
            inputs=pending.inputs if pending else list(dict.fromkeys(self._inputs)), max_abs_diff=diff,
            recorded=recorded.brief() if recorded else "", replayed=replayed.brief() if replayed else "",
            detail=detail)

    # -- capsule events: one handler per replayed verb (capsule_ros.serving.verbs) ---------------------
    def _apply(self, event: RecordedEvent) -> None:
        handler = self._handlers.get(event.kind)
        applied = False
        try:
            applied = handler(event) if handler is not None else False
        except CapsuleRosError as exc:
            if event.kind in (EventKind.REENTER, EventKind.RESET):
                self._move(Anchor.LOST, f"{event.kind.name} {event.capsule_id} failed in the replay")
            self._capsules.pop(event.capsule_id, None)
            self._event_divergence(event, f"{event.kind.name} {event.capsule_id or ''} was refused by the "
                                          f"replay: {exc}")
        counts = self.verdict.events_replayed if applied else self.verdict.events_skipped
        counts[event.kind.name] = counts.get(event.kind.name, 0) + 1

    def _event_divergence(self, event: RecordedEvent, detail: str) -> None:
        if self.verdict.first_divergence is None:
            self.verdict.first_divergence = Divergence(
                what="event", step=event.step, episode=event.episode, bag_index=event.index, time_ns=event.time,
                port=self._inputs[-1] if self._inputs else "", inputs=list(dict.fromkeys(self._inputs)),
                detail=detail)

    def _commit(self, event: RecordedEvent) -> bool:
        if self._anchor is not Anchor.HELD:
            self._capsules.pop(event.capsule_id, None)
            if event.capsule_id == self.options.from_capsule:
                return self._anchor_from_capsule(event)
            return False
        self._capsules[event.capsule_id] = self.target.commit(event.detail)
        return True

    def _interrupt(self, event: RecordedEvent) -> bool:
        try:
            mode = HoldMode[event.detail]
        except KeyError:
            mode = HoldMode.HOLD_LAST
        self._recorded_hold = mode
        if self._anchor is not Anchor.HELD:
            self._capsules.pop(event.capsule_id, None)
            return False
        capsule_id, acts = self.target.interrupt(mode, bool(event.capsule_id))
        if event.capsule_id:
            self._capsules[event.capsule_id] = capsule_id
        self._queue(acts, "(interrupt)")
        return True

    def _enters(self, event: RecordedEvent) -> Optional[str]:
        """The replay's id of the capsule a REENTER / RESET enters, or None if it has none.
        Before the anchor of ``--from-capsule`` only that capsule anchors."""
        option = self.options.from_capsule
        if option and self._anchor is not Anchor.HELD and event.capsule_id != option:
            return None
        return self._resolve(event.capsule_id)

    def _reenter(self, event: RecordedEvent) -> bool:
        self._recorded_hold = None
        if not event.capsule_id:                    # resume after an interrupt without a capsule
            if self._anchor is Anchor.HELD:
                self.target.reenter("")
            return self._anchor is Anchor.HELD
        target_id = self._enters(event)
        if target_id is None:
            self._move(Anchor.LOST, f"REENTER {event.capsule_id}: the replay has no such capsule (not committed "
                                    "while verifying, no capsule file)")
            return False
        self._settle()
        episode = self.target.reenter(target_id)
        if episode is not None:
            self._episodes[event.episode] = episode
        self._move(Anchor.HELD, f"capsule {event.capsule_id} (REENTER)")
        return True

    def _reset(self, event: RecordedEvent) -> bool:
        self._recorded_hold = None
        if self.options.from_capsule and self._anchor is not Anchor.HELD \
                and event.capsule_id != self.options.from_capsule:
            return False
        target_id = self._enters(event) if event.capsule_id else ""
        if target_id is None:
            self._move(Anchor.LOST, f"RESET to {event.capsule_id}: the replay has no such capsule")
            return False
        self._settle()
        self._episodes[event.episode] = self.target.reset(target_id)
        self._move(Anchor.HELD, f"a reset to {event.capsule_id or 'the initial state'}")
        return True

    def _fork(self, event: RecordedEvent) -> bool:
        if self._anchor is not Anchor.HELD:
            self._capsules.pop(event.capsule_id, None)
            return False
        parent = self._capsules.get(event.parent_id)
        made = capsule_id_position(event.capsule_id)
        of_capsule = parent is not None and (made is None or made == capsule_id_position(event.parent_id))
        self._capsules[event.capsule_id] = self.target.fork(parent if of_capsule and parent else "", event.detail)
        return True

    def _drop(self, event: RecordedEvent) -> bool:
        """A drop from memory only keeps the replay's copy: the recording may load the
        capsule's file again, and the replay writes no files."""
        if event.capsule_id not in self._capsules or event.detail == "memory":
            return event.capsule_id in self._capsules
        replay_id = self._capsules.pop(event.capsule_id)
        with contextlib.suppress(CapsuleRosError):   # e.g. evicted here: nothing to drop
            self.target.drop(replay_id)
        return True

    def _clock_jump(self, event: RecordedEvent) -> bool:
        """The node's clock jumped here (a looping bag's /clock): the target's clock jumps
        too, so its ports take and drop what the node's did. A target that cannot make its
        clock jump (a node: its own clock) would drop the next stamps as out of order: the
        verification pauses until the next anchor."""
        if self.target.clock_jump(clock_jump_delta(event.detail), event.time):
            return True
        self._move(Anchor.LOST, f"the recorded node's clock jumped ({event.detail}); {self.target.kind} keeps its "
                                "own clock (replay in process to verify across clock jumps)")
        return False

    def _load(self, event: RecordedEvent) -> bool:
        try:
            return self._resolve(event.capsule_id) is not None
        except CapsuleRosError:
            return False

    def _resolve(self, capsule_id: str) -> Optional[str]:
        """Map a recorded capsule id: committed by the replay, or read from its file."""
        if capsule_id in self._capsules:
            return self._capsules[capsule_id]
        if self.target.has(capsule_id):
            self._capsules[capsule_id] = capsule_id
            return capsule_id
        if self.target.directory is None or not self.target.directory.exists(capsule_id):
            return None
        self.target.load(capsule_id)
        self._capsules[capsule_id] = capsule_id
        return capsule_id

    def _anchor_from_capsule(self, event: RecordedEvent) -> bool:
        """``--from-capsule``: the saved capsule, re-entered where the bag committed it."""
        self._settle()
        capsule_id = event.capsule_id
        try:
            self.target.load(capsule_id)
        except CapsuleRosError as exc:
            raise ReplaySetupError(f"--from-capsule {capsule_id}: {exc}") from None
        episode = self.target.reenter(capsule_id)
        if episode is not None:
            self._episodes[event.episode] = episode
        self._capsules[capsule_id] = capsule_id
        if self._recorded_hold is not None:          # the recording was interrupted at that point
            self.target.interrupt(self._recorded_hold, False)
            self.target.settle()
        self._move(Anchor.HELD, f"capsule {capsule_id} (--from-capsule, step {event.boundary_step})")
        return True

    def _version_notes(self) -> None:
        from capsule_ros.bag.metadata import runtime_versions
        v = self.verdict
        if v.fingerprint_recorded and v.fingerprint_recorded != v.fingerprint_replay:
            v.notes.append("the replay's graph fingerprint differs from the recording's (weights, shapes, dtype or "
                           "device kind): bit-identity is not expected")
        here = runtime_versions()
        changed = [f"{k} {v.versions_recorded[k]} -> {here.get(k)}" for k in ("torch", "cpu_capability")
                   if k in v.versions_recorded and v.versions_recorded[k] != here.get(k)]
        if changed:
            v.notes.append("recorded on another build (" + ", ".join(changed) + "): bit-identity is promised on "
                           "the same device, build and config")
        if v.numerics_recorded.startswith(numerics.NATIVE) and v.numerics_recorded != v.numerics_replay:
            v.notes.append(f"recorded without a CPU numerics pin ({v.numerics_recorded}) and replayed at "
                           f"{v.numerics_replay}: bit-identity holds only at the same level; record with "
                           "runtime.numerics: portable (docs/rosbag-replay.md#portable-recordings)")


# -- library entry point ------------------------------------------------------------------------------

def replay_bag(bag, options: ReplayOptions = ReplayOptions(), node_target=None, fleet_target=None) -> Verdict:
    """Replay ``bag`` and return the verdict (raises BagError subclasses). With
    ``options.node``, ``node_target`` makes the policy_node target (the bag layer has no
    ROS: ``capsule_ros.ros.replay_target.NodeTarget``, as ``capsule-ros replay --node`` passes).
    A fleet robot's bag (``RecordingMeta.fleet``) replays in-process on ``fleet_target``
    (``capsule_ros.fleet.replay.FleetRobotTarget``: at the fleet's shape)."""
    from capsule_ros.serving.factory import capsule_directory_path
    config = None
    if options.params_file is not None:
        try:
            config = ServingConfig.from_file(Path(options.params_file))
        except CapsuleRosError as exc:
            raise ReplaySetupError(f"--params-file: {exc}") from None
    ablation: Tuple[BufferKind, ...] = ()
    if options.ablation:
        if options.ablation not in ABLATIONS:
            raise ReplaySetupError(f"--ablation {options.ablation!r}: one of {sorted(ABLATIONS)}")
        if options.node:
            raise ReplaySetupError("--ablation runs in-process (it changes what a re-entry restores)")
        ablation = ABLATIONS[options.ablation]
    with Recording(bag, config) as recording:
        cfg, level = _at_recorded_numerics(recording)
        if options.node and cfg.control.mode != "trigger":
            raise ReplaySetupError("this bag was recorded in timer mode: its steps followed the wall clock; "
                                   "replay it in-process (the default), which steps where the node acted")
        if options.node and node_target is None:
            raise ReplaySetupError("--node needs ROS 2: replay through capsule_ros.cli.replay_cmd")
        directory = options.capsule_dir or (capsule_directory_path(cfg.capsules.directory, recording.meta.node)
                                            if cfg.capsules.directory else None)
        try:
            capsule_dir = CapsuleDirectory(directory, key_file=cfg.capsules.key_file, read_only=True,
                                           max_file_bytes=int(cfg.capsules.max_file_mb * 2**20)) if directory else None
        except CapsuleRosError as exc:
            raise ReplaySetupError(f"capsule directory {directory}: {exc}") from None
        recording.scan()                            # a bad bag fails before anything starts
        fleet = recording.meta.fleet
        if fleet and (options.node or fleet_target is None):
            raise ReplaySetupError(f"this bag was recorded for robot {fleet.get('robot')!r} of a fleet of "
                                   f"{fleet.get('slots')} slots ({fleet.get('batching')}): it replays in-process at "
                                   "the fleet's shape (capsule-ros replay; capsule_ros.fleet.replay)")
        with contextlib.ExitStack() as stack:
            if fleet:
                target = stack.enter_context(fleet_target(cfg, fleet, capsule_dir, ablation))
            elif options.node:
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="capsule_replay_")))
                target = stack.enter_context(node_target(cfg, capsule_dir, workdir, options.timeout_s))
            else:
                target = stack.enter_context(InProcessTarget(cfg, capsule_dir, ablation))
            replayer = Replayer(recording, target, options)
            replayer.verdict.numerics_recorded, replayer.verdict.numerics_replay = recording.meta.numerics, level
            replayer.verdict.topics_ignored = [t.describe() for t in recording.ignored]
            verdict = replayer.run()
            if options.ablation:
                verdict.target += f" (ablation: re-entry restores only {options.ablation})"
            return verdict


def _at_recorded_numerics(recording: Recording) -> Tuple[ServingConfig, str]:
    """The recording's config at the CPU numerics level it was recorded at, pinned in this
    process (``capsule_ros.runtime.numerics``), and the level the replay records; a
    ReplaySetupError says why when this machine (or this process) cannot run it. A bag
    of capsule_ros from before the level ran unpinned (native); a foreign bag replays at
    the level of the config it is given."""
    cfg = recording.config
    recorded = recording.meta.numerics
    try:
        if recorded or recording.has_own_metadata:
            cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime,
                                                                       numerics=numerics.replay_setting(recorded)))
        numerics.pin(cfg.runtime.numerics)
    except CapsuleRosError as exc:
        raise ReplaySetupError(f"the bag was recorded at CPU numerics level {recorded or 'native'}: {exc}") from None
    return cfg, numerics.recorded_level(cfg.runtime.numerics)
