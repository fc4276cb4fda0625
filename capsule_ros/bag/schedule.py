"""Where each recorded capsule event applies in the replayed message stream.

The node records a sensor message before it steps on it, and its services change the
state between steps under the session's boundary lock, from other threads. So an
event's position in the bag can differ from the step boundary where it took effect:

- a step may start after its trigger message was recorded but after a service changed
  the state too (bag: trigger, event, action; the event came first);
- ``commit`` snapshots at one boundary and publishes its COMMIT event after saving the
  capsule, possibly after more steps ran (bag: action s, trigger, action s+1, COMMIT of
  a capsule of step s).

The replay steps when it reads a trigger message (timer mode: when it reads an action),
so each event gets a ``Slot`` just before, at, or just after a stream message, chosen
from what the recorded actions show: the step a COMMIT's capsule holds, and whether the
action after an INTERRUPT / REENTER / RESET is the one that follows from it. Events
that change no state (DROP, SAVE, LOAD, EVICT) and FORK stay where they were recorded.
"""
from __future__ import annotations

import bisect
from typing import List, NamedTuple, Optional, Sequence, Tuple

from capsule_ros.bag.reader import ActionInfo, BagScan, RecordedEvent, capsule_id_position
from capsule_ros.serving.records import ActionSource, EventKind

BEFORE, AT, AFTER = -1, 0, 1
SEGMENT_KINDS = (EventKind.REENTER, EventKind.RESET)     # events that replace the state


class Slot(NamedTuple):
    """Just before (-1), at (0) or just after (+1) the stream message at ``time``; ``order``
    keeps the recorded order among events in one slot. Stream messages sort as
    ``(time, 0, -1)`` (``stream_key``)."""

    time: int
    side: int
    order: int


def stream_key(time: int) -> Tuple[int, int, int]:
    return (time, AT, -1)


def _first_after(times: Sequence[int], t: int) -> Optional[int]:
    i = bisect.bisect_right(times, t)
    return times[i] if i < len(times) else None


def _last_before(times: Sequence[int], t: int) -> Optional[int]:
    i = bisect.bisect_left(times, t)
    return times[i - 1] if i > 0 else None


def _follows(action: ActionInfo, event: RecordedEvent) -> bool:
    """Whether ``action`` is the first step after ``event`` took effect."""
    if event.kind == EventKind.INTERRUPT:
        return action.source != ActionSource.POLICY
    return (action.lineage == event.capsule_id and action.step == event.step + 1
            and action.episode == event.episode)


class Scheduler:
    """Computes the slot of every event of a scan (see the module docstring)."""

    def __init__(self, scan: BagScan, mode: str):
        self.scan = scan
        self.action_times = [a.time for a in scan.actions]
        self.event_times = [e.time for e in scan.events]
        # when the replay steps: at trigger messages, or (timer mode) at recorded actions
        self.ticks = scan.trigger_times if mode == "trigger" else self.action_times
        self.mode = mode

    def schedule(self) -> List[Tuple[Slot, RecordedEvent]]:
        out: List[Tuple[Slot, RecordedEvent]] = []
        segment_start: Optional[RecordedEvent] = None
        previous = Slot(-1, BEFORE, -1)
        for event in self.scan.events:
            own = Slot(event.time, AT, event.index)
            slot = own
            if event.kind == EventKind.COMMIT:
                slot = self._commit_slot(event, segment_start) or own
            elif event.kind in (EventKind.INTERRUPT, EventKind.RESET) or (
                    event.kind == EventKind.REENTER and event.capsule_id):     # not a plain resume
                slot = self._race_slot(event) or own
            if slot <= previous:             # never reorder events among themselves
                slot = own if own > previous else Slot(previous.time, previous.side, event.index)
            out.append((slot, event))
            previous = slot
            if event.kind in SEGMENT_KINDS:
                segment_start = event
        return out

    def _commit_slot(self, event: RecordedEvent, segment_start: Optional[RecordedEvent]) -> Optional[Slot]:
        """Just before the first step after the boundary the capsule was taken at."""
        position = capsule_id_position(event.capsule_id)
        episode, step = position if position else (event.episode, event.step)
        since = segment_start.time if segment_start else -1
        boundary = None
        i = bisect.bisect_left(self.action_times, event.time) - 1
        while i >= 0 and self.scan.actions[i].time > since:
            action = self.scan.actions[i]
            if action.step == step and action.episode == episode:
                boundary = action.time
                break
            if action.step < step:           # steps only grow within a segment
                break
            i -= 1
        if boundary is None and segment_start is not None and segment_start.step == step \
                and segment_start.episode == episode:
            boundary = segment_start.time
        if boundary is None:
            return None
        tick = _first_after(self.ticks, boundary)
        return Slot(tick, BEFORE, event.index) if tick is not None and tick < event.time else None

    def _race_slot(self, event: RecordedEvent) -> Optional[Slot]:
        """Trigger mode: before the step of the last trigger when its action shows the
        event came first. Timer mode: after the next action when it shows the step came first."""
        actions = self.scan.actions
        if self.mode == "trigger":
            tick = _last_before(self.ticks, event.time)
            if tick is None or self._event_between(tick, event.time, event):
                return None
            i = bisect.bisect_right(self.action_times, tick)
            if i >= len(actions) or actions[i].time < event.time:
                return None                  # that step had published before the event
            later = _first_after(self.ticks, tick)
            if later is not None and later < actions[i].time:
                return None                  # the action is a later trigger's: that one made no step
            return Slot(tick, BEFORE, event.index) if _follows(actions[i], event) else None
        i = bisect.bisect_right(self.action_times, event.time)
        if i >= len(actions) or self._event_between(event.time, actions[i].time, event):
            return None
        action = actions[i]
        sensor = _first_after(self.scan.sensor_times, event.time)
        if sensor is not None and sensor < action.time:
            return None                      # a sensor message came in between: the step was later
        return Slot(action.time, AFTER, event.index) if not _follows(action, event) else None

    def _event_between(self, start: int, end: int, event: RecordedEvent) -> bool:
        """Whether another event lies strictly between two times."""
        lo, hi = bisect.bisect_right(self.event_times, start), bisect.bisect_left(self.event_times, end)
        return any(self.scan.events[i] is not event for i in range(lo, hi))
