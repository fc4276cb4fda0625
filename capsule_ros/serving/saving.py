"""Saving in-memory capsules to the capsule directory without stalling the control loop.

A save has three phases. ``begin`` runs under the session's boundary lock and only
borrows the capsule's bytes from the store (a ``Loan``: the slab is neither moved,
evicted nor reused until the save ends, even if the capsule is dropped meanwhile).
``write`` runs outside the lock: on a GPU it copies the slab into one pinned staging
buffer on a low-priority stream (the control loop's stream is never waited on; one
staging buffer, so saves of a GPU runtime take turns), on a CPU it writes straight from
the slab; then the directory writes, fsyncs and renames the file. ``end`` runs under the
lock again and gives the loan back.

A drop from disk while a save is writing marks the save *dropped*; the directory asks
right before it publishes the file, under its own lock, so a drop that answered success
is never undone by the save (``CapsuleDirectory.save``'s ``keep``).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence

import torch

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.store import Capsule, CapsuleStore, Loan
from capsule_ros.errors import Busy


@dataclass
class SaveJob:
    capsule: Capsule
    loan: Loan
    dropped: bool = False          # a drop from disk came while it was writing


class CapsuleSaver:
    """Saves of one session's capsules (see the module docstring)."""

    def __init__(self, directory: CapsuleDirectory, store: CapsuleStore, schema: Sequence[dict]):
        self.directory = directory
        self.store = store
        self.schema = list(schema)
        self._jobs: Dict[str, SaveJob] = {}
        cuda = store.device.type == "cuda"
        self._stream = torch.cuda.Stream(store.device, priority=0) if cuda else None
        self._staging: Optional[torch.Tensor] = None          # pinned, made on the first GPU save
        self._staging_lock = threading.Lock() if cuda else None

    def begin(self, capsule: Capsule) -> SaveJob:
        """Under the boundary lock: borrow the capsule's bytes. Busy if it is being saved."""
        if capsule.id in self._jobs:
            raise Busy(f"capsule {capsule.id!r} is being saved already")
        job = SaveJob(capsule, self.store.lend(capsule.id))
        self._jobs[capsule.id] = job
        return job

    def write(self, job: SaveJob) -> Path:
        """Outside the lock: the file, written atomically; raises the directory's errors
        (NotFound when the capsule was dropped from disk meanwhile)."""
        with self._host_bytes(job.loan) as data:
            return self.directory.save(job.capsule, data, self.schema, keep=lambda: not job.dropped)

    def end(self, job: SaveJob) -> None:
        """Under the boundary lock: give the loan back."""
        self._jobs.pop(job.capsule.id, None)
        self.store.end_loan(job.loan)

    def is_saving(self, capsule_id: str) -> bool:
        return capsule_id in self._jobs

    def cancel(self, capsule_id: str) -> None:
        """Under the boundary lock: the capsule is being dropped from disk; a save still
        writing it must not publish its file."""
        job = self._jobs.get(capsule_id)
        if job is not None:
            job.dropped = True

    @contextlib.contextmanager
    def _host_bytes(self, loan: Loan) -> Iterator[torch.Tensor]:
        if self._staging_lock is None:
            yield loan.host_bytes()
            return
        with self._staging_lock:
            if self._staging is None:
                self._staging = torch.empty(self.store.nbytes, dtype=torch.uint8, pin_memory=True)
            yield loan.host_bytes(self._staging, self._stream)
