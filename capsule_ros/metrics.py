"""Small, allocation-free metrics: a latency window with percentiles, and counters."""
from __future__ import annotations

import threading
from typing import Dict

import numpy as np


class LatencyWindow:
    """The last ``capacity`` samples (seconds) in a fixed ring; percentiles over them.

    A fixed ring keeps memory bounded on a robot that runs for days and makes the
    percentiles describe recent behaviour, which is what a status display needs.
    ``record`` is O(1) and allocation-free; ``percentiles`` sorts a copy.
    """

    def __init__(self, capacity: int = 4096):
        self._samples = np.zeros(capacity, dtype=np.float64)
        self._count = 0
        self._lock = threading.Lock()

    def record(self, seconds: float) -> None:
        with self._lock:
            self._samples[self._count % len(self._samples)] = seconds
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def samples(self) -> np.ndarray:
        """The samples in the window, oldest first (a copy)."""
        with self._lock:
            n, cap = self._count, len(self._samples)
            if n <= cap:
                return self._samples[:n].copy()
            start = n % cap
            return np.concatenate([self._samples[start:], self._samples[:start]])

    def clear(self) -> None:
        with self._lock:
            self._count = 0

    def percentiles_ms(self, *qs: float) -> Dict[float, float]:
        """{q: value in ms} for each percentile q in [0, 100]; 0.0 when empty."""
        with self._lock:
            n = min(self._count, len(self._samples))
            data = self._samples[:n].copy()
        if n == 0:
            return dict.fromkeys(qs, 0.0)
        values = np.percentile(data, qs) * 1e3
        return {q: float(v) for q, v in zip(qs, values, strict=True)}
