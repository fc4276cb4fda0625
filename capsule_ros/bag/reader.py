"""Reading a capsule_ros bag: its metadata, a pre-scan, and its messages in order.

``Recording`` opens a rosbag2 directory (MCAP or sqlite3) with ``rosbags`` and refuses,
with a ``BadBag`` that says why, anything a replay cannot trust: no ``metadata.yaml``,
an unreadable or truncated storage file, a missing topic or recorded config, an
undecodable action or event, a message digest that differs from the recorded one.

``scan()`` reads the bag once without deserialising sensor data: it checks the digest
and returns a ``BagScan`` (events, compact actions, tick times) from which the replay
schedules each capsule event (``capsule_ros.bag.schedule``). ``entries()`` then streams
the messages, in the order the node processed them (log time order).
"""
from __future__ import annotations

import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import yaml
from rosbags.rosbag2 import Reader

from capsule_ros.bag.errors import BadBag
from capsule_ros.bag.metadata import MessageDigest, RecordingMeta
from capsule_ros.bag.typestore import ACTION_TYPE, EVENT_TYPE, build_typestore, deserialize
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.records import EventKind

SENSOR, ACTION, EVENT = "sensor", "action", "event"
# fields `ros2 bag info` (rosbag2_storage's YAML parser) reads from metadata.yaml
BAG_INFO_FIELDS = ("version", "storage_identifier", "duration", "starting_time", "message_count",
                   "topics_with_message_count", "compression_format", "compression_mode",
                   "relative_file_paths", "files", "custom_data", "ros_distro")
_CAPSULE_ID_STEP = re.compile(r"e(\d+)\.s(\d+)\.[0-9a-f]{6}")


def capsule_id_position(capsule_id: str) -> Optional[Tuple[int, int]]:
    """(episode, step) from a capsule id the node generated (``e3.s120.9f31c2``), else None."""
    match = _CAPSULE_ID_STEP.fullmatch(capsule_id)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class Entry:
    """One message of the bag, in order."""

    kind: str                 # SENSOR, ACTION or EVENT
    index: int                # position among the bag's capsule_ros messages, from 0
    time: int                 # log time (ns), strictly increasing
    topic: str
    msgtype: str
    data: bytes
    port: str = ""            # SENSOR: the port the topic feeds


@dataclass(frozen=True)
class IgnoredTopic:
    """A topic of the bag that the replay does not read."""

    topic: str
    msgtype: str
    messages: int

    def describe(self) -> str:
        return f"{self.topic} ({self.msgtype}, {self.messages} message{'s' if self.messages != 1 else ''})"


@dataclass(frozen=True)
class ActionInfo:
    """What scheduling needs of a recorded action."""

    time: int
    index: int
    episode: int
    step: int
    lineage: str
    source: int


@dataclass(frozen=True)
class RecordedEvent:
    """A recorded ``CapsuleEvent``."""

    time: int
    index: int
    kind: EventKind
    capsule_id: str
    parent_id: str
    episode: int
    step: int
    rollback: bool
    fallback: bool
    detail: str

    @property
    def boundary_step(self) -> int:
        """The step of the state the event's capsule holds. The node's COMMIT event carries
        the session's step when it is published, which is later than the snapshot when a
        step ran while the capsule was saved; capsule ids ``e<episode>.s<step>.<hex>`` say
        the snapshot's step."""
        position = capsule_id_position(self.capsule_id)
        return position[1] if position else self.step

    @classmethod
    def of(cls, msg: Any, time: int, index: int) -> RecordedEvent:
        try:
            kind = EventKind(int(msg.kind))
        except ValueError:
            raise BadBag(f"capsule event #{index} has an unknown kind {msg.kind}") from None
        return cls(time, index, kind, str(msg.capsule_id), str(msg.parent_id), int(msg.episode_id), int(msg.step),
                   bool(msg.rollback), bool(msg.fallback), str(msg.detail))


