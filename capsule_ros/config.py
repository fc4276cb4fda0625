"""Configuration: one frozen dataclass per concern, validated with errors that quote the
bad value and the allowed range.

Each field is declared with :func:`setting`, which records its documentation, range,
choices and when a change takes effect on a running node (``applies``):

- ``live``: at once, also while the node is active (the control loop reads it at every
  step, or the node applies it when it is set);
- ``configure``: at the node's next lifecycle configure (it shapes what configure and
  activate build: the input log, the RNG seed, the reset prefix...); refused while the
  node is configured, with that reason;
- ``start``: read-only, set at start-up only (shapes and dtypes: they define the graph and
  the capsule fingerprint). ``read_only=True`` says the same.

The same metadata validates YAML / dict input here and becomes the ROS parameter
descriptors in ``capsule_ros.ros.params``, so the two can never disagree.

The YAML files are ROS 2 parameter files (``<node>: ros__parameters: {...}``) so that the
same ``config/policy.yaml`` serves ``--params-file`` and the ROS-free core.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Tuple, Type, TypeVar

import yaml

from capsule_ros.errors import ConfigError

T = TypeVar("T", bound="ConfigSection")

# The capsule id alphabet (the node's external contract), shared by capsule ids and port / buffer names.
ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
NAME_PATTERN = r"[A-Za-z][A-Za-z0-9_]{0,63}"


LIVE, CONFIGURE, START = "live", "configure", "start"
# what each ``applies`` means for a node, as its parameter descriptors and the reference say it
APPLIES: Mapping[str, str] = {
    LIVE: "takes effect at once, also while the node is active",
    CONFIGURE: "takes effect at the next lifecycle configure: refused while the node is configured (set it "
               "after cleanup)",
    START: "read-only: set at start-up (parameter file, launch arguments, --ros-args -p)",
}


def setting(default: Any, doc: str, *, low: Optional[float] = None, high: Optional[float] = None,
            choices: Optional[Sequence[Any]] = None, pattern: Optional[str] = None,
            applies: str = LIVE, read_only: bool = False) -> Any:
    """A validated configuration field (see module docstring; ``read_only`` = ``applies="start"``)."""
    applies = START if read_only else applies
    if applies not in APPLIES:
        raise ValueError(f"applies={applies!r}: one of {sorted(APPLIES)}")
    meta = {"doc": doc, "low": low, "high": high, "choices": tuple(choices) if choices else None,
            "pattern": pattern, "applies": applies, "read_only": applies == START}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


def normalize_message_type(name: str) -> str:
    """'sensor_msgs/JointState' -> 'sensor_msgs/msg/JointState'."""
    parts = name.strip().split("/")
    if len(parts) == 2:
        parts = [parts[0], "msg", parts[1]]
    return "/".join(parts)


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default value (from ``default`` or ``default_factory``)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    factory: Any = f.default_factory
    return factory()


def _check_value(section: str, name: str, value: Any, meta: Mapping[str, Any]) -> None:
    where = f"{section}.{name}"
    numbers = value if isinstance(value, tuple) else (value,)
    for v in numbers:
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{where} = {value!r}: must be a finite number")
        if meta["low"] is not None and isinstance(v, (int, float)) and v < meta["low"]:
            raise ConfigError(f"{where} = {value!r}: must be >= {meta['low']}"
                              + (f" and <= {meta['high']}" if meta["high"] is not None else ""))
        if meta["high"] is not None and isinstance(v, (int, float)) and v > meta["high"]:
            raise ConfigError(f"{where} = {value!r}: must be <= {meta['high']}"
                              + (f" and >= {meta['low']}" if meta["low"] is not None else ""))
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{where} = {value!r}: must be one of {list(meta['choices'])}")
    if meta["pattern"] is not None and not re.fullmatch(meta["pattern"], str(value)):
        raise ConfigError(f"{where} = {value!r}: must match {meta['pattern']}")


def _coerce(section: str, name: str, value: Any, default: Any) -> Any:
    """Coerce YAML / ROS parameter values to the field's type, or raise ConfigError."""
    where = f"{section}.{name}"
    kind = type(default)
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            raise TypeError
        if isinstance(default, int):
            if isinstance(value, bool) or not float(value).is_integer():
                raise TypeError
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if isinstance(default, str):
            if not isinstance(value, str):
                raise TypeError
            return value
        if isinstance(default, tuple):
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError
            item_kind = type(default[0]) if default else type(value[0]) if len(value) else int
            return tuple(_coerce(section, f"{name}[{i}]", v, item_kind()) for i, v in enumerate(value))
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{where} = {value!r}: expected {kind.__name__}"
                      + (f" of {type(default[0]).__name__}" if isinstance(default, tuple) and default else ""))


