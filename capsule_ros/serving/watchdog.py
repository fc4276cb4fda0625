"""DeadlineWatchdog: act when a step runs past its deadline, while it is still running.

The control loop arms the watchdog before a step and disarms it after. If the deadline
passes first, the watchdog's own thread calls ``on_miss`` (the node publishes the safe
action then, within the control period), and ``disarm`` reports that it fired so the
late step's action is discarded: a stale chunk is never replayed.

Arming and disarming are two attribute writes and an uncontended lock: waking a
sleeping thread on every step costs a GIL hand-off on every step (docs/benchmarks.md,
"Deadline watchdog: polled, not woken per step"). Instead the thread polls every
``poll_s`` (a tenth of the deadline, at most 5 ms), so a miss is acted on at most
``poll_s`` after the deadline.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class DeadlineWatchdog:
    def __init__(self, on_miss: Callable[[], None], name: str = "deadline-watchdog"):
        self._on_miss = on_miss
        self._lock = threading.Lock()
        self._deadline: Optional[float] = None
        self._fired = False
        self._poll_s = 0.005
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, seconds: float) -> None:
        """Watch the step starting now; it must end within ``seconds``."""
        self._poll_s = min(0.005, max(seconds / 10.0, 0.0002))
        with self._lock:
            self._fired = False
            self._deadline = time.monotonic() + seconds

    def disarm(self) -> bool:
        """Stop watching; True if the deadline passed (and on_miss ran or is running)."""
        with self._lock:
            self._deadline = None
            fired, self._fired = self._fired, False
            return fired

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._closed.wait(self._poll_s):
            deadline = self._deadline
            if deadline is None or time.monotonic() < deadline:
                continue
            with self._lock:
                if self._deadline != deadline:     # disarmed meanwhile
                    continue
                self._deadline = None
                self._fired = True
            self._on_miss()
