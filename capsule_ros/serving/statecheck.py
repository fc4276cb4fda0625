"""The start-up state check beside serving (``runtime.state_check_timing: while_serving``).

The state check (``capsule_ros.runtime.contract``) repeats steps from a snapshot. On a CPU a
chunking policy's check plans chunks, seconds each for a camera policy, that a plain start
never plans; run before the first step, they are most of such a node's start-up. What the
check protects is a restore's exactness, not the actions, so ``policy_node`` may run it on a
copy of the policy (its own runtime and arena, same configuration and mode) in a thread
while the live runtime serves its first steps. A capsule restore (``reset`` or ``reenter``
from a capsule, the recompute fallback) waits for the verdict; after a failed check every
restore is refused (WRONG_STATE, with the check's reason) while the policy keeps acting, as
with ``runtime.state_check: false``. Capsules taken meanwhile are kept: a passed check
covers them. The live runtime also skips the programs' first runs (the check's runtime runs
them): a step that cannot run at all faults at the first step instead of failing activation.
Closing the session stops the check before its next step (a node's Ctrl-C waits for at most
the step in progress, not for the rest of the check).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Callable, Optional

from capsule_ros.errors import WrongState
from capsule_ros.runtime.contract import StateCheckStopped
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.runtime.policy import StatefulPolicy

LOG = logging.getLogger(__name__)

CheckingRuntime = Callable[[StatefulPolicy, threading.Event], PolicyRuntime]   # runs the check, stoppable


class StateVerdict:
    """What a restore waits for: nothing, where the state check ran before serving (or not
    at all)."""

    def require(self) -> None:
        """Return once restores are exact; WrongState with the reason when they cannot be."""

    def close(self) -> None:
        """Wait for the check's work to end."""


class StateCheckBeside(StateVerdict):
    """One state check on a copy of the policy, in a thread started here; its verdict gates
    restores (``require``)."""

    def __init__(self, policy: StatefulPolicy, build: CheckingRuntime,
                 rebuild_policy: Callable[[], StatefulPolicy]):
        """``build``: a runtime of the given policy that runs the check while it is built (a
        PolicyStateError when it fails), stopped when the event is set (StateCheckStopped);
        ``rebuild_policy``: a fresh policy from the configuration, for a policy that cannot be
        copied (an ONNX Runtime session)."""
        self._done = threading.Event()
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(policy, build, rebuild_policy),
                                        name="capsule-state-check", daemon=True)
        self._thread.start()

    def _run(self, policy: StatefulPolicy, build: CheckingRuntime,
             rebuild_policy: Callable[[], StatefulPolicy]) -> None:
        started = time.perf_counter()
        try:
            try:
                copied = copy.deepcopy(policy)
            except Exception:  # noqa: BLE001 - not copyable: the same policy built again
                copied = rebuild_policy()
            build(copied, self._stop).close()
            self._seconds = time.perf_counter() - started
            LOG.info("state check passed, beside serving, in %.1f s", self._seconds)
        except StateCheckStopped as exc:
            self._error = exc
            LOG.info("state check stopped before its verdict: the session is closing")
        except BaseException as exc:  # noqa: BLE001 - the verdict: every restore reports it
            self._error = exc
            self._seconds = time.perf_counter() - started
            LOG.error("state check failed, beside serving: %s; capsule restores are refused", exc)
        finally:
            self._done.set()

    def require(self) -> None:
        """Return once the check has passed (waiting for it while it runs); WrongState with its
        reason when it failed (a restore would not be exact)."""
        self._done.wait()
        if self._error is not None:
            raise WrongState(f"capsule restores are refused: the start-up state check failed "
                             f"({type(self._error).__name__}: {self._error})")

    def close(self) -> None:
        """Stop the check before its next step and wait for it to end (its runtime is closed
        by then)."""
        self._stop.set()
        self._thread.join()


__all__ = ["StateCheckBeside", "StateVerdict"]