@dataclass(frozen=True)
class ConfigSection:
    """Base of every config dataclass: validation on construction, loading from mappings."""

    SECTION = "config"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.metadata:
                _check_value(self.SECTION, f.name, getattr(self, f.name), f.metadata)
        self.check()

    def check(self) -> None:
        """Cross-field validation; override where fields constrain each other."""

    @classmethod
    def settings(cls) -> Iterator[dataclasses.Field]:
        return (f for f in dataclasses.fields(cls) if f.metadata)

    @classmethod
    def from_mapping(cls: Type[T], values: Optional[Mapping[str, Any]], section: Optional[str] = None) -> T:
        """Build from a (possibly partial) mapping; unknown keys are refused by name."""
        section = section or cls.SECTION
        values = dict(values or {})
        known = {f.name: f for f in cls.settings()}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{section}: unknown setting(s) {unknown}; known: {sorted(known)}")
        kwargs = {}
        for name, value in values.items():
            f = known[name]
            kwargs[name] = _coerce(section, name, value, field_default(f))
        try:
            return cls(**cls.normalize(kwargs))
        except ConfigError as exc:   # name the section as the caller knows it (e.g. ports.joints)
            raise ConfigError(str(exc).replace(f"{cls.SECTION}.", f"{section}.", 1)) from None

    @classmethod
    def normalize(cls, values: dict) -> dict:
        """Rewrite accepted spellings to the canonical one before validation (override)."""
        return values

    def with_live_settings(self: T, new: T) -> T:
        """This section with ``new``'s values of the settings that apply live (the others
        keep the values they started with: e.g. an ``auto`` delay fixed at activate)."""
        return dataclasses.replace(self, **{f.name: getattr(new, f.name) for f in self.settings()
                                            if f.metadata["applies"] == LIVE})

    def to_mapping(self) -> dict:
        out = {}
        for f in self.settings():
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


# --- loading -----------------------------------------------------------------------------

def load_params_file(path: Path, node_name: str = "capsule_policy") -> dict:
    """The ``ros__parameters`` mapping of ``node_name`` in a ROS 2 parameter file.

    Accepts ``/**`` wildcards and namespaced node keys like ROS does (the last match wins).
    """
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read parameter file {path}: {exc}") from exc
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping of node names to ros__parameters")
    params: dict = {}
    for key, body in document.items():
        key_name = str(key).rsplit("/", 1)[-1]
        if key in ("/**", "**") or key_name == node_name:
            if not isinstance(body, dict) or not isinstance(body.get("ros__parameters"), dict):
                raise ConfigError(f"{path}: {key!r} has no ros__parameters mapping")
            _deep_update(params, body["ros__parameters"])
    return params


def _deep_update(target: dict, source: Mapping) -> None:
    for key, value in source.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = dict(value) if isinstance(value, Mapping) else value


def flatten(nested: Mapping, prefix: str = "") -> dict:
    """{'control': {'rate_hz': 50}} -> {'control.rate_hz': 50} (ROS parameter names)."""
    flat = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict:
    """Inverse of :func:`flatten`."""
    nested: dict = {}
    for name, value in flat.items():
        node = nested
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"parameter {name!r} nests under a value")
        node[leaf] = value
    return nested


def section_values(params: Mapping[str, Any], section: str) -> dict:
    """The sub-mapping for one section of a nested parameter mapping ({} if absent)."""
    value = params.get(section, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{section}: expected a mapping, got {value!r}")
    return dict(value)


def dims(shape: Tuple[int, ...]) -> int:
    """Number of elements of a shape."""
    return int(math.prod(shape)) if shape else 1
