"""DeadlineWatchdog: act when a step runs past its deadline, while it is still running.

The control loop arms the watchdog before a step and disarms it after. If the deadline
passes first, the watchdog's own thread calls ``on_miss`` (the node publishes the safe
action then, within the control period), and ``disarm`` reports that it fired so the
late step's action is discarded: a stale chunk is never replayed.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class DeadlineWatchdog:
    def __init__(self, on_miss: Callable[[], None], name: str = "deadline-watchdog"):
        self._on_miss = on_miss
        self._cond = threading.Condition()
        self._deadline: Optional[float] = None
        self._fired = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, seconds: float) -> None:
        with self._cond:
            self._deadline = time.monotonic() + seconds
            self._fired = False
            self._cond.notify()

    def disarm(self) -> bool:
        """Stop watching; True if the deadline passed (and on_miss ran or is running)."""
        with self._cond:
            self._deadline = None
            return self._fired

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(timeout=remaining)
                    continue
                self._deadline = None
                self._fired = True
                self._cond.release()
                try:
                    self._on_miss()
                finally:
                    self._cond.acquire()
