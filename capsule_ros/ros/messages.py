"""Conversions between the core's records and capsule_ros messages, and the verbs'
service requests and responses."""
from __future__ import annotations

import array
from typing import Any, Dict

from builtin_interfaces.msg import Time
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

from capsule_ros import srv
from capsule_ros.capsules.store import Capsule
from capsule_ros.msg import Action, CapsuleEvent, CapsuleInfo
from capsule_ros.serving.records import ActionRecord, EpisodeStart, EventRecord, RecordResult, ReenterResult
from capsule_ros.serving.verbs import Verb


def ros_time(stamp_ns: int) -> Time:
    return Time(sec=int(stamp_ns // 1_000_000_000), nanosec=int(stamp_ns % 1_000_000_000))


def capsule_info(capsule: Capsule) -> CapsuleInfo:
    recipe = capsule.recipe
    note = recipe.describe() if recipe is not None else "no recipe" if capsule.persisted else ""
    return CapsuleInfo(id=capsule.id, label=capsule.label, parent_id=capsule.parent_id,
                       episode_id=int(capsule.episode_id), step=int(capsule.step), bytes=int(capsule.nbytes),
                       fingerprint=capsule.fingerprint, tier=int(capsule.tier), pinned=bool(capsule.pinned),
                       persisted=capsule.persisted, stamp=ros_time(capsule.stamp_ns),
                       valid=not capsule.stale, invalid_cause=capsule.stale,
                       recipe_bytes=recipe.nbytes if recipe is not None else 0,
                       regenerable=bool(recipe is not None and recipe.regenerable), recipe_note=note)


def _float32_array(values: Any) -> array.array:
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


# -- the verbs' services (capsule_ros.serving.verbs) --------------------------------------------------
SERVICE_HISTORY = 100    # answers a client keeps before it takes them (ROS's services default: 10)


def service_qos() -> QoSProfile:
    """The QoS of the capsule services and of this package's clients of them. A service's
    answers to all its clients travel on one topic, and every client's reader keeps the last
    ``depth`` of them until it takes its own: with ROS's default of 10, a client that is slow
    to take (a busy process) while other clients call loses its answer once 10 others have
    passed, and waits for nothing until its timeout (a commit asked again would commit twice)."""
    return QoSProfile(depth=SERVICE_HISTORY, reliability=ReliabilityPolicy.RELIABLE, history=HistoryPolicy.KEEP_LAST)


def action_services_qos() -> Dict[str, QoSProfile]:
    """An action's three services (goal, result, cancel) at ``service_qos``: rclpy's
    ``ActionServer`` / ``ActionClient`` keyword arguments (``~/run_policy`` and its clients)."""
    return {f"{name}_service_qos_profile": service_qos() for name in ("goal", "result", "cancel")}


def srv_type(verb: Verb) -> Any:
    """The ``capsule_ros/srv`` type of a verb."""
    return getattr(srv, verb.srv)


def request_fields(request: Any) -> Dict[str, Any]:
    """A request's fields by name, in the ``.srv`` file's order: a verb's arguments."""
    return {name: getattr(request, name) for name in request.get_fields_and_field_types()}


def fill_response(response: Any, result: Any) -> None:
    """The fields of a verb's response from its result (by the result's type, so a verb
    needs no code of its own here): a capsule, a new episode, a re-entry, a listing, a
    recording; None fills nothing."""
    if isinstance(result, Capsule):
        response.capsule = capsule_info(result)
        if hasattr(response, "path"):                  # SaveCapsule: the file written
            response.path = result.path or ""
    elif isinstance(result, EpisodeStart):
        response.episode_id = int(result.episode_id)
        if result.capsule is not None:
            response.capsule = capsule_info(result.capsule)
    elif isinstance(result, ReenterResult):
        if result.capsule is not None:
            response.capsule = capsule_info(result.capsule)
        response.rollback, response.fallback = result.rollback, result.fallback
        response.fallback_reason = result.fallback_reason
        response.restore_ms, response.recompute_ms = result.restore_seconds * 1e3, result.recompute_seconds * 1e3
    elif isinstance(result, RecordResult):
        response.bag_path, response.messages = result.bag_path, int(result.messages)
    elif isinstance(result, list):
        response.capsules = [capsule_info(c) for c in result]
