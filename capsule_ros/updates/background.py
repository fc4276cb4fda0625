"""``capsules.regenerate_stale``: the node's stale capsules regenerated in a child process.

The child (spawned: a fresh interpreter that builds the deployment from the node's
parameters, so no interpreter lock is shared with the control loop; on a GPU, a CUDA
context of its own) runs at ``capsules.regenerate_nice`` and sends its parent one typed
message per capsule (``Outcome``), or one ``ChildFailed`` when it cannot go on. It never
touches the session: the control loop does not wait for it (docs/benchmarks.md,
"Background regeneration and the control loop"). Each regenerated file replaces the
stale one atomically, so a capsule is re-enterable the moment its new bytes are complete,
and not before.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Tuple, Union

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.serving.config import ServingConfig
from capsule_ros.updates.deployment import Deployment
from capsule_ros.updates.regeneration import Outcome, Regeneration, Status

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildFailed:
    """The child could not go on (the deployment would not build, or is another one)."""

    reason: str


ChildMessage = Union[Outcome, ChildFailed]


def _regenerate_in_child(load: Callable[[ServingConfig], Deployment], config: ServingConfig, root: str,
                         capsule_ids: Sequence[str], fingerprint: str, stop: Any, conn: Any) -> None:
    """The child process: at ``capsules.regenerate_nice`` (lowest priority by default), the
    deployment built again from ``config`` (it must have the node's ``fingerprint``), each
    outcome sent to the parent as it comes."""
    with contextlib.suppress(OSError):
        os.nice(config.capsules.regenerate_nice)
    try:
        deployment = load(config)
        if deployment.fingerprint != fingerprint:
            conn.send(ChildFailed(f"the deployment built from the node's parameters is {deployment.fingerprint[:12]}, "
                                  f"the node runs {fingerprint[:12]} (its weights file changed?)"))
            return
        capsules = config.capsules
        directory = CapsuleDirectory(root, key_file=capsules.key_file, chunk_bytes=int(capsules.chunk_mb * 2**20),
                                     max_file_bytes=int(capsules.max_file_mb * 2**20), recover=False)
        Regeneration(directory, directory, deployment).run(capsule_ids, stop=stop.is_set, on_outcome=conn.send)
    except Exception as exc:  # noqa: BLE001 - reported to the node, which logs it and serves on
        conn.send(ChildFailed(f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


class BackgroundRegeneration:
    """The stale capsules ``capsule_ids`` of the node's ``directory`` regenerated for the
    live deployment, one after another, in a child process (see the module docstring).
    ``load``: the deployment of a config (``capsule_ros.updates.deployment.load_deployment``),
    run in the child."""

    def __init__(self, config: ServingConfig, directory: CapsuleDirectory, capsule_ids: Sequence[str],
                 fingerprint: str, load: Callable[[ServingConfig], Deployment]):
        context = multiprocessing.get_context("spawn")
        self.capsule_ids = tuple(capsule_ids)
        self._stop = context.Event()
        self._conn, child = context.Pipe(duplex=False)
        self._process = context.Process(target=_regenerate_in_child, name="capsule-regenerate", daemon=True,
                                        args=(load, config, str(directory.root), self.capsule_ids, fingerprint,
                                              self._stop, child))
        self._child_conn = child
        self._lock = threading.Lock()
        self.outcomes: List[Outcome] = []
        self.error = ""
        self._ended = False

    def start(self) -> None:
        self._process.start()
        self._child_conn.close()                 # the child's end lives in the child now

    def _drain(self) -> None:
        """Take what the child sent (any thread: status, tests)."""
        with self._lock:
            while not self._ended:
                try:
                    if not self._conn.poll():
                        return
                    message: ChildMessage = self._conn.recv()
                except (EOFError, OSError):
                    self._ended = True
                    return
                if isinstance(message, ChildFailed):
                    self.error = message.reason
                    LOG.error("regenerate_stale stopped: %s", self.error)
                    continue
                self.outcomes.append(message)
                if message.status == Status.SKIPPED:
                    LOG.warning("regenerate_stale: capsule %s was not regenerated: %s", message.capsule_id,
                                message.reason)
                else:
                    LOG.info("regenerate_stale: capsule %s regenerated (%d steps, drift %s)", message.capsule_id,
                             message.steps, message.drift)

    @property
    def finished(self) -> bool:
        """The child is done and everything it sent was taken."""
        self._drain()
        return self._ended and not self._process.is_alive()

    def progress(self) -> Tuple[int, int, int]:
        """(regenerated, failed, left)."""
        self._drain()
        done = sum(o.status == Status.REGENERATED for o in self.outcomes)
        failed = sum(o.status == Status.SKIPPED for o in self.outcomes)
        left = 0 if self._ended else max(0, len(self.capsule_ids) - len(self.outcomes))
        return done, failed + (left if self._ended and self.error else 0), left

    def describe(self) -> str:
        done, failed, left = self.progress()
        return f"{done} regenerated, {failed} could not be, {left} left" + (f" ({self.error})" if self.error else "")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the capsule in progress, or terminate the child after ``timeout_s``
        (the node's cleanup and shutdown must not wait for a long recipe; an unfinished
        ``.part`` file is moved aside at the node's next start)."""
        self._stop.set()
        if self._process.is_alive():
            self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout_s)
        self._drain()
        self._conn.close()
