"""The chunk schedule: the fixed numbers of one runtime's chunking, checked once.

``control.chunking`` picks the refill timing: ``sync`` plans a chunk in the step that needs
it; ``async`` requests it ``delay`` steps before its takeover and plans it off the control
loop. ``execution_horizon`` is how many rows of each chunk are executed; ``end`` =
execution horizon + delay is the row at which the next chunk takes over. An ``auto``
delay is measured before the runtime is built (``capsule_ros.chunking.mode.resolve_chunking``)
and is a number from then on.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.policy import ChunkCadence


class RefillTiming(str, enum.Enum):
    """``control.chunking``: when a chunk is planned."""

    SYNC = "sync"          # in the step that needs it
    ASYNC = "async"        # requested ``delay`` steps ahead, planned off the control loop


@dataclass(frozen=True)
class ChunkingSettings:
    """How a chunking policy's chunks are to be scheduled, as configured (``control.chunking``
    and friends). ``delay``: steps (async), None = ``auto``: measured before the runtime is
    built (the refill's p99 over ``rate_hz``, from ``auto_runs`` timed plans).
    ``execution_horizon``: rows executed per chunk, 0 = the policy's own. ``worker``:
    ``auto`` (a thread on a CPU, a stream on a GPU) or ``inline`` (plans at request time on
    the caller's thread: the same bits, no overlap)."""

    timing: str = "sync"
    delay: Optional[int] = None
    execution_horizon: int = 0
    rate_hz: float = 20.0
    worker: str = "auto"
    auto_runs: int = 5


@dataclass(frozen=True)
class ChunkSchedule:
    """The fixed numbers of one runtime's chunking: refill timing, delay d, execution
    horizon e (rows executed per chunk), the policy's chunk length L. ``end`` = e + d."""

    timing: RefillTiming
    delay: int
    execution_horizon: int
    length: int

    @property
    def end(self) -> int:
        return self.execution_horizon + self.delay

    @classmethod
    def resolve(cls, cadence: ChunkCadence, timing: str, delay: int, execution_horizon: int = 0) -> ChunkSchedule:
        """The schedule for ``cadence`` with ``timing``, delay ``delay`` steps (async) and
        ``execution_horizon`` rows per chunk (0: the cadence's own; in async mode at most
        length - delay). Raises ConfigError with the numbers when they cannot work."""
        refill = RefillTiming(timing)
        length = cadence.length
        if refill == RefillTiming.SYNC:
            executed = execution_horizon or cadence.horizon
            if not 1 <= executed <= length:
                raise ConfigError(f"control.execution_horizon = {executed}: must be in [1, {length}] (the policy "
                                  f"predicts {length} actions per chunk)")
            return cls(refill, 0, executed, length)
        if delay < 1:
            raise ConfigError(f"control.inference_delay_steps = {delay}: async chunking needs a delay of at least 1 "
                              "step (0 would be sync)")
        if delay >= length:
            raise ConfigError(
                f"control.chunking async with inference_delay_steps = {delay}: a chunk of {length} actions has none "
                f"left to execute (each chunk is executed from row {delay}: its first {delay} actions count as "
                f"executed while it is planned); the delay must be below {length}, at most {length // 2} to leave as "
                "many rows as it takes to plan the next; lower the delay or predict longer chunks")
        executed = execution_horizon or min(cadence.horizon, length - delay)
        if executed < 1 or executed + delay > length:
            raise ConfigError(
                f"control.chunking async with inference_delay_steps = {delay} and execution horizon {executed}: a "
                f"chunk of {length} actions has too few left; each chunk is executed from row {delay} (its first "
                f"{delay} actions count as executed while it is planned) for {executed} rows, needing delay + "
                f"horizon <= {length}; lower the delay, lower control.execution_horizon, or predict longer chunks")
        if executed < delay:
            raise ConfigError(
                f"control.chunking async: execution horizon {executed} < inference_delay_steps {delay}: a refill would "
                f"be requested every {executed} steps but takes {delay} steps, so refills would overlap; raise "
                f"control.execution_horizon to at least {delay} (delay + horizon <= {length}) or lower the delay")
        return cls(refill, delay, executed, length)

    def describe(self) -> str:
        if self.timing == RefillTiming.SYNC:
            return f"sync, {self.execution_horizon} of {self.length} actions per chunk"
        return (f"async, inference delay {self.delay} steps, rows {self.delay}..{self.end - 1} of {self.length} "
                f"executed per chunk ({self.execution_horizon} steps)")


def check_settings(cadence: ChunkCadence, settings: ChunkingSettings) -> None:
    """ConfigError with the numbers for settings that cannot work (at configure); an
    ``auto`` delay is known, and checked, only when it is measured."""
    if settings.timing == RefillTiming.SYNC.value or settings.delay is not None:
        ChunkSchedule.resolve(cadence, settings.timing, settings.delay or 0, settings.execution_horizon)


def resolve_delay(setting: str) -> Optional[int]:
    """``control.inference_delay_steps``: an integer, or None for ``auto``."""
    return None if setting == "auto" else int(setting)


def measured_delay(seconds: Sequence[float], rate_hz: float, margin: float = 1.5) -> int:
    """The delay (steps) for ``auto``: the refill's p99 (of the timed plans) with a margin
    for the control loop sharing the machine, in control periods, at least 1."""
    p99 = float(np.percentile(np.asarray(seconds), 99))
    return max(1, math.ceil(p99 * margin * rate_hz))
