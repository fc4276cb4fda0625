"""Warnings about the control loop, throttled: dropped sensor messages, stale ports,
steps that published the safe action, inputs that never came.

The serving session decides what is worth a warning and says it once per ``period_s``
per key (a flood of bad messages must not flood the log); the lines go to Python
``logging``, which the node bridges into its ROS logger (``capsule_ros.ros.log_bridge``).
"""
from __future__ import annotations

import logging
import time
from typing import Dict

WARN_PERIOD_S = 5.0


class Notices:
    """Throttled warnings of one session (see the module docstring); ``muted`` for a
    replay, whose verdict reports what it saw."""

    def __init__(self, logger: logging.Logger, period_s: float = WARN_PERIOD_S, *, muted: bool = False):
        self.logger = logger
        self.period_s = period_s
        self.muted = muted
        self._last: Dict[str, float] = {}

    def warn(self, key: str, text: str) -> None:
        """Log ``text`` unless a warning of ``key`` was logged within the period."""
        if self.muted:
            return
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.period_s:
            self._last[key] = now
            self.logger.warning(text)
