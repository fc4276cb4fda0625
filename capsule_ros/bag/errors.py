"""Typed errors of rosbag recording and replay.

They derive from ``CapsuleRosError`` so a node service that starts a recording answers
with the right ``error_code``; ``capsule-ros replay`` maps every ``BagError`` to exit
status 2 with its one-line message (never a traceback).
"""
from __future__ import annotations

from capsule_ros.errors import CapsuleIOError, CapsuleRosError, CorruptCapsule, ErrorCode, InvalidArgument


class BagError(CapsuleRosError):
    """Base: the bag cannot be recorded or replayed (exit status 2 of ``replay``)."""

    code = ErrorCode.IO_ERROR


class BadBag(BagError, CorruptCapsule):
    """The bag is unreadable, truncated, garbled, or lacks a topic or the recorded config."""

    code = ErrorCode.CORRUPT


class RecordError(BagError, CapsuleIOError):
    """A recording could not be started or written (path exists, disk, permissions)."""

    code = ErrorCode.IO_ERROR


class RecordArgumentError(BagError, InvalidArgument):
    """A recording request names an unknown storage plugin or a malformed path."""

    code = ErrorCode.INVALID_ARGUMENT


class ReplaySetupError(BagError):
    """The replay could not start: bad parameter file, capsule not loadable, node did not
    come up, an option that the chosen mode does not support."""

    code = ErrorCode.INVALID_ARGUMENT
