"""Message types for reading and writing bags without ROS: a ``rosbags`` typestore of
ROS 2 Kilted plus capsule_ros's own ``Action`` and ``CapsuleEvent``.

Our definitions come from the package's ``msg/`` (the installed share directory or the
source tree); when neither is present (a pip install of the core on a machine without
ROS) they come from the definitions a bag carries itself (MCAP schemas, the sqlite3
``message_definitions`` table), so a bag stays readable wherever it goes. Each call
builds a fresh typestore: registering never touches shared state.
"""
from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any, Iterable, List, Optional

import numpy as np
from rosbags.interfaces import Connection, MessageDefinitionFormat
from rosbags.typesys import Stores, get_types_from_idl, get_types_from_msg, get_typestore
from rosbags.typesys.store import Typestore

from capsule_ros.bag.errors import BadBag
from capsule_ros.paths import share_dirs

PACKAGE = "capsule_ros"
ACTION_TYPE = f"{PACKAGE}/msg/Action"
EVENT_TYPE = f"{PACKAGE}/msg/CapsuleEvent"
OWN_TYPES = (ACTION_TYPE, EVENT_TYPE)


def msg_directories() -> List[Path]:
    """Where our ``.msg`` files may be: the installed share directory, the source tree."""
    return share_dirs("msg")


def _package_definition(msgtype: str) -> Optional[str]:
    name = msgtype.rsplit("/", 1)[-1]
    for directory in msg_directories():
        path = directory / f"{name}.msg"
        if path.is_file():
            return path.read_text()
    return None


def _register(store: Typestore, types: dict) -> None:
    """Register only the types the store does not know (never redefine a standard one)."""
    new = {name: value for name, value in types.items() if name not in store.types}
    if new:
        store.register(new)


def build_typestore(connections: Iterable[Connection] = ()) -> Typestore:
    """ROS 2 Kilted types, ours, and any other type a bag's connections define."""
    store = get_typestore(Stores.ROS2_KILTED)
    for msgtype in OWN_TYPES:
        text = _package_definition(msgtype)
        if text is not None:
            _register(store, get_types_from_msg(text, msgtype))
    for conn in connections:
        if conn.msgtype in store.types:
            continue
        definition = conn.msgdef
        try:
            if definition.format == MessageDefinitionFormat.MSG and definition.data:
                _register(store, get_types_from_msg(definition.data, conn.msgtype))
            elif definition.format == MessageDefinitionFormat.IDL and definition.data:
                _register(store, get_types_from_idl(definition.data))
        except Exception as exc:  # noqa: BLE001 - a garbled definition is a bad bag
            raise BadBag(f"topic {conn.topic}: unreadable message definition of {conn.msgtype} ({exc})") from None
    missing = [t for t in OWN_TYPES if t not in store.types]
    if missing:
        raise BadBag(f"no definition of {missing}: neither the bag nor an installed capsule_ros provides one")
    return store


def _empty_wide_sequences(message: Any) -> int:
    """Empty sequences of 8-byte elements (float64, int64, uint64) in ``message``, nested
    messages included."""
    count = 0
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        if isinstance(value, np.ndarray):
            count += value.ndim == 1 and value.size == 0 and value.dtype.itemsize == 8
        elif dataclasses.is_dataclass(value):
            count += _empty_wide_sequences(value)
        elif isinstance(value, list):
            count += sum(_empty_wide_sequences(v) for v in value if dataclasses.is_dataclass(v))
    return count


def deserialize(store: Typestore, data: bytes, msgtype: str) -> Any:
    """CDR bytes -> message, accepting the bytes (not zeroed) Fast DDS leaves after the last
    field, which ``Typestore.deserialize_cdr`` refuses beyond 3 bytes: the buffer is as long
    as its size estimate, which pads to the alignment after the last field (up to 7 bytes)
    and aligns the data of every sequence of 8-byte elements even when it is empty, where
    the serialiser writes no padding (up to 4 bytes each: a JointState with empty velocity
    and effort arrives 8 bytes longer than its fields). More left over, or a short read,
    raises ValueError."""
    if len(data) < 4 or data[:2] not in (b"\x00\x00", b"\x00\x01"):
        raise ValueError("invalid or unsupported CDR encapsulation")
    msgdef = store.get_msgdef(msgtype)
    func = msgdef.deserialize_cdr_le if data[1] else msgdef.deserialize_cdr_be
    try:
        message, pos = func(memoryview(data)[4:], 0, msgdef.cls, store)
    except (struct.error, UnicodeDecodeError, ValueError, IndexError) as exc:
        raise ValueError(f"cannot deserialize {msgtype}: {exc}") from None
    rest = len(data) - 4 - pos
    if rest > 7 + 4 * _empty_wide_sequences(message):
        raise ValueError(f"{msgtype}: {rest} bytes after the last field")
    return message
