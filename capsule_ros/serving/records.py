"""What the serving session hands out: actions, events, results, counters and status.

Plain data, no behaviour: the node turns these into messages (``capsule_ros.ros.messages``,
``capsule_ros.ros.status``: every field it reports comes from a ``SessionStatus``), the
replay compares them (``capsule_ros.bag``). The enum values are the constants of the
matching ``capsule_ros`` messages and services (test_foundation checks they agree).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, NamedTuple, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    from capsule_ros.capsules.store import Capsule, StoreStats
    from capsule_ros.runtime.engine import PolicyRuntime


class EpisodeState(enum.IntEnum):
    """Values match RuntimeStatus.IDLE / RUNNING / INTERRUPTED."""

    IDLE = 0
    RUNNING = 1
    INTERRUPTED = 2


class HoldMode(enum.IntEnum):
    """Values match Interrupt.Request.HOLD_*."""

    HOLD_LAST = 0
    HOLD_ZERO = 1
    HOLD_SILENT = 2


class ActionSource(enum.IntEnum):
    """Values match Action.SOURCE_*."""

    POLICY = 0
    HOLD = 1
    ZERO = 2


class EventKind(enum.IntEnum):
    """Values match CapsuleEvent constants."""

    COMMIT = 0
    INTERRUPT = 1
    REENTER = 2
    RESET = 3
    FORK = 4
    DROP = 5
    SAVE = 6
    LOAD = 7
    EVICT = 8
    CLOCK_JUMP = 9         # the session's clock went back (detail: ``clock_jump_detail``)


class StepFault(str, enum.Enum):
    """Why a tick published the safe action instead of the policy's output."""

    NONE = ""
    LATE = "late"              # the step ended after its deadline (its state is kept)
    ERROR = "error"            # the step raised (the state is put back as before it)
    NONFINITE = "nonfinite"    # the step's outputs held NaN or Inf (the state is put back)


class ActionRecord(NamedTuple):
    """One tick's command (a named tuple: one is made per robot per tick)."""

    values: np.ndarray
    chunk: Optional[np.ndarray]        # [H, A] for policy actions, None for safe actions
    source: ActionSource
    episode_id: int
    step: int                          # the state's step counter after this tick
    lineage: str
    stamp_ns: int
    fault: StepFault = StepFault.NONE  # why a safe action replaced the policy's output
    published: bool = False            # the deadline watchdog already published it: do not again

    @property
    def late(self) -> bool:
        return self.fault == StepFault.LATE


@dataclass(frozen=True)
class EventRecord:
    """A change to the episode or the capsule set (``capsule_ros/msg/CapsuleEvent``).
    An INTERRUPT carries the safe action of its hold mode (None when silent), which its
    publisher sends with it, whoever interrupted."""

    kind: EventKind
    capsule_id: str
    parent_id: str
    episode_id: int
    step: int
    rollback: bool = False
    fallback: bool = False
    detail: str = ""
    action: Optional[ActionRecord] = field(default=None, compare=False)


def clock_jump_detail(delta_ns: int) -> str:
    """A CLOCK_JUMP event's detail: the jump, signed, in nanoseconds ("-10000000000 ns")."""
    return f"{int(delta_ns):+d} ns"


def clock_jump_delta(detail: str) -> int:
    """The jump (ns) a CLOCK_JUMP event's detail holds (``clock_jump_detail``)."""
    return int(detail.split()[0])


class EpisodeStart(NamedTuple):
    """What ``reset`` answers: the new episode and the capsule it started from (None: the initial state)."""

    episode_id: int
    capsule: Optional[Capsule]


@dataclass(frozen=True)
class RecordResult:
    """What ``record`` answers: the bag being (or just) written and, when it stopped, the
    messages written."""

    bag_path: str
    messages: int = 0


@dataclass(frozen=True)
class ReenterResult:
    capsule: Optional[Capsule]       # None when resuming an interrupt without a capsule
    rollback: bool
    fallback: bool
    fallback_reason: str
    restore_seconds: float
    recompute_seconds: float
    fallback_source: str = ""        # with fallback: the way it was rebuilt ("the input log", or its file's
                                     # recipe and why the log could not)


@dataclass
class SessionCounters:
    steps: int = 0
    deadline_misses: int = 0
    late_refills: int = 0              # chunk takeovers whose asynchronous refill had not finished (also misses)
    step_errors: int = 0               # steps that raised (safe action published, state put back)
    nonfinite_steps: int = 0           # steps with non-finite outputs (likewise)
    fallback_recomputes: int = 0
    last_fault: str = ""               # the last step error or non-finite output, for logs and status
    clock_jumps: int = 0               # times the session's clock went back (SessionLoop.clock_jumped)
    last_clock_jump_ns: int = 0        # by how much, the last time (negative: back)


