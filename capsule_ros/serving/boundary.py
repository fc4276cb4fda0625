"""The step boundary of a session: a FIFO lock (``BoundaryLock``) and the session's named
ways into it (``Boundary``).

Every change to the live state happens between two steps, under this lock: the control
loop holds it for exactly one step, a service for one verb. Python's ``threading.Lock``
is not fair: a control loop that releases it and asks again at once (a fast timer, or
steps triggered back to back) usually wins again, so a service could wait many steps and
give up with BUSY. Tickets make it FIFO: a service that asks while a step runs gets the
lock at the end of that step, before the next step, whatever the rate. A waiter that
times out gives its ticket back without blocking the queue.

Cost: one condition-variable round trip per acquire.

``Boundary`` is what the session owns and uses, by name, wherever it touches the state:
``held()`` (a verb: BUSY when no boundary comes within the service timeout),
``blocking()`` (the control loop's tick, and work that must not give up: ending a loan,
returning a failed rebuild's room), ``unless_busy()`` (status: enter only if free at
once), ``lifecycle()`` (the node's lifecycle transitions and run-time parameters: like
``held()``, and open while the verbs are suspended). After ``close`` (the session was
released) every entry answers WRONG_STATE, so a request that was still waiting never
touches a released runtime. The session's parts (capsule files, the recompute fallback,
the guarded step) never take the lock themselves: the session module shows every use of it.

Suspending the verbs (``suspend`` / ``resume``: the node's lifecycle deactivate and
activate): while suspended, ``held()`` answers WRONG_STATE with the reason, also to a
verb that was already waiting for its turn. The check is made under the lock, where the
verb would act, so a transition and a verb are ordered at the boundary: a verb that
checked the node's state before a deactivate and reached the boundary after it never
changes the state the deactivate left.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, Set

from capsule_ros.errors import Busy, WrongState


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

    def queued(self) -> int:
        """Callers holding the lock or waiting for it."""
        with self._cond:
            return self._next_ticket - self._serving - len(self._abandoned)

    def __enter__(self) -> BoundaryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Boundary:
    """The session's step boundary (see the module docstring). ``timeout_s`` is how long
    ``held()`` waits by default (``control.service_timeout_ms``; the session's
    ``reconfigure`` changes it)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._lock = BoundaryLock()
        self._closed = False
        self._suspended = ""          # why the verbs are refused ("" = they are served)

    @contextlib.contextmanager
    def held(self, timeout_s: Optional[float] = None) -> Iterator[None]:
        """Between two steps, for one verb; BUSY if no boundary comes within ``timeout_s``
        (default ``self.timeout_s``), WRONG_STATE while the verbs are suspended."""
        self._acquire(timeout_s)
        with self._entered(gated=True):
            yield

    @contextlib.contextmanager
    def lifecycle(self, timeout_s: Optional[float] = None) -> Iterator[None]:
        """Between two steps, for a lifecycle transition or a run-time parameter change:
        ``held()``, also while the verbs are suspended (transitions suspend and resume them)."""
        self._acquire(timeout_s)
        with self._entered():
            yield

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Between two steps, waiting as long as it takes (its turn comes after at most
        the step in progress and the verbs queued before it)."""
        self._lock.acquire()
        with self._entered():
            yield

    @contextlib.contextmanager
    def unless_busy(self) -> Iterator[bool]:
        """Enter only if nobody holds or waits for the boundary: yields True (entered)
        or False (not entered, nothing held)."""
        if not self._lock.acquire(blocking=False):
            yield False
            return
        with self._entered():
            yield True

    def close(self) -> None:
        """The session was released (call it holding the boundary): later entries answer
        WRONG_STATE."""
        self._closed = True

    def suspend(self, reason: str) -> None:
        """Refuse the verbs from now on (``held()`` answers WRONG_STATE with ``reason``),
        including those already waiting; the other entries are unaffected."""
        self._suspended = reason or "the session's verbs are suspended"

    def resume(self) -> None:
        """Serve the verbs again."""
        self._suspended = ""

    @property
    def suspended(self) -> str:
        """Why the verbs are refused; "" while they are served."""
        return self._suspended

    @property
    def queued(self) -> int:
        """Entries holding the boundary or waiting for it (a step, verbs, a transition)."""
        return self._lock.queued()

    def _acquire(self, timeout_s: Optional[float]) -> None:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not self._lock.acquire(timeout=timeout):
            raise Busy(f"no step boundary within {timeout * 1e3:.0f} ms")

    @contextlib.contextmanager
    def _entered(self, gated: bool = False) -> Iterator[None]:
        try:
            if self._closed:
                raise WrongState("the session was released (lifecycle cleanup): nothing to act on")
            if gated and self._suspended:
                raise WrongState(self._suspended)
            yield
        finally:
            self._lock.release()