@dataclass
class BagScan:
    """The pre-scan of a bag (see the module docstring)."""

    actions: List[ActionInfo] = field(default_factory=list)
    events: List[RecordedEvent] = field(default_factory=list)
    trigger_times: array[int] = field(default_factory=lambda: array("q"))   # log times of trigger messages
    sensor_times: array[int] = field(default_factory=lambda: array("q"))    # log times of all sensor messages
    counts: Dict[str, int] = field(default_factory=dict)     # messages per topic
    messages: int = 0
    start_ns: int = 0
    end_ns: int = 0


def _metadata(path: Path) -> Dict[str, Any]:
    """``rosbag2_bagfile_information`` of ``metadata.yaml`` (BadBag if absent or garbled)."""
    meta_path = path / "metadata.yaml"
    try:
        document = yaml.safe_load(meta_path.read_text())
        info = document["rosbag2_bagfile_information"]
        if not isinstance(info, dict):
            raise TypeError("not a mapping")
        return info
    except FileNotFoundError:
        raise BadBag(f"{path} is not a rosbag2 bag: no metadata.yaml") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise BadBag(f"{meta_path}: unreadable rosbag2 metadata ({type(exc).__name__}: {exc})".replace("\n", " ")) \
            from None


class Recording:
    """An opened capsule_ros bag (a context manager); see the module docstring.

    ``config`` overrides the recorded ServingConfig (``--params-file``); it also makes
    bags without capsule_ros metadata replayable (e.g. from ``ros2 bag record``).
    """

    def __init__(self, path, config: Optional[ServingConfig] = None):
        path = Path(path).expanduser()
        if path.is_file() and (path.parent / "metadata.yaml").is_file():
            path = path.parent                     # the storage file was given: use its bag
        if not path.exists():
            raise BadBag(f"no such bag: {path}")
        self.path = path
        self.info = _metadata(path)
        self.storage = str(self.info.get("storage_identifier", "?"))
        self._override = config
        self.ignored: List[IgnoredTopic] = []          # topics of the bag the replay does not read
        self.has_own_metadata = False                   # recorded by capsule_ros (its custom_data)
        self._reader: Optional[Reader] = None
        self._scan: Optional[BagScan] = None

    # -- opening ------------------------------------------------------------------------------
    def __enter__(self) -> Recording:
        try:
            self._reader = Reader(self.path)
            self._reader.open()
        except Exception as exc:  # noqa: BLE001 - rosbags raises many kinds on damaged files
            self._reader = None
            raise BadBag(f"cannot open bag {self.path}: {_reason(exc)}") from None
        try:
            self._bind()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                reader.close()
            except Exception:  # noqa: BLE001 - closing a damaged file must not hide the real error
                pass

    def _bind(self) -> None:
        """Metadata, typestore and the topic -> role map."""
        assert self._reader is not None                 # bound right after opening
        connections = self._reader.connections
        by_type: Dict[str, List[str]] = {}
        for conn in connections:
            by_type.setdefault(conn.msgtype, []).append(conn.topic)
        custom = self.info.get("custom_data") or {}
        self.has_own_metadata = "capsule_ros.params" in custom
        if self._override is not None and "capsule_ros.params" not in custom:
            actions, events = by_type.get(ACTION_TYPE, []), by_type.get(EVENT_TYPE, [])
            if len(actions) != 1 or len(events) != 1:
                raise BadBag(f"the bag has {len(actions)} {ACTION_TYPE} and {len(events)} {EVENT_TYPE} topics; "
                             "expected one of each")
            meta = RecordingMeta.from_config(self._override, actions[0], events[0])
        else:
            meta = RecordingMeta.from_custom_data(custom)
            if self._override is not None:
                meta = meta.with_config(self._override)
        self.meta = meta
        self.config = self._override or meta.config(source=f"{self.path} (recorded)")
        missing = [t for t in (meta.action_topic, meta.events_topic) if t not in {c.topic for c in connections}]
        self._roles: Dict[str, tuple] = {meta.action_topic: (ACTION, ""), meta.events_topic: (EVENT, "")}
        for name in self.config.ports:
            port = meta.ports.get(name)
            if port is None or port.topic not in {c.topic for c in connections}:
                missing.append(port.topic if port else f"<port {name}>")
            else:
                self._roles[port.topic] = (SENSOR, name)
        if missing:
            raise BadBag(f"the bag lacks topic(s) {missing} (it has {sorted(c.topic for c in connections)})")
        self._connections = [c for c in connections if c.topic in self._roles]
        self.ignored = self._ignored_topics(c for c in connections if c.topic not in self._roles)
        self.typestore = build_typestore(self._connections)

    @staticmethod
    def _ignored_topics(connections) -> List[IgnoredTopic]:
        """Topics no port, action or event stream reads (``ros2 bag record -a`` adds /tf,
        /rosout...; an edit may add anything): the replay neither feeds nor checks them,
        and its verdict lists them so that nothing in the bag passes unseen."""
        counts: Dict[Tuple[str, str], int] = {}
        for conn in connections:
            key = (conn.topic, conn.msgtype)
            counts[key] = counts.get(key, 0) + int(getattr(conn, "msgcount", 0) or 0)
        return [IgnoredTopic(topic, msgtype, n) for (topic, msgtype), n in sorted(counts.items())]

    # -- reading --------------------------------------------------------------------------------
    def entries(self) -> Iterator[Entry]:
        """Every capsule_ros message, in log time order (BadBag when the storage fails)."""
        if self._reader is None:
            raise RuntimeError("Recording is not open")
        messages = self._reader.messages(self._connections)
        index = 0
        last = None
        while True:
            try:
                conn, log_time, data = next(messages)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - damaged storage: any rosbags error
                raise BadBag(f"unreadable after message {index} of {self.path}: {_reason(exc)}") from None
            if last is not None and log_time <= last:
                raise BadBag(f"message {index}: log time {log_time} does not increase (previous {last}); "
                             "the node's processing order is lost")
            last = log_time
            kind, port = self._roles[conn.topic]
            yield Entry(kind, index, log_time, conn.topic, conn.msgtype, bytes(data), port)
            index += 1

    def decode(self, entry: Entry) -> Any:
        """The message of an entry (a rosbags dataclass); raises on undecodable data."""
        return deserialize(self.typestore, entry.data, entry.msgtype)

    def decode_own(self, entry: Entry) -> Any:
        """An action or event message, or BadBag: the node never publishes garbage."""
        try:
            return self.decode(entry)
        except Exception as exc:  # noqa: BLE001 - garbled CDR
            raise BadBag(f"{entry.kind} message {entry.index} on {entry.topic} does not decode: {_reason(exc)}") \
                from None

    def scan(self) -> BagScan:
        """The pre-scan (cached); checks the recorded digest and message count."""
        if self._scan is not None:
            return self._scan
        scan = BagScan()
        digest = MessageDigest()
        trigger = self.config.control.trigger_port
        for entry in self.entries():
            digest.update(entry.topic, entry.time, entry.data)
            scan.counts[entry.topic] = scan.counts.get(entry.topic, 0) + 1
            if entry.kind == ACTION:
                msg = self.decode_own(entry)
                scan.actions.append(ActionInfo(entry.time, entry.index, int(msg.episode_id), int(msg.step),
                                                   str(msg.lineage), int(msg.source)))
            elif entry.kind == EVENT:
                scan.events.append(RecordedEvent.of(self.decode_own(entry), entry.time, entry.index))
            else:
                scan.sensor_times.append(entry.time)
                if entry.port == trigger and len(scan.sensor_times) > self.meta.initial_inputs:
                    scan.trigger_times.append(entry.time)     # the inputs' state at the start made no step
            scan.start_ns = scan.start_ns or entry.time
            scan.end_ns = entry.time
        scan.messages = digest.count
        meta = self.meta
        if meta.messages >= 0 and digest.count != meta.messages:
            raise BadBag(f"truncated or altered: {digest.count} messages readable, {meta.messages} recorded")
        if meta.digest and digest.hexdigest() != meta.digest:
            raise BadBag("garbled: the messages' SHA-256 differs from the digest recorded in metadata.yaml")
        self._scan = scan
        return scan


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
