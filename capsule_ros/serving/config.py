"""The serving configuration: ports, control loop, policy, runtime, capsules, recording.

One frozen dataclass per concern; ``ServingConfig.from_params`` builds them all from the
nested ``ros__parameters`` mapping of a ROS 2 parameter file (``config/policy.yaml``),
so the node, ``capsule-ros demo`` and ``capsule-ros replay --in-process`` read the very
same file. Ports are declared as ``ports.names: [a, b]`` plus ``ports.<name>.<field>``
because ROS parameters cannot be lists of mappings.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Type, TypeVar

from capsule_ros.capsules.config import CapsuleStoreConfig
from capsule_ros.chunking.schedule import ChunkingSettings, resolve_delay
from capsule_ros.config import (
    APPLIES,
    CONFIGURE,
    LIVE,
    NAME_PATTERN,
    START,
    ConfigSection,
    dims,
    field_default,
    load_params_file,
    normalize_message_type,
    section_values,
    setting,
)
from capsule_ros.errors import ConfigError
from capsule_ros.paths import share_file
from capsule_ros.policies.registry import BUILTIN, policy_kind
from capsule_ros.runtime.engine import RuntimeConfig
from capsule_ros.serving.outputs import OutputConfig

S = TypeVar("S", bound=ConfigSection)
WHEN = {LIVE: "at once", CONFIGURE: "at configure", START: "at start-up"}     # the reference's column

MESSAGE_TYPES = (
    "sensor_msgs/msg/JointState", "sensor_msgs/msg/Imu", "sensor_msgs/msg/Image",
    "geometry_msgs/msg/PoseStamped", "geometry_msgs/msg/PointStamped", "geometry_msgs/msg/Twist",
    "geometry_msgs/msg/TwistStamped", "std_msgs/msg/Float32MultiArray",
    "std_msgs/msg/String",        # text: a VLA's task instruction, tokenised by the policy (int64 [2, max_length])
)


@dataclass(frozen=True)
class PortConfig(ConfigSection):
    """One sensor topic filling one fixed-shape input buffer of the same name."""

    SECTION = "ports.<name>"

    topic: str = setting("", "topic name (relative names resolve in the node's namespace)", read_only=True)
    type: str = setting("sensor_msgs/msg/JointState", "message type", choices=MESSAGE_TYPES, read_only=True)
    fields: Tuple[str, ...] = setting(("position",), "message fields read, concatenated in order "
                                      "(dotted paths, e.g. point.x; for Image: data)", read_only=True)
    names: Tuple[str, ...] = setting((), "JointState only: joint names, in buffer order (empty = message order)",
                                     read_only=True)
    shape: Tuple[int, ...] = setting((1,), "fixed shape of the buffer", low=1, high=1 << 20, read_only=True)
    dtype: str = setting("float32", "buffer dtype", choices=("float32", "float64", "uint8", "int32", "int64"),
                         read_only=True)
    encodings: Tuple[str, ...] = setting(("rgb8", "bgr8", "mono8"), "accepted Image encodings (converted to the "
                                         "buffer's channel count; bgr8 is swapped to rgb)", read_only=True)
    staleness_ms: float = setting(0.0, "a step with this port older than this counts as stale (0 = no check)",
                                  low=0.0, high=1e9)
    qos: str = setting("sensor_data", "QoS profile", choices=("sensor_data", "reliable", "system_default"),
                       read_only=True)
    depth: int = setting(5, "QoS history depth", low=1, high=10000, read_only=True)

    @classmethod
    def normalize(cls, values: dict) -> dict:
        if isinstance(values.get("type"), str):
            values = {**values, "type": normalize_message_type(values["type"])}
        return values

    def check(self) -> None:
        if not self.topic:
            raise ConfigError(f"{self.SECTION}.topic: must be set")

    @property
    def size(self) -> int:
        return dims(self.shape)

    def binding(self) -> dict:
        """What fills the port's buffer (part of the capsule fingerprint): message type,
        fields, joint names, encodings, shape and dtype; not the topic, QoS or staleness,
        which do not change what the values mean."""
        return {"type": self.type, "fields": list(self.fields), "names": list(self.names),
                "encodings": list(self.encodings) if self.type.endswith("/Image") else [],
                "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class ControlConfig(ConfigSection):
    """When steps run, what happens on a missed deadline, and the episode log."""

    SECTION = "control"

    mode: str = setting("timer", "timer: steps at rate_hz; trigger: one step per message on trigger_port",
                        choices=("timer", "trigger"))
    rate_hz: float = setting(20.0, "step rate in timer mode", low=0.1, high=10000.0)
    trigger_port: str = setting("", "port whose messages trigger steps in trigger mode")
    deadline_ms: float = setting(0.0, "a step slower than this publishes the safe action instead "
                                 "(0 = one control period in timer mode, no deadline in trigger mode)",
                                 low=0.0, high=1e6)
    deadline_action: str = setting("hold", "safe action published instead of a late, failed or non-finite step's "
                                   "output: hold the last on-time policy action, or zeros", choices=("hold", "zero"))
    future_tolerance_ms: float = setting(1000.0, "a sensor message stamped further ahead of the node's clock is "
                                         "dropped (reason 'future'); 0 = no check", low=0.0, high=1e9)
    frame_id: str = setting("", "header.frame_id of published actions")
    status_rate_hz: float = setting(2.0, "rate of ~/status and /diagnostics (steady clock)", low=0.1, high=100.0)
    autostart: bool = setting(True, "start episode 1 (RUNNING) when the node activates after configure; else IDLE "
                              "until ~/reset", applies=CONFIGURE)
    input_log_steps: int = setting(20000, "steps of inputs kept per episode for the recompute fallback "
                                   "(0 = no fallback)", low=0, high=100_000_000, applies=CONFIGURE)
    input_log_max_mb: float = setting(2048.0, "most host memory the input log may take (input_log_steps x the "
                                      "bytes of one step's inputs); configure fails above it", low=0.0, high=1e7,
                                      applies=CONFIGURE)
    service_timeout_ms: float = setting(500.0, "how long a service waits for a step boundary (then BUSY)",
                                        low=1.0, high=60000.0)
    chunking: str = setting("sync", "chunking policies (ACT with a queue, Diffusion, gru_chunk, exported programs with "
                            "a cadence): sync plans a chunk when the current one is used up, in the step that needs "
                            "it; async plans it off the control loop from the observation inference_delay_steps "
                            "steps earlier (docs/chunking.md)", choices=("sync", "async"), read_only=True)
    inference_delay_steps: str = setting("auto", "async chunking: steps between a refill's request and the step its "
                                         "chunk takes over (fixed, recorded in capsules and bags); auto: the refill's "
                                         "p99 measured at activate, over rate_hz, with a 50% margin",
                                         pattern=r"auto|[1-9][0-9]{0,5}", read_only=True)
    execution_horizon: int = setting(0, "chunking: actions executed from each chunk (0 = the policy's own, e.g. "
                                     "LeRobot's n_action_steps; async: at most the chunk's length less the delay)",
                                     low=0, high=100000, read_only=True)
    rtc: str = setting("off", "real-time chunking (async chunking, a VLA policy): guided steers each new chunk towards "
                       "the rows of the executing chunk still to come, as LeRobot's RTC does, with the fixed delay "
                       "(docs/vla.md)", choices=("off", "guided"), read_only=True)
    rtc_max_guidance_weight: float = setting(10.0, "RTC: LeRobot's max_guidance_weight", low=1e-6, high=1e6,
                                             read_only=True)
    rtc_prefix_attention_schedule: str = setting("LINEAR", "RTC: LeRobot's prefix_attention_schedule, how the "
                                                 "guided rows are weighted", choices=("ZEROS", "ONES", "LINEAR", "EXP"),
                                                 read_only=True)
    rtc_execution_horizon: int = setting(0, "RTC: LeRobot's execution_horizon, leftover rows that guide the next "
                                         "chunk (padded with zero rows or truncated as LeRobot does); 0 = the "
                                         "leftover's own length", low=0, high=100000, read_only=True)

    def check(self) -> None:
        if self.mode == "trigger" and not self.trigger_port:
            raise ConfigError("control.trigger_port: must name a port when control.mode is 'trigger'")
        if self.rtc == "guided" and self.chunking != "async":
            raise ConfigError("control.rtc = 'guided' needs control.chunking 'async': it guides a chunk planned while "
                              "the previous one executes (LeRobot's select_action refuses RTC too)")

    def effective_deadline_s(self) -> Optional[float]:
        if self.deadline_ms > 0:
            return self.deadline_ms / 1e3
        return 1.0 / self.rate_hz if self.mode == "timer" else None

    def chunking_settings(self, worker: str = "auto") -> ChunkingSettings:
        """The chunk schedule's settings (``chunking``, ``inference_delay_steps``: None for
        ``auto``, ``execution_horizon``; the rate an ``auto`` delay is measured against)."""
        return ChunkingSettings(self.chunking, resolve_delay(self.inference_delay_steps), self.execution_horizon,
                                self.rate_hz, worker)


@dataclass(frozen=True)
class PolicyConfig(ConfigSection):
    """Which policy, which weights."""

    SECTION = "policy"

    kind: str = setting("hybrid", "policy implementation: a built-in kind or one another package registers "
                        "(its settings are policy.<kind>.*; docs/configuration.md lists the built-in ones)",
                        pattern=r"[a-z][a-z0-9_]{0,63}", read_only=True)
    weights: str = setting("builtin:arm_reach", "safetensors file, 'builtin:<name>' for a shipped policy, "
                           "or '' for random weights from init_seed", read_only=True)
    init_seed: int = setting(0, "seed of random weights when weights is ''", low=0, high=2**31 - 1, read_only=True)
    prefix: Tuple[int, ...] = setting((), "token ids prefilled at every reset to the initial state (a policy with "
                                      "a prefix input: configure checks them against it)", low=0,
                                      applies=CONFIGURE)
    task: str = setting("", "a vision-language-action policy's task instruction: what its task port holds until a "
                        "message arrives, or the task for good without one (tokenised by the checkpoint's tokenizer; "
                        "'' is LeRobot's empty task)", read_only=True)


@dataclass(frozen=True)
class RecordConfig(ConfigSection):
    """Rosbag2 recording of the node's inputs, actions and capsule events."""

    SECTION = "record"

    enabled: bool = setting(False, "record: from activate, or now on an active node (true starts a recording "
                            "unless one runs; false stops the running one)")
    directory: str = setting("~/.ros/capsule_ros/bags", "parent directory of new bags (the next recording)")
    storage: str = setting("mcap", "rosbag2 storage plugin (the next recording)", choices=("mcap", "sqlite3"))


