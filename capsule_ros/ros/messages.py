"""Conversions between the core's records and capsule_ros messages."""
from __future__ import annotations

import array

from builtin_interfaces.msg import Time

from capsule_ros.capsules.store import Capsule
from capsule_ros.msg import Action, CapsuleEvent, CapsuleInfo
from capsule_ros.serving.records import ActionRecord, EventRecord


def ros_time(stamp_ns: int) -> Time:
    return Time(sec=int(stamp_ns // 1_000_000_000), nanosec=int(stamp_ns % 1_000_000_000))


def capsule_info(capsule: Capsule) -> CapsuleInfo:
    return CapsuleInfo(id=capsule.id, label=capsule.label, parent_id=capsule.parent_id,
                       episode_id=int(capsule.episode_id), step=int(capsule.step), bytes=int(capsule.nbytes),
                       fingerprint=capsule.fingerprint, tier=int(capsule.tier), pinned=bool(capsule.pinned),
                       persisted=capsule.persisted, stamp=ros_time(capsule.stamp_ns))


def _float32_array(values) -> array.array:
    """numpy -> array('f'): the generated setters take it without checking each element."""
    out = array.array("f")
    out.frombytes(values.astype("float32", copy=False).tobytes())
    return out


def action_message(record: ActionRecord, frame_id: str, action_dim: int) -> Action:
    msg = Action()
    msg.header.stamp = ros_time(record.stamp_ns)
    msg.header.frame_id = frame_id
    msg.episode_id = int(record.episode_id)
    msg.step = int(record.step)
    msg.lineage = record.lineage
    msg.source = int(record.source)
    msg.values = _float32_array(record.values)
    if record.chunk is not None:
        msg.chunk = _float32_array(record.chunk)
        msg.chunk_horizon = int(record.chunk.shape[0])
    msg.action_dim = int(action_dim)
    return msg


def event_message(event: EventRecord, stamp_ns: int) -> CapsuleEvent:
    msg = CapsuleEvent(kind=int(event.kind), capsule_id=event.capsule_id, parent_id=event.parent_id,
                       episode_id=int(event.episode_id), step=int(event.step), rollback=event.rollback,
                       fallback=event.fallback, detail=event.detail)
    msg.header.stamp = ros_time(stamp_ns)
    return msg
