"""Copying a capsule_ros bag, optionally editing or dropping messages on the way.

The copy keeps every log time (so the node's processing order) and the recorded
metadata, and digests its own messages: an edited copy is a consistent bag that
records a different run (e.g. one sensor value changed), which ``replay --verify``
then reports as a divergence, while a bag damaged in place is refused as garbled.
It also converts between storage plugins (MCAP <-> sqlite3).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from capsule_ros.bag.reader import Entry, Recording
from capsule_ros.bag.recorder import write_bag

Transform = Callable[[Entry, Recording], Optional[bytes]]


def rewrite_bag(src, dst, transform: Optional[Transform] = None, storage: Optional[str] = None) -> int:
    """Write a copy of bag ``src`` to ``dst``; ``transform(entry, recording)`` returns the
    bytes to write for each message (None drops it). Returns the number written."""
    with Recording(src) as recording:
        recording.scan()                          # refuse a bad source before writing anything

        def messages():
            for entry in recording.entries():
                data = entry.data if transform is None else transform(entry, recording)
                if data is not None:
                    yield entry.topic, entry.msgtype, data, entry.time

        return write_bag(Path(dst), storage or recording.storage, recording.meta, recording.typestore, messages())
