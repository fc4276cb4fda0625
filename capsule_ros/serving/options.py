"""What a session's owner decides about it once, at construction: one frozen value.

The node's clock, a replay's log time and its muted warnings, where events and the
watchdog's safe actions go: none of it changes while the session lives, so none of it
is an attribute to set afterwards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from capsule_ros.serving.records import ActionRecord, EventRecord


@dataclass(frozen=True)
class SessionOptions:
    """How a ``PolicySession`` is driven (defaults: a wall clock, deadlines enforced,
    warnings on, no observers)."""

    # the receiver's clock, ns: port stamps and ages, action stamps, status (the node's ROS
    # clock; an in-process replay's log time)
    clock_ns: Callable[[], int] = time.time_ns
    # False: no step is late for its timing (a replay verifies the function, not this
    # machine's speed; it re-enacts the recorded misses instead)
    enforce_deadline: bool = True
    # False: no throttled warnings (a replay, whose verdict reports what it saw)
    warnings: bool = True
    # told every capsule event, under the boundary (the node publishes and records them)
    on_event: Optional[Callable[[EventRecord], None]] = None
    # with it, a deadline watchdog runs: a step that passes its deadline hands the safe
    # action here at once, from the watchdog's thread (the tick's record then says
    # ``published``); without it a late step is found when it ends
    on_safe_action: Optional[Callable[[ActionRecord], None]] = None
