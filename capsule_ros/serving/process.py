"""Interpreter settings for a process that runs a control loop (the node, benchmarks).

Python's cyclic garbage collector occasionally walks every tracked object; after torch,
a policy and a node are loaded that is a stall of tens of milliseconds (docs/benchmarks.md,
"Garbage collection after start-up"), on whichever thread allocated last, that no
control loop should see.
``settle_after_start`` collects once and freezes what start-up made (``gc.freeze``): later
collections only walk objects made since, which takes microseconds.
"""
from __future__ import annotations

import gc


def settle_after_start() -> None:
    """Call once the long-lived objects exist (after start-up, before the control loop)."""
    gc.collect()
    gc.freeze()


def unsettle() -> None:
    """Undo ``settle_after_start`` before dropping what start-up made (the node's lifecycle
    ``cleanup``): frozen objects are never collected, so cycles among them would leak."""
    gc.unfreeze()
    gc.collect()