@dataclass(frozen=True)
class LifecycleConfig(ConfigSection):
    """The node's managed lifecycle (ros/node.py)."""

    SECTION = "lifecycle"

    autostart: bool = setting(True, "configure and activate at start-up, so `ros2 run` / `ros2 launch` serve with one "
                              "command; false: wait unconfigured for a lifecycle manager (~/change_state)",
                              read_only=True)


# Every configuration section, by its parameter prefix: ``ports.<name>`` (one per port, see
# PortConfig) and these. ROS parameters, docs/configuration.md and ServingConfig all come
# from this table and the dataclasses' settings.
SECTIONS: Tuple[Tuple[str, Type[ConfigSection]], ...] = (
    ("control", ControlConfig), ("policy", PolicyConfig), ("runtime", RuntimeConfig),
    ("capsules", CapsuleStoreConfig), ("record", RecordConfig), ("lifecycle", LifecycleConfig),
)
# ... and ``policy.<kind>``, the section of the configured policy kind (policies/registry.py).


@dataclass(frozen=True)
class ServingConfig:
    """Everything the serving stack needs, validated."""

    ports: Dict[str, PortConfig]
    outputs: Dict[str, OutputConfig]        # command topics beside ~/action (serving/outputs.py)
    control: ControlConfig
    policy: PolicyConfig
    policy_settings: ConfigSection          # the section policy.<policy.kind>
    runtime: RuntimeConfig
    capsules: CapsuleStoreConfig
    record: RecordConfig
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    source: str = field(default="")

    @classmethod
    def from_params(cls, params: Mapping[str, Any], source: str = "") -> ServingConfig:
        known = {"ports", "outputs", "control", "policy", "runtime", "capsules", "record", "lifecycle"}
        extra = sorted(set(params) - known)
        if extra:
            raise ConfigError(f"unknown parameter group(s) {extra}; known: {sorted(known)}")
        ports = named_sections(params, "ports", PortConfig, required=True)
        outputs = named_sections(params, "outputs", OutputConfig, required=False)
        names = list(ports)
        control = ControlConfig.from_mapping(section_values(params, "control"))
        if control.mode == "trigger" and control.trigger_port not in ports:
            raise ConfigError(f"control.trigger_port = {control.trigger_port!r}: not one of ports.names {list(names)}")
        policy_values = section_values(params, "policy")
        kind_sections = {key: policy_values.pop(key) for key in list(policy_values)
                         if isinstance(policy_values[key], Mapping)}
        policy = PolicyConfig.from_mapping(policy_values)
        others = sorted(set(kind_sections) - {policy.kind})
        if others:
            raise ConfigError(f"policy.{others[0]}: settings of another policy kind (policy.kind is {policy.kind!r})")
        kind = policy_kind(policy.kind)
        settings = kind.settings.from_mapping(kind_sections.get(policy.kind, {}), section=f"policy.{policy.kind}")
        return cls(ports=ports, outputs=outputs, control=control, policy=policy, policy_settings=settings,
                   runtime=RuntimeConfig.from_mapping(section_values(params, "runtime")),
                   capsules=CapsuleStoreConfig.from_mapping(section_values(params, "capsules")),
                   record=RecordConfig.from_mapping(section_values(params, "record")),
                   lifecycle=LifecycleConfig.from_mapping(section_values(params, "lifecycle")), source=source)

    @classmethod
    def from_file(cls, path: Path, node_name: str = "capsule_policy") -> ServingConfig:
        return cls.from_params(load_params_file(path, node_name), source=str(path))


