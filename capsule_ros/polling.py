"""Waiting for a condition that another thread or process makes true (a node coming up,
a message arriving): poll it, with a deadline and a message that says what was awaited."""
from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.02,
               check: Optional[Callable[[], None]] = None) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; raise
    TimeoutError naming ``what`` after ``timeout`` seconds. ``check`` runs before each
    poll and may raise to give up early (e.g. the process being waited for died)."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
