"""The step-boundary lock: first come, first served.

Every change to the live state happens between two steps, under this lock: the control
loop holds it for exactly one step, a service for one verb. Python's ``threading.Lock``
is not fair: a control loop that releases it and asks again at once (a fast timer, or
steps triggered back to back) usually wins again, so a service could wait many steps and
give up with BUSY. Tickets make it FIFO: a service that asks while a step runs gets the
lock at the end of that step, before the next step, whatever the rate. A waiter that
times out gives its ticket back without blocking the queue.

Cost: one condition-variable round trip per acquire (a few microseconds).
"""
from __future__ import annotations

import threading
from typing import Optional, Set


class BoundaryLock:
    """A FIFO (ticket) lock with timeouts and a non-blocking try; a context manager."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0        # handed to the next caller of acquire
        self._serving = 0            # the ticket that may hold the lock (held or about to be)
        self._held = False
        self._abandoned: Set[int] = set()

    def acquire(self, blocking: bool = True, timeout: Optional[float] = None) -> bool:
        """Wait for our turn; False when ``timeout`` passed (or, non-blocking, when the
        lock is held or others are waiting)."""
        with self._cond:
            if not blocking:
                if self._held or self._serving != self._next_ticket:
                    return False
                self._next_ticket += 1
                self._held = True
                return True
            ticket = self._next_ticket
            self._next_ticket += 1
            if timeout is None:
                while self._serving != ticket or self._held:
                    self._cond.wait()
            elif not self._cond.wait_for(lambda: self._serving == ticket and not self._held, timeout):
                self._abandoned.add(ticket)      # the holder skips it on release
                self._skip_abandoned()
                return False
            self._held = True
            return True

    def release(self) -> None:
        with self._cond:
            if not self._held:
                raise RuntimeError("release of an unheld BoundaryLock")
            self._held = False
            self._serving += 1
            self._skip_abandoned()
            self._cond.notify_all()

    def _skip_abandoned(self) -> None:
        while self._serving in self._abandoned and not self._held:
            self._abandoned.discard(self._serving)
            self._serving += 1
            self._cond.notify_all()

    def locked(self) -> bool:
        return self._held

    def __enter__(self) -> BoundaryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
