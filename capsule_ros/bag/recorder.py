"""Recording a node's inputs, actions and capsule events into a standard rosbag2.

``BagWriter`` is a ``rosbags`` writer that also digests every message into the bag's
metadata (see ``capsule_ros.bag.metadata``). Its callers give log times that strictly
increase in write order (``max(last + 1, stamp)``), so readers that sort by time keep
the order the node processed messages in: replay depends on it.

``NodeRecorder`` is the node's side (``capsule_ros.ros.publishing.NodeRecording`` holds
it): callers on any thread (control loop, watchdog, services) only take a short lock to stamp a message and queue
it; one writer thread serialises and writes, so disk I/O never stalls a control step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import queue
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from rosbags.interfaces import Connection, Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime
from rosbags.rosbag2 import StoragePlugin, Writer, WriterError
from rosbags.typesys.store import Typestore

from capsule_ros.bag.errors import RecordArgumentError, RecordError
from capsule_ros.bag.metadata import MessageDigest, RecordingMeta, resolve_topic
from capsule_ros.bag.typestore import ACTION_TYPE, EVENT_TYPE, build_typestore

LOG = logging.getLogger(__name__)
STORAGES: Mapping[str, StoragePlugin] = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}


def reliable_qos(depth: int) -> Qos:
    """The QoS our ~/action and ~/capsule_events publishers offer (reliable, volatile)."""
    default = QosTime(0, 0)          # RMW_DURATION_UNSPECIFIED: the rclpy default (no deadline etc.)
    return Qos(QosHistory.KEEP_LAST, depth, QosReliability.RELIABLE, QosDurability.VOLATILE, default, default,
               QosLiveliness.AUTOMATIC, default, False)


def storage_plugin(storage: str) -> StoragePlugin:
    try:
        return STORAGES[storage]
    except KeyError:
        raise RecordArgumentError(f"storage {storage!r}: must be one of {sorted(STORAGES)}") from None


def new_bag_path(directory: str) -> Path:
    """``<directory>/capsule_ros_<UTC stamp>`` (``~`` expanded), made unique."""
    parent = Path(directory).expanduser()
    stem = "capsule_ros_" + time.strftime("%Y_%m_%d-%H_%M_%S", time.gmtime())
    path, serial = parent / stem, 0
    while path.exists():
        serial += 1
        path = parent / f"{stem}_{serial}"
    return path


class BagWriter:
    """A rosbag2 bag being written (see the module docstring); a context manager.

    Use it from one thread (sqlite3 requires it)."""

    def __init__(self, path: Path, storage: str, typestore: Typestore):
        self.path = Path(path).expanduser()
        self.storage = storage
        self.typestore = typestore
        self.digest = MessageDigest()
        plugin = storage_plugin(storage)
        try:
            self._writer = Writer(self.path, version=Writer.VERSION_LATEST, storage_plugin=plugin)
        except WriterError:
            raise RecordError(f"bag {str(self.path)!r} exists already: choose another path") from None
        self._connections: Dict[str, Connection] = {}
        self._open = False
        self._made: Optional[Path] = None          # the topmost directory open() made: discard() removes it

    def open(self) -> BagWriter:
        made = None if self.path.exists() else self.path
        while made is not None and made.parent != made and not made.parent.exists():
            made = made.parent
        try:
            _make_parent(self.path)
            self._writer.open()
        except (WriterError, OSError) as exc:
            _remove(made)
            raise RecordError(f"cannot create bag {str(self.path)!r}: {exc}") from None
        self._made = made
        self._open = True
        return self

    def add_topic(self, topic: str, msgtype: str, qos: Sequence[Qos] = ()) -> Connection:
        """The topic's connection (created on first use)."""
        conn = self._connections.get(topic)
        if conn is None:
            if msgtype not in self.typestore.types:
                raise RecordArgumentError(f"topic {topic}: message type {msgtype!r} is unknown to the typestore")
            conn = self._writer.add_connection(topic, msgtype, typestore=self.typestore, offered_qos_profiles=qos)
            self._connections[topic] = conn
        return conn

    def add_recording_topics(self, meta: RecordingMeta) -> None:
        """A connection per port, ``~/action`` and ``~/capsule_events``, even if they stay empty."""
        for port in meta.ports.values():
            self.add_topic(port.topic, port.type)
        self.add_topic(meta.action_topic, ACTION_TYPE, (reliable_qos(10),))
        self.add_topic(meta.events_topic, EVENT_TYPE, (reliable_qos(100),))

    def write(self, topic: str, msgtype: str, data: bytes, log_time: int) -> None:
        """Write one serialized message at ``log_time`` (callers keep times increasing)."""
        conn = self.add_topic(topic, msgtype)
        self._writer.write(conn, log_time, data)
        self.digest.update(topic, log_time, data)

    def close(self, meta: Optional[RecordingMeta] = None) -> int:
        """Write the metadata (``meta`` with this bag's digest) and close; returns the count."""
        if not self._open:
            return self.digest.count
        self._open = False
        if meta is not None:
            meta = dataclasses.replace(meta, digest=self.digest.hexdigest(), messages=self.digest.count)
            for key, value in meta.to_custom_data().items():
                self._writer.set_custom_data(key, value)
        try:
            self._writer.close()
        except (WriterError, OSError) as exc:
            raise RecordError(f"cannot finish bag {str(self.path)!r}: {exc}") from None
        return self.digest.count

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._writer.abort()

    def discard(self) -> None:
        """Abort and remove what ``open`` made: a bag that could not be finished (a full disk)
        leaves nothing half-written behind."""
        self._open = False
        with contextlib.suppress(Exception):         # also after a close that failed half-way
            self._writer.abort()
        _remove(self._made)
        self._made = None

    def __enter__(self) -> BagWriter:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()                          # a no-op when the caller closed it with metadata


