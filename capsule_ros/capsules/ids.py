"""Capsule ids: the alphabet ``[A-Za-z0-9][A-Za-z0-9_.-]{0,127}`` of the node's contract.

The alphabet has no path separators and cannot start with a dot, so an id is always a
plain file name inside the capsule directory (no traversal); ``..`` is refused too.
"""
from __future__ import annotations

import os
import re

from capsule_ros.config import ID_PATTERN
from capsule_ros.errors import InvalidArgument

_ID_RE = re.compile(ID_PATTERN)


def check_capsule_id(capsule_id: str) -> str:
    """Return ``capsule_id`` if valid, else raise InvalidArgument quoting it."""
    if not isinstance(capsule_id, str) or not _ID_RE.fullmatch(capsule_id) or ".." in capsule_id:
        raise InvalidArgument(f"capsule id {capsule_id!r} is malformed: must match {ID_PATTERN} "
                              "and contain no '..'")
    return capsule_id


def new_capsule_id(episode: int, step: int) -> str:
    """A readable, unique id: episode, step and 6 random hex digits (e.g. e3.s120.9f31c2)."""
    return f"e{episode}.s{step}.{os.urandom(3).hex()}"
