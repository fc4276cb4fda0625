"""The live episode a session's parts share, and the events they publish.

``Episode`` is a record, not a part: the control loop advances its step and the action
the hold mode keeps; the episode state machine (``capsule_ros.serving.machine``) changes
the rest. Both do so under the session's boundary only. ``Events`` publishes what
changed, stamped with the episode's position.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from capsule_ros.capsules.store import Capsule
from capsule_ros.serving.records import ActionRecord, EpisodeState, EventKind, EventRecord, HoldMode

LOG = logging.getLogger(__name__)


@dataclass
class Episode:
    """The live episode (see the module docstring)."""

    last_action: np.ndarray                # the last on-time policy action: what HOLD_LAST holds
    state: EpisodeState = EpisodeState.IDLE
    episode_id: int = 0
    step: int = 0                          # the state's step counter
    lineage: str = ""                      # the capsule the live state descends from ("" = an initial state)
    hold_mode: HoldMode = HoldMode.HOLD_LAST
    interrupt_capsule_id: str = ""         # held while interrupted with one
    next_episode: int = 1


class Events:
    """A session's capsule events, told to ``on_event`` (``SessionOptions.on_event``)."""

    def __init__(self, episode: Episode, on_event: Optional[Callable[[EventRecord], None]]):
        self._episode = episode
        self._on_event = on_event

    def emit(self, kind: EventKind, capsule: Optional[Capsule], *, capsule_id: Optional[str] = None,
             rollback: bool = False, fallback: bool = False, detail: str = "",
             action: Optional[ActionRecord] = None) -> None:
        """Publish an event: episode and step are the state's after the event, except for
        COMMIT, INTERRUPT and SAVE, which carry their capsule's boundary."""
        if self._on_event is None:
            return
        episode, step = self._episode.episode_id, self._episode.step
        if capsule is not None and kind in (EventKind.COMMIT, EventKind.INTERRUPT, EventKind.SAVE):
            episode, step = capsule.episode_id, capsule.step
        event = EventRecord(kind, capsule_id if capsule_id is not None else (capsule.id if capsule else ""),
                            capsule.parent_id if capsule else "", episode, step, rollback, fallback, detail, action)
        try:
            self._on_event(event)
        except Exception:
            LOG.exception("capsule event observer failed")

    def evicted(self, capsule: Capsule) -> None:
        """The store evicted a capsule to make room (its ``on_evict``)."""
        self.emit(EventKind.EVICT, capsule, detail="evicted from memory (byte budget)")