@dataclass(frozen=True)
class PortPicture:
    """One port in a status picture: its counters and the age of its last message (ms,
    -1 before the first), on the session's clock."""

    name: str
    topic: str
    received: int
    dropped: Dict[str, int]
    stale_steps: int
    age_ms: float

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


@dataclass(frozen=True)
class StalePicture:
    """Capsule files of another fingerprint in the session's directory (counted at
    configure, by cause: a capsule counts under every component that differs; "unsplit":
    a format version 1 file, whose cause is not recorded), the progress of their
    background regeneration (``capsules.regenerate_stale``), and the directory's recipes
    (counted at configure, kept current by the session's own saves and drops)."""

    stale: int = 0
    by_cause: Dict[str, int] = field(default_factory=dict)
    regenerable: int = 0
    regenerated: int = 0
    failed: int = 0
    left: int = 0
    files_regenerable: int = 0         # capsule files (any fingerprint) whose recipe can rebuild them
    recipe_bytes: int = 0              # their recipes' bytes on disk


@dataclass(frozen=True)
class EpisodePicture:
    """The live episode as the session's readers see it between steps
    (``PolicySession.episode``): read without waiting for the boundary, so a step or a
    verb may be changing it as it is taken (``PolicySession.status`` is consistent)."""

    state: EpisodeState
    episode_id: int
    step: int
    lineage: str
    hold_mode: HoldMode
    interrupt_capsule: Optional[Capsule]         # held while interrupted with one
    suspended: str                               # why the verbs are refused (the node is inactive); "" if served


@dataclass(frozen=True)
class ChunkingPicture:
    """A chunking policy's schedule and how many chunks were planned (its refills)."""

    mode: str                                    # "sync" or "async"
    delay: int                                   # inference delay, steps (async)
    horizon: int                                 # rows executed per chunk
    refills: int


@dataclass(frozen=True)
class SessionStatus:
    """A consistent picture of the session, taken at a step boundary (``PolicySession.status``):
    everything ``~/status`` and ``/diagnostics`` report of it."""

    state: EpisodeState
    episode_id: int
    step: int
    lineage: str
    counters: SessionCounters
    step_ms: Dict[float, float]                  # percentile -> ms
    restore_ms: Dict[float, float]
    capsules: Dict[int, int]                     # Tier value -> capsules there
    hits: Dict[int, int]                         # Tier value -> restores served from there
    restores: int
    misses: int
    invalidations: int
    evictions: int
    demotions: int
    device: str                                  # the runtime's ("cpu", "cuda:0")
    fingerprint: str
    graph_captured: bool
    action_dim: int
    chunking: Optional[ChunkingPicture] = None   # None: a policy without a chunk cadence
    stamp_ns: int = 0
    ports: Tuple[PortPicture, ...] = ()
    stale: StalePicture = field(default_factory=StalePicture)

    @classmethod
    def of(cls, episode: EpisodePicture, counters: SessionCounters, step_ms: Dict[float, float],
           ports: Tuple[PortPicture, ...], store: StoreStats, runtime: PolicyRuntime,
           stale: StalePicture, stamp_ns: int) -> SessionStatus:
        """The picture from its parts' (taken under the boundary)."""
        c = store.counters
        from capsule_ros.chunking.mode import ChunkingMode  # torch: only where a runtime exists

        mode, chunking = runtime.mode, None
        if isinstance(mode, ChunkingMode):
            schedule = mode.schedule
            chunking = ChunkingPicture(schedule.timing.value, schedule.delay, schedule.execution_horizon,
                                       mode.counters.refills)
        return cls(state=episode.state, episode_id=episode.episode_id, step=episode.step, lineage=episode.lineage,
                   counters=counters, step_ms=step_ms, restore_ms=store.restore_ms,
                   capsules={int(t): n for t, n in store.capsules.items()},
                   hits={int(t): n for t, n in c.hits.items()},
                   restores=c.restores, misses=c.misses, invalidations=c.invalidations, evictions=c.evictions,
                   demotions=c.demotions, device=str(runtime.device), fingerprint=runtime.fingerprint,
                   graph_captured=runtime.graphs.captured, action_dim=runtime.policy.action_dim,
                   chunking=chunking, stamp_ns=stamp_ns, ports=ports, stale=stale)
