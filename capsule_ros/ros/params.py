"""ROS parameters generated from the config dataclasses.

Every ``setting`` of ``capsule_ros.config`` becomes a declared parameter with its
description, range and read-only flag, so ``ros2 param describe`` tells the same story
as the code, and validation has one source (the dataclasses). Read-only parameters are
the ones that shape the graph: they can only be set at start-up (params file, launch
arguments, ``--ros-args -p``).
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Tuple, Type

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.node import Node
from rclpy.parameter import Parameter

from capsule_ros.config import ConfigSection, field_default, unflatten
from capsule_ros.errors import ConfigError
from capsule_ros.policies.registry import kind_settings
from capsule_ros.serving.config import SECTIONS, PortConfig
from capsule_ros.serving.outputs import OutputConfig

_INT64 = (-(2**63), 2**63 - 1)
_ARRAY_TYPES = {str: Parameter.Type.STRING_ARRAY, int: Parameter.Type.INTEGER_ARRAY,
                float: Parameter.Type.DOUBLE_ARRAY, bool: Parameter.Type.BOOL_ARRAY}


def descriptor(f: dataclasses.Field, python_type: Any) -> ParameterDescriptor:
    meta = f.metadata
    text = meta["doc"]
    if meta["choices"]:
        text += f" (one of {list(meta['choices'])})"
    desc = ParameterDescriptor(description=text, read_only=bool(meta["read_only"]))
    low, high = meta["low"], meta["high"]
    if low is not None or high is not None:
        scalar = typing.get_args(python_type)[0] if typing.get_origin(python_type) in (tuple, Tuple) else python_type
        if scalar is float:
            desc.floating_point_range = [FloatingPointRange(
                from_value=float(low if low is not None else -1e300),
                to_value=float(high if high is not None else 1e300), step=0.0)]
        elif scalar is int:
            desc.integer_range = [IntegerRange(from_value=int(low if low is not None else _INT64[0]),
                                               to_value=int(min(high, _INT64[1]) if high is not None else _INT64[1]),
                                               step=1)]
    if meta["choices"]:
        desc.additional_constraints = f"one of {list(meta['choices'])}"
    return desc


def _declare(node: Node, name: str, f: dataclasses.Field, python_type: Any) -> Any:
    default = field_default(f)
    if isinstance(default, tuple):
        item = typing.get_args(python_type)[0] if typing.get_args(python_type) else str
        value: Any = list(default) if default else _ARRAY_TYPES[item]
    else:
        value = default
    param = node.declare_parameter(name, value, descriptor(f, python_type))
    return default if param.type_ == Parameter.Type.NOT_SET else param.value


def _declare_section(node: Node, prefix: str, cls: Type[ConfigSection]) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f"{prefix}.{f.name}": _declare(node, f"{prefix}.{f.name}", f, hints[f.name]) for f in cls.settings()}


def _declare_named(node: Node, group: str, cls: Type[ConfigSection], what: str, required: bool) -> None:
    """``<group>.names`` and, for each name, the ``<group>.<name>.*`` section."""
    required_text = "at least one" if required else "none by default"
    param: Parameter = node.declare_parameter(
        f"{group}.names", Parameter.Type.STRING_ARRAY,
        ParameterDescriptor(description=f"names of {what} ({required_text}); each has {group}.<name>.* parameters",
                            read_only=True))
    for name in list(param.value or []):
        _declare_section(node, f"{group}.{name}", cls)


def declare_parameters(node: Node) -> None:
    """Declare every parameter (values are validated by ``configure``, see parameter_values).
    The section of the configured policy kind is declared when the kind is known; an
    unknown kind is reported by ``configure``, like any other bad value."""
    flat: Dict[str, Any] = {}
    for prefix, cls in SECTIONS:
        flat.update(_declare_section(node, prefix, cls))
    try:
        kind_sections = kind_settings(flat["policy.kind"])
    except ConfigError:
        kind_sections = {}
    for prefix, cls in kind_sections.items():
        _declare_section(node, prefix, cls)
    _declare_named(node, "ports", PortConfig, "the sensor ports", required=True)
    _declare_named(node, "outputs", OutputConfig, "the command outputs beside ~/action", required=False)


def parameter_values(node: Node) -> Dict[str, Any]:
    """The node's current parameters as the nested mapping ServingConfig.from_params takes
    (unset ones left out: their defaults apply; arrays come back as lists, which
    ConfigSection.from_mapping coerces)."""
    groups = {prefix for prefix, _ in SECTIONS} | {"ports", "outputs"}
    flat = {name: param.value for name, param in node.get_parameters_by_prefix("").items()
            if name.split(".", 1)[0] in groups and "." in name and param.value is not None}
    return unflatten(flat)
