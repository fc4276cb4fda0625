"""Port adapters: a sensor message -> the values of one fixed-shape input buffer.

ROS-free: an adapter reads attributes of any message-like object, so the same code
serves rclpy messages in the node and ``rosbags`` messages in an in-process replay.

Every message is either accepted (its values go to the staging buffer) or dropped and
counted under one reason: ``shape`` (wrong length or image size), ``type`` (wrong
encoding, missing joint, unreadable field), ``nonfinite`` (NaN / Inf, or a value the
buffer's dtype cannot hold: ``1e39`` would become ``inf`` in a float32 buffer),
``out_of_order`` (header stamp older than the last accepted one), ``future`` (header
stamp further ahead of the receiver's clock than the tolerance: a sensor with a bad
clock must not move the ordering point, or every correctly stamped message after it
would be dropped as out of order). A message that cannot be read at all counts as
``type``. Dropping never touches the buffer.

Text ports (``std_msgs/msg/String``: a VLA's task instruction) are filled by the policy's
own encoder (``StatefulPolicy.text_inputs``: its tokenizer), given to ``SensorInputs``; until
a message arrives the buffer holds the encoder's default text. They are read from the
message's serialized bytes (``takes_raw``: the node subscribes raw, a replay feeds the
recorded bytes), decoded as UTF-8 strictly: bytes that are not UTF-8 are dropped as
``type``, where rclpy would have replaced them and the policy would have seen other text.

Ages and staleness are judged on the receiver's clock, the one ``accept`` is given (the
node's ROS clock; a replay's log time), so an in-process replay counts stale steps
where the node counted them. When that clock jumps (``clock_jumped``: a simulated clock
going back to a bag's start), the ordering point is forgotten, since the sensors' stamps
start over on the new timeline, and the time of the last accepted message moves with the
clock, so ages go on growing across the jump and staleness still applies.
"""
from __future__ import annotations

import array
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, MutableMapping, Optional

import numpy as np

from capsule_ros.serving.config import PortConfig

DROP_REASONS = ("shape", "type", "nonfinite", "out_of_order", "future")


class PortDrop(Exception):
    """A message was refused; ``reason`` is one of DROP_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class PortCounters:
    received: int = 0
    dropped: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    stale_steps: int = 0
    last_accept_ns: Optional[int] = None      # the receiver's clock at the last accepted message

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


def _field_names(msg: Any) -> List[str]:
    """Field names of an rclpy message (declaration order) or a rosbags dataclass."""
    if hasattr(msg, "get_fields_and_field_types"):
        return list(msg.get_fields_and_field_types())
    if dataclasses.is_dataclass(msg):
        return [f.name for f in dataclasses.fields(msg) if not f.name.startswith("__")]
    raise PortDrop("type", f"cannot read fields of {type(msg).__name__}")


def flatten_numbers(value: Any) -> np.ndarray:
    """A number, a numeric sequence (array.array, list, numpy), or a nested message of
    numeric fields -> float64 numbers, in declaration order (Quaternion -> x, y, z, w)."""
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return np.array([float(value)])
    if isinstance(value, (np.ndarray, array.array)):
        return np.asarray(value, dtype=np.float64).ravel()
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, (bool, int, float, np.number)) for v in value):
            return np.asarray(value, dtype=np.float64)
        parts = [flatten_numbers(v) for v in value]
    else:
        parts = [flatten_numbers(getattr(value, name)) for name in _field_names(value)]
    return np.concatenate(parts) if parts else np.zeros(0)


def _resolve(msg: Any, path: str) -> Any:
    value = msg
    for part in path.split("."):
        if not hasattr(value, part):
            raise PortDrop("type", f"message has no field {path!r}")
        value = getattr(value, part)
    return value


def stamp_ns(msg: Any) -> Optional[int]:
    """header.stamp in nanoseconds, or None for messages without a header."""
    header = getattr(msg, "header", None)
    stamp = getattr(header, "stamp", None)
    if stamp is None:
        return None
    return int(stamp.sec) * 1_000_000_000 + int(getattr(stamp, "nanosec", 0))


TEXT_TYPE = "std_msgs/msg/String"
TextEncoder = Callable[[str], np.ndarray]


def cdr_string(raw: bytes) -> str:
    """The ``data`` of a serialized ``std_msgs/msg/String`` (CDR: a 4-byte encapsulation
    header, a uint32 length counting the terminating NUL, the bytes), decoded as UTF-8;
    PortDrop ``type`` when it is not one or not UTF-8."""
    if len(raw) < 8 or raw[0] != 0 or raw[1] not in (0, 1):
        raise PortDrop("type", f"not a serialized std_msgs/msg/String ({len(raw)} bytes)")
    length = int.from_bytes(raw[4:8], "little" if raw[1] == 1 else "big")
    if length < 1 or 8 + length > len(raw) or raw[8 + length - 1] != 0:
        raise PortDrop("type", f"a std_msgs/msg/String of {len(raw)} bytes with a bad length {length}")
    try:
        return raw[8:8 + length - 1].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PortDrop("type", f"the text is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _dtype_limits(dtype: np.dtype) -> Optional[tuple]:
    """(low, high) a float64 value must lie within to be held by ``dtype``; None for floats
    (their limit shows as inf after the cast)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return float(info.min), float(info.max)
    return None


