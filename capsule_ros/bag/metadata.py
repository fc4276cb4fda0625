"""What a recording stores besides its messages, so a replay can rebuild the same policy.

rosbag2 has a ``custom_data`` string map in ``metadata.yaml`` (rosbag2 format 6+, and
MCAP's ``rosbag2`` metadata record); ``rosbags`` writes it. Keys (all ``capsule_ros.*``):

- ``params``: the node's effective ``ServingConfig`` as a ROS 2 parameter file (YAML),
  loadable by ``ServingConfig.from_params`` and by ``policy_node --params-file``;
- ``fingerprint``: the runtime's graph fingerprint (a replay on another graph cannot be
  expected to be bit-identical, and capsules would be refused);
- ``node``, ``trigger_port``, ``mode``, ``ports`` (port -> recorded topic and type),
  ``action_topic``, ``events_topic``: how to map topics back to ports;
- ``digest`` and ``messages``: SHA-256 over every recorded message (topic, log time,
  bytes) in write order, and their count, so a garbled bag is refused instead of being
  misreported as a divergence;
- ``versions``: capsule_ros, torch, Python and the CPU capability, for the report;
- ``numerics``: the CPU numerics level the policy ran at (``capsule_ros.runtime.numerics``:
  ``avx2``, or ``native-avx512`` without a pin), which a replay sets again;
- ``initial_inputs``: how many leading sensor messages are the inputs' state when the
  recording started (written by the node at start-up of the recording: a replay stages
  them but takes no step on them);
- ``chunking``: the chunk schedule settings (``control.chunking``, the fixed
  ``inference_delay_steps``, ``execution_horizon``), also in ``params``, where a replay
  takes them from: an ``auto`` delay is recorded as the number it was fixed to.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import yaml

from capsule_ros.bag.errors import BadBag
from capsule_ros.config import ConfigSection, field_default
from capsule_ros.errors import CapsuleRosError
from capsule_ros.runtime.numerics import recorded_level
from capsule_ros.serving.config import ServingConfig

PREFIX = "capsule_ros."
FORMAT = "1"


def _section_params(section: ConfigSection) -> Dict[str, Any]:
    """A section's settings as parameter values; empty lists whose default is empty are
    left out (ROS parameter files cannot type an empty list)."""
    out = {}
    defaults = {f.name: field_default(f) for f in section.settings()}
    for name, value in section.to_mapping().items():
        if value == [] and defaults[name] == ():
            continue
        out[name] = value
    return out


def config_params(config: ServingConfig) -> Dict[str, Any]:
    """The nested ``ros__parameters`` mapping of a ServingConfig (recording disabled, so a
    node started from it does not record its own replay)."""
    ports: Dict[str, Any] = {"names": list(config.ports)}
    for name, port in config.ports.items():
        ports[name] = _section_params(port)
    policy = _section_params(config.policy)
    policy[config.policy.kind] = _section_params(config.policy_settings)
    record = _section_params(config.record)
    record["enabled"] = False
    return {"ports": ports, "control": _section_params(config.control), "policy": policy,
            "runtime": _section_params(config.runtime), "capsules": _section_params(config.capsules),
            "record": record}


def params_yaml(params: Mapping[str, Any]) -> str:
    """A ROS 2 parameter file for any node name."""
    return yaml.safe_dump({"/**": {"ros__parameters": dict(params)}}, sort_keys=False)


class MessageDigest:
    """SHA-256 over (topic, log time, bytes) of each message, in order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.count = 0

    def update(self, topic: str, log_time: int, data: bytes) -> None:
        name = topic.encode()
        self._hash.update(struct.pack("<I", len(name)) + name + struct.pack("<qQ", log_time, len(data)))
        self._hash.update(data)
        self.count += 1

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def runtime_versions() -> Dict[str, str]:
    """Versions that decide whether floating point results can be bit-identical."""
    import platform
    out = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        from capsule_ros import __version__
        out["capsule_ros"] = __version__
    except ImportError:
        pass
    try:
        import torch
        out["torch"] = torch.__version__
        out["cpu_capability"] = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - informational only
        pass
    return out


@dataclass(frozen=True)
class PortTopic:
    """Where a port's messages are in the bag."""

    topic: str
    type: str