def named_sections(params: Mapping[str, Any], group: str, cls: Type[S], required: bool) -> Dict[str, S]:
    """``<group>.names: [a, b]`` plus ``<group>.<name>.<field>`` (ROS parameters cannot be
    lists of mappings) -> {name: section}."""
    values = section_values(params, group)
    names = values.pop("names", [])
    if not isinstance(names, (list, tuple)) or (required and not names):
        raise ConfigError(f"{group}.names: must list at least one name" if required
                          else f"{group}.names: must be a list of names")
    sections: Dict[str, S] = {}
    for name in names:
        if not isinstance(name, str) or re.fullmatch(NAME_PATTERN, name) is None:
            raise ConfigError(f"{group}.names: {name!r} must match {NAME_PATTERN}")
        if name in sections:
            raise ConfigError(f"{group}.names: {name!r} listed twice")
        sections[name] = cls.from_mapping(section_values(values, name), section=f"{group}.{name}")
    undeclared = sorted(set(values) - set(names))
    if undeclared:
        raise ConfigError(f"{group}: {undeclared} configured but not listed in {group}.names {list(names)}")
    return sections


def default_config_path() -> Path:
    """config/policy.yaml of the installed package (or of the source tree)."""
    return share_file("config", "policy.yaml")


def settings_reference() -> str:
    """docs/configuration.md: every setting of every section, from the dataclasses
    (``tools/config_reference.py`` writes it; a test keeps it current)."""
    lines = ["# Configuration reference", "",
             "Every parameter of `policy_node` (and of `capsule-ros demo` / `replay`, which read the same",
             "parameter file), generated from the configuration dataclasses by `tools/config_reference.py`.",
             "",
             "## When a change takes effect", "",
             "Every parameter is validated the same way at start-up, at lifecycle configure and when it is",
             "set on a running node (`ros2 param set`, in every lifecycle state): a bad value is refused with",
             "a reason that quotes it and the allowed range. The column *applies* says when a value that is",
             "accepted takes effect:", "",
             *(f"- **{WHEN[mode]}**: {APPLIES[mode]}." for mode in (LIVE, CONFIGURE, START)), "",
             "So a set that answers success has taken effect (or, while the node is unconfigured, is what",
             "the next configure reads). Configure-time settings shape what configure and activate build",
             "(the input log, the reset prefix, the RNG seed); read-only ones shape the graph and the",
             "capsule fingerprint. `use_sim_time` (rclpy's own) applies at once too: the node's clock",
             "changes, which the session counts as a clock jump ([architecture](architecture.md#clock-jumps)).",
             "Every parameter has a value (an empty list is a typed empty list), so",
             "`ros2 param dump /capsule_policy > params.yaml` writes a file that",
             "`ros2 launch capsule_ros policy.launch.py params_file:=params.yaml` loads back.", ""]
    # the built-in kinds only: the reference must not depend on which packages are installed
    kinds = tuple((f"policy.{name}", policy_kind(name).settings) for name in BUILTIN)
    for prefix, cls in (("ports.<name>", PortConfig), ("outputs.<name>", OutputConfig)) + SECTIONS + kinds:
        lines += [f"## `{prefix}`", "", (cls.__doc__ or "").strip().splitlines()[0], "",
                  "| parameter | default | allowed | applies | meaning |", "| --- | --- | --- | --- | --- |"]
        for f in cls.settings():
            meta = f.metadata
            allowed = []
            if meta["choices"]:
                allowed.append(" / ".join(f"`{c}`" for c in meta["choices"]))
            if meta["low"] is not None or meta["high"] is not None:
                allowed.append(f"[{meta['low'] if meta['low'] is not None else ''}, "
                               f"{meta['high'] if meta['high'] is not None else ''}]")
            if meta["pattern"]:
                allowed.append(f"`{meta['pattern']}`")
            default = field_default(f)
            shown = list(default) if isinstance(default, tuple) else default
            lines.append(f"| `{prefix}.{f.name}` | `{shown!r}` | {'; '.join(allowed) or '-'} | "
                         f"{WHEN[meta['applies']]} | {meta['doc']} |")
        lines.append("")
    lines += ["`ports.names` (read-only) lists the ports; each has the `ports.<name>.*` parameters above.",
              "`outputs.names` (read-only, default empty) lists the command outputs; each has the",
              "`outputs.<name>.*` parameters above.", ""]
    return "\n".join(lines)
