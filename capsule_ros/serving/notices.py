"""Warnings about the control loop, throttled: dropped sensor messages, stale ports,
steps that published the safe action, inputs that never came.

The serving session decides what is worth a warning and says it at most once per
``period_s`` per key, the ROS way (rclpy's ``throttle_duration_sec``) but counted: the
next warning of a key says how many times it happened since the last one, so a sensor
that sends garbage for an hour stays visible in the log (and ``/rosout``) without flooding
it. Drops are keyed by port and cause, so one cause never hides another. The lines go to
Python ``logging``, which the node bridges into its ROS logger
(``capsule_ros.ros.log_bridge``).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Union

WARN_PERIOD_S = 5.0

# A warning's text: fixed (a count since the last warning is appended), or made from that
# count (1: the first since the last warning).
NoticeText = Union[str, Callable[[int], str]]


class Notices:
    """Throttled warnings of one session (see the module docstring); ``muted`` for a
    replay, whose verdict reports what it saw. ``clock``: monotonic seconds."""

    def __init__(self, logger: logging.Logger, period_s: float = WARN_PERIOD_S, *, muted: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.period_s = period_s
        self.muted = muted
        self.clock = clock
        self._last: Dict[str, float] = {}
        self._count: Dict[str, int] = {}          # times ``warn`` was called since the key's last warning

    def warn(self, key: str, text: NoticeText) -> None:
        """Log ``text`` unless a warning of ``key`` was logged within the period (then it is
        counted, and the next warning of ``key`` says how many times it happened)."""
        if self.muted:
            return
        count = self._count.get(key, 0) + 1
        now = self.clock()
        if now - self._last.get(key, -1e9) < self.period_s:
            self._count[key] = count
            return
        self._last[key], self._count[key] = now, 0
        if callable(text):
            self.logger.warning(text(count))
        else:
            self.logger.warning(text if count == 1 else f"{text} ({count} times since the last warning)")