class PortAdapter:
    """Validates and converts messages of one port (see the module docstring)."""

    def __init__(self, name: str, config: PortConfig):
        self.name = name
        self.config = config
        self.counters = PortCounters()
        self.dtype = np.dtype(config.dtype)
        self._limits = _dtype_limits(self.dtype)
        self._last_stamp: Optional[int] = None
        self._short_type = config.type.rsplit("/", 1)[-1]
        self.text: Optional[TextEncoder] = None        # a text port's encoder (SensorInputs sets it)
        self.last_text: Optional[str] = None           # a text port: the text of the last accepted message
        self._decoded: Optional[str] = None

    @property
    def takes_raw(self) -> bool:
        """Whether messages come as their serialized bytes (a text port: see the module docstring)."""
        return self.config.type == TEXT_TYPE

    def reset_ordering(self) -> None:
        """Forget the last accepted stamp (a new episode: a sensor clock may have restarted)."""
        self._last_stamp = None

    def clock_jumped(self, delta_ns: int) -> None:
        """The receiver's clock jumped by ``delta_ns``: stamps start over (ordering forgotten)
        and the last message's time moves with the clock, so its age is unchanged."""
        self.reset_ordering()
        if self.counters.last_accept_ns is not None:
            self.counters.last_accept_ns += delta_ns

    def convert(self, msg: Any, now_ns: Optional[int] = None, future_tolerance_ns: Optional[int] = None) -> np.ndarray:
        """The buffer values of ``msg`` (shape config.shape, the buffer's dtype), or raise
        PortDrop. ``now_ns`` / ``future_tolerance_ns``: the receiver's clock and how far
        ahead of it a stamp may be (None: no check)."""
        if msg is None:
            raise PortDrop("type", "the message could not be decoded")
        stamp = stamp_ns(msg)
        if stamp is not None and now_ns is not None and future_tolerance_ns is not None \
                and stamp > now_ns + future_tolerance_ns:
            raise PortDrop("future", f"stamp {stamp} ns is {(stamp - now_ns) / 1e9:.3f} s ahead of the clock "
                           f"(tolerance {future_tolerance_ns / 1e9:.3f} s)")
        if stamp is not None and self._last_stamp is not None and stamp < self._last_stamp:
            raise PortDrop("out_of_order", f"stamp {stamp} ns is older than the last accepted {self._last_stamp} ns")
        if self.config.type == TEXT_TYPE:
            values = self._text(msg)
        elif self._short_type == "Image":
            values = self._image(msg)
        elif self._short_type == "JointState" and self.config.names:
            values = self._named_joints(msg)
        else:
            parts = [flatten_numbers(_resolve(msg, path)) for path in self.config.fields]
            values = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if values.size != self.config.size:
            raise PortDrop("shape", f"{values.size} values, expected {self.config.size} for shape "
                           f"{list(self.config.shape)}")
        return self._fit(values).reshape(self.config.shape)

    def _fit(self, values: np.ndarray) -> np.ndarray:
        """``values`` cast to the buffer's dtype, refusing what it cannot hold."""
        if values.dtype == self.dtype:
            return values
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise PortDrop("nonfinite", "NaN or Inf in the message")
        if self._limits is not None:
            low, high = self._limits
            bad = (values < low) | (values > high)
            if bad.any():
                raise PortDrop("nonfinite", f"value {values[bad][0]!r} does not fit the port's {self.dtype.name} "
                               f"buffer [{low:.0f}, {high:.0f}]")
            return values.astype(self.dtype)
        with np.errstate(over="ignore"):
            cast = values.astype(self.dtype)
        if not np.isfinite(cast).all():
            raise PortDrop("nonfinite", f"value {values[~np.isfinite(cast)][0]!r} overflows the port's "
                           f"{self.dtype.name} buffer (it would be inf)")
        return cast

    def accept(self, msg: Any, now_ns: Optional[int] = None, future_tolerance_ns: Optional[int] = None) -> np.ndarray:
        """``convert`` plus bookkeeping: counts the message as received or dropped.
        ``now_ns`` is the receiver's clock (ROS time in the node, the log time in a replay;
        None: the monotonic clock). A message that cannot be read at all is dropped as ``type``."""
        try:
            values = self.convert(msg, now_ns, future_tolerance_ns)
        except PortDrop as drop:
            self.counters.dropped[drop.reason] += 1
            raise
        except Exception as exc:
            self.counters.dropped["type"] += 1
            raise PortDrop("type", f"undecodable message: {type(exc).__name__}: {exc}") from exc
        stamp = stamp_ns(msg)
        if stamp is not None:
            self._last_stamp = stamp
        if self.config.type == TEXT_TYPE:
            self.last_text = self._decoded
        self.counters.received += 1
        self.counters.last_accept_ns = time.monotonic_ns() if now_ns is None else now_ns
        return values

    def age_ms(self, now_ns: Optional[int] = None) -> float:
        """Milliseconds since the last accepted message on the clock ``accept`` was given
        (``now_ns``; None: the monotonic clock); -1 if none yet, 0 if that clock went back."""
        if self.counters.last_accept_ns is None:
            return -1.0
        now = time.monotonic_ns() if now_ns is None else now_ns
        return max(now - self.counters.last_accept_ns, 0) / 1e6

    def is_stale(self, now_ns: Optional[int] = None) -> bool:
        limit = self.config.staleness_ms
        if limit <= 0:
            return False
        age = self.age_ms(now_ns)
        return age < 0 or age > limit

    def _named_joints(self, msg: Any) -> np.ndarray:
        names = list(getattr(msg, "name", []))
        try:
            index = [names.index(n) for n in self.config.names]
        except ValueError:
            missing = sorted(set(self.config.names) - set(names))
            raise PortDrop("type", f"joint(s) {missing} missing from the message") from None
        out = []
        for path in self.config.fields:
            series = flatten_numbers(_resolve(msg, path))
            if len(series) != len(names):
                raise PortDrop("shape", f"{path} has {len(series)} values for {len(names)} joints")
            out.append(series[index])
        return np.concatenate(out)

    def _text(self, msg: Any) -> np.ndarray:
        """A String message (its serialized bytes, or a message with a ``data`` str) through the encoder."""
        if self.text is None:
            raise PortDrop("type", "the policy reads no text from this port")
        if isinstance(msg, (bytes, bytearray, memoryview)):
            text = cdr_string(bytes(msg))
        elif isinstance(getattr(msg, "data", None), str):
            text = msg.data
        else:
            raise PortDrop("type", f"expected a std_msgs/msg/String, got {type(msg).__name__}")
        self._decoded = text
        return np.asarray(self.text(text))

    def _image(self, msg: Any) -> np.ndarray:
        shape = self.config.shape
        if len(shape) != 3:
            raise PortDrop("type", f"an Image port needs a [height, width, channels] shape, not {list(shape)}")
        height, width, channels = shape
        encoding = str(getattr(msg, "encoding", ""))
        if encoding not in self.config.encodings:
            raise PortDrop("type", f"encoding {encoding!r} not in {list(self.config.encodings)}")
        src_channels = 1 if encoding == "mono8" else 3
        if int(msg.height) != height or int(msg.width) != width:
            raise PortDrop("shape", f"image {msg.height}x{msg.width}, expected {height}x{width}")
        step = int(msg.step)
        data = np.frombuffer(bytes(msg.data), dtype=np.uint8)
        if step < width * src_channels or data.size != step * height:
            raise PortDrop("shape", f"image data of {data.size} bytes does not match step {step} x {height} rows")
        img: np.ndarray = data.reshape(height, step)[:, :width * src_channels].reshape(height, width, src_channels)
        if encoding == "bgr8":
            img = img[:, :, ::-1]
        if src_channels != channels:
            if channels == 1:       # colour -> grey (ITU-R 601 luma)
                img = (img.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32))[..., None]
            elif channels == 3:     # grey -> colour
                img = np.repeat(img, 3, axis=2)
            else:
                raise PortDrop("shape", f"cannot convert {encoding} to {channels} channels")
        return np.ascontiguousarray(img)


