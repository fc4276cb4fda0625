"""The episode input log: what the recompute fallback replays, and what a saved
capsule's recipe is cut from.

Each step's staged inputs (the whole input region: a few bytes, or a camera frame) are
copied into ``capacity`` rows allocated up front and mapped ahead of use (``prefaulted``),
so logging never allocates or faults a page in; beside each row, whether the step read its inputs at all (a chunking
policy's consume steps read none: no row is copied for them) and the action it produced
(for a recipe's actions). Entry ``i``
holds the inputs of the step taken from state step ``base_step + i`` of the current
episode's timeline. A rollback truncates the log at the restored step; the log remembers
every truncation so it can tell whether a capsule's prefix is still the logged one.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from typing import Any, List, Optional, Tuple

import numpy as np

LOG = logging.getLogger(__name__)
MADV_POPULATE_WRITE = 23          # Linux 5.14+: fault pages in as a write would, leaving their contents alone
POPULATE_CHUNK_BYTES = 32 << 20   # per madvise call of the helper thread
SMALL_BYTES = 1 << 20             # smaller arrays are simply written through at once


def _madvise() -> Any:
    """libc's madvise through ctypes, which releases the interpreter lock during the call."""
    function = ctypes.CDLL(None, use_errno=True).madvise
    function.argtypes, function.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return function


def _populate(region: mmap.mmap, address: int, start: int, nbytes: int, madvise: Any) -> None:
    """The helper thread: fault ``region``'s pages in, a chunk per call (``region`` kept
    alive until it is done)."""
    for offset in range(start, nbytes, POPULATE_CHUNK_BYTES):
        if madvise(address + offset, min(POPULATE_CHUNK_BYTES, nbytes - offset), MADV_POPULATE_WRITE) != 0:
            LOG.debug("input log: madvise(MADV_POPULATE_WRITE) failed (errno %d)", ctypes.get_errno())
            return
    del region


def prefaulted(shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed array whose pages are mapped ahead of any write to them, without holding up
    the caller. A fresh array's pages are mapped at their first write, and a camera
    policy's first pass through its log paid those faults inside the control step
    (docs/benchmarks.md, "The input log's first touch"); writing the whole log at start
    moved them into activation, a few seconds for a camera policy's log. Here a helper
    thread asks the kernel to map them (``MADV_POPULATE_WRITE``, contents untouched, so it
    may run while the log is written) and activation does not wait; where the kernel has no
    such call (before Linux 5.14) the array is written through at once, as before."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes >= SMALL_BYTES:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)    # zero pages
        array = np.frombuffer(region, dtype=dtype).reshape(shape)
        address = array.ctypes.data
        try:
            madvise = _madvise()
            if madvise(address, mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0:        # the kernel has it
                threading.Thread(target=_populate, args=(region, address, 0, nbytes, madvise),
                                 name="capsule-ros-input-log", daemon=True).start()
                return array
        except (AttributeError, OSError):          # no libc madvise here
            pass
    else:
        array = np.empty(shape, dtype=dtype)
    array.fill(0)
    return array


class InputLog:
    """Inputs of the current episode's timeline, from its root state onwards."""

    def __init__(self, capacity: int, row_bytes: int, action_dim: int = 0):
        self.capacity = capacity
        self._rows = prefaulted((capacity, row_bytes), np.uint8)
        self._reads = prefaulted((capacity,), bool)
        self._actions = prefaulted((capacity, action_dim), np.float32)
        self.episode_id = -1
        self.base_step = 0
        self.length = 0
        self.generation = 0
        self._start_generation = 0
        self._cuts: List[Tuple[int, int]] = []   # (generation after the cut, step cut at)

    def start(self, episode_id: int, base_step: int) -> None:
        """A new timeline: the episode's root state is at ``base_step``."""
        self.episode_id, self.base_step, self.length = episode_id, base_step, 0
        self.generation += 1
        self._start_generation = self.generation
        self._cuts.clear()

    def append(self, step: int, row: Optional[np.ndarray], action: Optional[np.ndarray] = None) -> None:
        """Log the inputs of the step taken from state ``step`` (must be the next one) and
        the action it produced (None: it produced none, NaN is kept). ``row`` None: the step
        read no inputs (a chunking policy's consume step), so there is nothing to copy; a
        replay of the same schedule skips them too."""
        if self.length >= self.capacity or step != self.base_step + self.length:
            self.length = self.capacity + 1 if self.length >= self.capacity else self.length
            return   # the log no longer covers the timeline beyond this point
        if row is not None:
            self._rows[self.length] = row
        self._reads[self.length] = row is not None
        self._actions[self.length] = np.nan if action is None else action
        self.length += 1

    def truncate(self, step: int) -> None:
        """The timeline continues from state ``step`` (a rollback): forget later inputs."""
        keep = step - self.base_step
        if 0 <= keep < self.length:
            self.length = keep
            self.generation += 1
            self._cuts.append((self.generation, step))

    @property
    def overflowed(self) -> bool:
        return self.length > self.capacity

    def covers(self, episode_id: int, step: int, generation: int) -> Optional[str]:
        """None if the log can rebuild the state of ``step`` made at ``generation``,
        else the reason it cannot."""
        if episode_id != self.episode_id:
            return f"the input log holds episode {self.episode_id}, not {episode_id}"
        if self.overflowed:
            return f"the episode outgrew the input log ({self.capacity} steps)"
        if not self.base_step <= step <= self.base_step + self.length:
            return (f"step {step} is outside the logged steps "
                    f"{self.base_step}..{self.base_step + self.length}")
        if generation < self._start_generation:
            return "the capsule was made on an earlier timeline of this episode"
        for gen, cut in self._cuts:
            if gen > generation and cut < step:
                return f"a rollback to step {cut} replaced the inputs that led to step {step}"
        return None

    def rewritten_below(self, step: int, generation: int) -> bool:
        """Whether rows before state ``step`` may have been written again since ``generation``
        (a new timeline, or a rollback below ``step``): a reader that copied them outside
        the session's boundary asks this after its copy."""
        return self._start_generation > generation or any(gen > generation and cut < step for gen, cut in self._cuts)

    def rows(self, upto_step: int) -> np.ndarray:
        """Logged inputs from the root up to (not including) state ``upto_step`` (a view;
        rows of steps that read none are stale)."""
        return self._rows[:upto_step - self.base_step]

    def reads(self, upto_step: int) -> np.ndarray:
        """Whether each step from the root up to state ``upto_step`` read its inputs (a view)."""
        return self._reads[:upto_step - self.base_step]

    def actions(self, upto_step: int) -> np.ndarray:
        """The action of each step from the root up to state ``upto_step`` (a view)."""
        return self._actions[:upto_step - self.base_step]