@dataclass(frozen=True)
class RecordingMeta:
    """Everything a replay needs besides the messages (see the module docstring)."""

    params: Dict[str, Any]
    node: str
    ports: Dict[str, PortTopic]
    action_topic: str
    events_topic: str
    fingerprint: str = ""
    digest: str = ""
    messages: int = -1
    versions: Dict[str, str] = field(default_factory=dict)
    initial_inputs: int = 0
    numerics: str = ""                  # '' = not recorded (a bag from before the level, or a foreign bag)
    # a fleet robot's bag: the robot, its slot, the fleet's slots, batching and the robot's
    # seed (capsule_ros.fleet.replay replays it at the fleet's shape); empty for a policy_node's
    fleet: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_node(cls, config: ServingConfig, action_topic: str, events_topic: str,
                 fingerprint: str = "") -> RecordingMeta:
        """What the node records: its config, topics, graph fingerprint, and this process's
        versions and numerics level."""
        return dataclasses.replace(cls.from_config(config, action_topic, events_topic), fingerprint=fingerprint,
                                   versions=runtime_versions(), numerics=recorded_level(config.runtime.numerics))

    def config(self, source: str = "bag") -> ServingConfig:
        """The recorded ServingConfig (BadBag when it does not validate here)."""
        try:
            return ServingConfig.from_params(self.params, source=source)
        except CapsuleRosError as exc:
            raise BadBag(f"the recorded serving config does not load: {exc}") from None

    def to_custom_data(self) -> Dict[str, str]:
        return {PREFIX + k: v for k, v in {
            "format": FORMAT, "params": params_yaml(self.params), "node": self.node,
            "ports": json.dumps({n: dataclasses.asdict(p) for n, p in self.ports.items()}, sort_keys=True),
            "action_topic": self.action_topic, "events_topic": self.events_topic, "fingerprint": self.fingerprint,
            "trigger_port": str(self.params["control"].get("trigger_port", "")),
            "mode": str(self.params["control"].get("mode", "")),
            "digest": self.digest, "messages": str(self.messages),
            "versions": json.dumps(self.versions, sort_keys=True), "initial_inputs": str(self.initial_inputs),
            "numerics": self.numerics,
            "chunking": json.dumps({k: self.params["control"].get(k) for k in
                                    ("chunking", "inference_delay_steps", "execution_horizon")}, sort_keys=True),
            **({"fleet": json.dumps(self.fleet, sort_keys=True)} if self.fleet else {}),
        }.items()}

    @classmethod
    def from_custom_data(cls, custom: Optional[Mapping[str, str]]) -> RecordingMeta:
        """Parse the keys written by ``to_custom_data`` (BadBag naming what is missing)."""
        custom = dict(custom or {})
        if PREFIX + "params" not in custom:
            raise BadBag("the bag has no recorded serving config (metadata.yaml custom_data "
                         f"'{PREFIX}params'): record with capsule_ros, or pass --params-file")
        try:
            document = yaml.safe_load(custom[PREFIX + "params"])
            params = document["/**"]["ros__parameters"]
            ports = {n: PortTopic(**p) for n, p in json.loads(custom[PREFIX + "ports"]).items()}
            return cls(params=params, node=custom[PREFIX + "node"], ports=ports,
                       action_topic=custom[PREFIX + "action_topic"], events_topic=custom[PREFIX + "events_topic"],
                       fingerprint=custom.get(PREFIX + "fingerprint", ""), digest=custom.get(PREFIX + "digest", ""),
                       messages=int(custom.get(PREFIX + "messages", "-1")),
                       versions=json.loads(custom.get(PREFIX + "versions", "{}")),
                       initial_inputs=int(custom.get(PREFIX + "initial_inputs", "0")),
                       numerics=custom.get(PREFIX + "numerics", ""),
                       fleet=json.loads(custom.get(PREFIX + "fleet", "{}")))
        except (yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
            raise BadBag(f"garbled capsule_ros metadata in metadata.yaml custom_data: {exc!r}") from None

    @classmethod
    def from_config(cls, config: ServingConfig, action_topic: str, events_topic: str) -> RecordingMeta:
        """For a bag without our metadata (e.g. ``ros2 bag record``): ports resolved from
        the given config in the namespace of the recorded action topic. Nothing of this
        process is asked (torch's CPU level must stay unset until the replay pins it)."""
        node = node_of(action_topic)
        ports = {name: PortTopic(resolve_topic(port.topic, node), port.type) for name, port in config.ports.items()}
        return cls(config_params(config), node, ports, action_topic, events_topic)

    def with_config(self, config: ServingConfig) -> RecordingMeta:
        """The same recording, replayed with another config (``--params-file``)."""
        return dataclasses.replace(self, params=config_params(config))

    @property
    def trigger_port(self) -> str:
        return str(self.params.get("control", {}).get("trigger_port", ""))


def node_of(action_topic: str) -> str:
    """``/ns/capsule_policy/action`` -> ``/ns/capsule_policy`` (the node's full name)."""
    return action_topic.rsplit("/", 1)[0] or "/"


def resolve_topic(topic: str, node: str) -> str:
    """A configured topic name as the node resolves it: absolute stays, ``~/x`` is
    ``<node>/x``, a relative name goes into the node's namespace."""
    if topic.startswith("/"):
        return topic
    if topic.startswith("~"):
        return node.rstrip("/") + "/" + topic[1:].lstrip("/")
    namespace = node.rsplit("/", 1)[0]
    return f"{namespace}/{topic}"
