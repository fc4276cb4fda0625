"""What a session composes (``PolicySession.parts``, ``capsule_ros.serving.session``), as one
record for tests and tools that look inside."""
from __future__ import annotations

from typing import NamedTuple, Optional

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.store import CapsuleStore
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.boundary import Boundary
from capsule_ros.serving.capsule_set import CapsuleSet
from capsule_ros.serving.loop import ControlLoop
from capsule_ros.serving.machine import EpisodeMachine
from capsule_ros.serving.recompute import Recompute


class SessionParts(NamedTuple):
    """What a session composes, for tests and tools that look inside. Reading them is safe
    between steps; changing the live state through them bypasses the boundary."""

    runtime: PolicyRuntime
    store: CapsuleStore
    directory: Optional[CapsuleDirectory]
    boundary: Boundary
    loop: ControlLoop
    machine: EpisodeMachine
    capsules: CapsuleSet
    recompute: Recompute