def _make_parent(path: Path) -> None:
    """``path``'s directory, made with its parents; the error names the real cause (a file
    or a symlink loop where a directory should be), not mkdir's "File exists"."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        if not stat.S_ISDIR(os.stat(path.parent).st_mode):          # a symlink loop raises ELOOP here
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent)) from None


def _remove(made: Optional[Path]) -> None:
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


_STOP = object()


class NodeRecorder:
    """The node's recording (see the module docstring). Start with ``NodeRecorder.start``.

    The bag lives on the writer thread from open to close (sqlite3 connections are bound
    to the thread that made them); ``start`` and ``close`` wait for it and re-raise its
    errors."""

    def __init__(self, path: Path, storage: str, meta: RecordingMeta,
                 serialize: Optional[Callable[[Any], bytes]] = None):
        """``serialize``: turns a message object given to ``write_message`` into its CDR
        bytes, on the writer thread (the node passes rclpy's ``serialize_message``: this
        layer needs no ROS)."""
        self.meta = meta
        self._serialize = serialize
        self.path = str(path)
        self.storage = storage
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._closed = False
        self._last = -1
        self._error: Optional[BaseException] = None
        self._count = 0
        self._thread = threading.Thread(target=self._run, name="capsule_ros.bag", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    @classmethod
    def start(cls, path: str, directory: str, storage: str, config, action_topic: str, events_topic: str,
              fingerprint: str = "", initial_inputs: int = 0,
              serialize: Optional[Callable[[Any], bytes]] = None,
              fleet: Optional[Dict[str, Any]] = None) -> NodeRecorder:
        """Open a new bag (``path`` "" = ``<directory>/<UTC stamp>``) with a connection per
        port, ``~/action`` and ``~/capsule_events``. ``initial_inputs``: how many sensor
        messages the caller writes first as the inputs' state at the start (the last
        message of each port; no step was taken on them during the recording). ``fleet``: a
        fleet robot's bag (``RecordingMeta.fleet``: ``capsule_ros.fleet.replay.fleet_record``)."""
        meta = dataclasses.replace(RecordingMeta.for_node(config, action_topic, events_topic, fingerprint),
                                   initial_inputs=initial_inputs, fleet=dict(fleet or {}))
        storage = storage or "mcap"
        storage_plugin(storage)                   # refuse a bad name before any thread starts
        recorder = cls(Path(path).expanduser() if path else new_bag_path(directory), storage, meta, serialize)
        LOG.info("recording to %s (%s)", recorder.path, storage)
        return recorder

    # -- called by the node, from any thread ----------------------------------------------------
    def write_raw(self, topic: str, msgtype: str, raw_cdr: bytes, stamp_ns: int) -> None:
        """A sensor message as received (``topic`` as configured: resolved like the node)."""
        self._put(resolve_topic(topic, self.meta.node), msgtype, bytes(raw_cdr), stamp_ns)

    def write_message(self, topic: str, msg: Any, stamp_ns: int) -> None:
        """A published ``~/action`` or ``~/capsule_events`` message (serialized on the writer
        thread with the recorder's ``serialize``)."""
        msgtype = ACTION_TYPE if topic == self.meta.action_topic else EVENT_TYPE
        self._put(topic, msgtype, msg, stamp_ns)

    def close(self) -> int:
        """Stop, write the metadata, close the bag; returns the number of messages written."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        self._thread.join()
        if self._error is not None:
            raise RecordError(f"recording to {self.path} failed after {self._count} messages: {self._error}")
        LOG.info("recorded %d messages to %s", self._count, self.path)
        return self._count

    @property
    def messages(self) -> int:
        return self._count

    # -- internals ----------------------------------------------------------------------------------
    def _put(self, topic: str, msgtype: str, payload: Any, stamp_ns: int) -> None:
        with self._lock:                 # stamping and queueing together: log time order = queue order
            if self._closed:
                return                   # a late message from a thread that raced the stop
            self._last = max(self._last + 1, int(stamp_ns))
            self._queue.put((topic, msgtype, payload, self._last))

    def _open(self) -> BagWriter:
        writer = BagWriter(Path(self.path), self.storage, build_typestore()).open()
        try:
            writer.add_recording_topics(self.meta)
        except BaseException:
            writer.discard()
            raise
        return writer

    def _run(self) -> None:
        try:
            writer = self._open()
        except Exception as exc:  # noqa: BLE001 - re-raised by __init__ in the caller's thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if self._error is not None:
                continue
            topic, msgtype, payload, log_time = item
            try:
                if isinstance(payload, bytes):
                    data = payload
                elif self._serialize is not None:
                    data = self._serialize(payload)
                else:
                    raise RecordError("write_message needs the recorder's serialize function")
                writer.write(topic, msgtype, data, log_time)
                self._count += 1
            except Exception as exc:  # noqa: BLE001 - disk full etc.: stop writing, report at close
                self._error = exc
                LOG.error("recording to %s failed: %r; further messages are not recorded", self.path, exc)
        if self._error is not None:
            writer.discard()
            return
        try:
            writer.close(self.meta)
        except Exception as exc:  # noqa: BLE001 - reported by close()
            self._error = exc
            writer.discard()


def write_bag(path: Path, storage: str, meta: RecordingMeta, typestore: Typestore,
              messages: Iterable[Tuple[str, str, bytes, int]]) -> int:
    """Write ``(topic, msgtype, data, log_time)`` messages (times increasing) into a new bag
    with ``meta`` and a connection for each of its topics; returns the count. Used to
    edit or convert bags."""
    last = -1
    with BagWriter(path, storage, typestore) as writer:
        writer.add_recording_topics(meta)
        for topic, msgtype, data, log_time in messages:
            last = max(last + 1, int(log_time))
            writer.write(topic, msgtype, data, last)
        return writer.close(meta)