def port_adapters(ports: Mapping[str, PortConfig]) -> Dict[str, PortAdapter]:
    return {name: PortAdapter(name, cfg) for name, cfg in ports.items()}


class SensorInputs:
    """The policy's input buffers as the control loop fills them: one port adapter per
    configured port, the runtime's staging buffers, and which inputs have a value yet.

    ``lock`` guards the staging buffers: writers hold it for one copy, a step holds it from
    loading the inputs until its outputs are read (on CUDA the load is asynchronous).
    ``text``: the policy's text inputs (``StatefulPolicy.text_inputs``), by port: each text
    port gets its encoder and starts with its default text (so it counts as received).
    ``texts``: where the staged text of each text port is kept beside its encoding (the
    runtime's ``texts``, which a policy's ``prepare_inputs`` reads on the host)."""

    def __init__(self, staging: Mapping[str, np.ndarray], ports: Mapping[str, PortConfig],
                 text: Optional[Mapping[str, Any]] = None, texts: Optional[MutableMapping[str, str]] = None):
        self.staging = staging
        self.ports: Dict[str, PortAdapter] = port_adapters(ports)
        self.lock = threading.Lock()
        self.texts: MutableMapping[str, str] = {} if texts is None else texts
        self._seen: set = set()
        for name, text_input in dict(text or {}).items():
            if name in self.ports:
                self.ports[name].text = text_input.encode
                self.write(name, np.asarray(text_input.encode(text_input.default)), text_input.default)

    def receive(self, port: str, msg: Any, now_ns: Optional[int], future_tolerance_ns: Optional[int]) -> np.ndarray:
        """A message for ``port``: checked, converted and staged; raises PortDrop (counted)."""
        adapter = self.ports[port]
        values = adapter.accept(msg, now_ns, future_tolerance_ns)
        self.write(port, values, adapter.last_text if adapter.config.type == TEXT_TYPE else None)
        return values

    def write(self, name: str, values: np.ndarray, text: Optional[str] = None) -> None:
        """Copy values into an input's staging buffer (their size already checked); a text
        input's ``text`` is kept with them."""
        staging = self.staging[name]
        with self.lock:
            np.copyto(staging, values.reshape(staging.shape), casting="unsafe")
            if text is not None:
                self.texts[name] = text
            self._seen.add(name)

    @property
    def ready(self) -> bool:
        """Every port has received a value (a step needs them all; an input no port feeds is
        the policy's own, filled on the host by ``StatefulPolicy.prepare_inputs``)."""
        return not self.missing()

    @property
    def seen(self) -> FrozenSet[str]:
        return frozenset(self._seen)

    def missing(self) -> List[str]:
        return [name for name in self.staging if name in self.ports and name not in self._seen]

    def reset_ordering(self) -> None:
        """A new episode: a sensor's clock may have restarted."""
        for port in self.ports.values():
            port.reset_ordering()

    def clock_jumped(self, delta_ns: int) -> None:
        """The receiver's clock jumped (``PortAdapter.clock_jumped``, every port)."""
        for port in self.ports.values():
            port.clock_jumped(delta_ns)
