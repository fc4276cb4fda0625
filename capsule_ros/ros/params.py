"""ROS parameters generated from the config dataclasses.

Every ``setting`` of ``capsule_ros.config`` becomes a declared parameter with its
description, range and when a change takes effect (``applies``: live, at configure, or
read-only at start-up, in the description; read-only in the descriptor), so ``ros2 param
describe`` tells the same story as the code, and validation has one source (the
dataclasses). Read-only parameters are the ones that shape the graph: they can only be
set at start-up (params file, launch arguments, ``--ros-args -p``).

Every parameter is declared with a value, an empty list included (as a typed empty
array), so ``ros2 param dump`` / ``get`` show every one and a dumped file loads back.
"""
from __future__ import annotations

import array
import dataclasses
import typing
from typing import AbstractSet, Any, Dict, Mapping, Optional, Tuple, Type

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.node import Node
from rclpy.parameter import Parameter

from capsule_ros.config import APPLIES, CONFIGURE, LIVE, START, ConfigSection, field_default, unflatten
from capsule_ros.errors import ConfigError
from capsule_ros.policies.registry import kind_settings
from capsule_ros.serving.config import SECTIONS, PortConfig
from capsule_ros.serving.outputs import OutputConfig

_INT64 = (-(2**63), 2**63 - 1)
_ARRAY_TYPES = {str: Parameter.Type.STRING_ARRAY, int: Parameter.Type.INTEGER_ARRAY,
                float: Parameter.Type.DOUBLE_ARRAY, bool: Parameter.Type.BOOL_ARRAY}


# the parameter groups the node declares from the configuration (ServingConfig.from_params)
GROUPS = frozenset({prefix for prefix, _ in SECTIONS} | {"ports", "outputs"})
# the groups whose live settings the node applies at once (PolicyNode._apply_live); the others
# are read at configure only, so a setting there that says "live" (a policy kind's own) applies
# at configure
APPLIED_LIVE = frozenset({"control", "ports", "outputs", "record"})


def applies(name: str, f: dataclasses.Field) -> str:
    """When a change of the parameter ``name`` (of setting ``f``) takes effect on the node."""
    mode = f.metadata["applies"]
    return CONFIGURE if mode == LIVE and name.split(".", 1)[0] not in APPLIED_LIVE else mode


def descriptor(f: dataclasses.Field, python_type: Any, mode: str = "") -> ParameterDescriptor:
    meta = f.metadata
    text = meta["doc"]
    if meta["choices"]:
        text += f" (one of {list(meta['choices'])})"
    text += f"; {APPLIES[mode or meta['applies']]}"
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
    desc = descriptor(f, python_type, applies(name, f))
    if isinstance(default, tuple) and not default:
        item = typing.get_args(python_type)[0] if typing.get_args(python_type) else str
        return _declare_list(node, name, _ARRAY_TYPES[item], desc)
    param = node.declare_parameter(name, list(default) if isinstance(default, tuple) else default, desc)
    return default if param.type_ == Parameter.Type.NOT_SET else param.value


def _declare_list(node: Node, name: str, array_type: Parameter.Type, desc: ParameterDescriptor) -> Any:
    """A list parameter whose default is empty, declared with a value: rclpy would type a
    bare ``[]`` as a byte array, and an empty list in a parameter file arrives unset, which
    ``ros2 param dump`` cannot write (it wrote ``ros__parameters: {}`` for the whole node).
    So: declared with its type, set to the typed empty list when nothing gave it a value,
    then made read-only when it is."""
    writable = ParameterDescriptor(description=desc.description, additional_constraints=desc.additional_constraints,
                                   integer_range=desc.integer_range, floating_point_range=desc.floating_point_range)
    param: Parameter = node.declare_parameter(name, array_type, writable)
    if param.type_ == Parameter.Type.NOT_SET:
        node.set_parameters([Parameter(name, array_type, [])])
    if desc.read_only:
        desc.type = array_type.value
        node.set_descriptor(name, desc)
    return node.get_parameter(name).value


def _declare_section(node: Node, prefix: str, cls: Type[ConfigSection]) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f"{prefix}.{f.name}": _declare(node, f"{prefix}.{f.name}", f, hints[f.name]) for f in cls.settings()}


def _applies(prefix: str, cls: Type[ConfigSection]) -> Dict[str, str]:
    return {f"{prefix}.{f.name}": applies(f"{prefix}.{f.name}", f) for f in cls.settings()}


def _declare_named(node: Node, group: str, cls: Type[ConfigSection], what: str, required: bool) -> Dict[str, str]:
    """``<group>.names`` and, for each name, the ``<group>.<name>.*`` section; when each applies."""
    required_text = "at least one" if required else "none by default"
    names = _declare_list(node, f"{group}.names", Parameter.Type.STRING_ARRAY, ParameterDescriptor(
        description=f"names of {what} ({required_text}); each has {group}.<name>.* parameters; {APPLIES[START]}",
        read_only=True))
    applies = {f"{group}.names": START}
    for name in list(names or []):
        _declare_section(node, f"{group}.{name}", cls)
        applies.update(_applies(f"{group}.{name}", cls))
    return applies


def declare_parameters(node: Node) -> Dict[str, str]:
    """Declare every parameter (values are validated by ``configure``, see parameter_values);
    when each takes effect, by name (``capsule_ros.config.APPLIES``). The section of the
    configured policy kind is declared when the kind is known; an unknown kind is reported
    by ``configure``, like any other bad value."""
    flat: Dict[str, Any] = {}
    applies: Dict[str, str] = {}
    for prefix, cls in SECTIONS:
        flat.update(_declare_section(node, prefix, cls))
        applies.update(_applies(prefix, cls))
    try:
        kind_sections = kind_settings(flat["policy.kind"])
    except ConfigError:
        kind_sections = {}
    for prefix, cls in kind_sections.items():
        _declare_section(node, prefix, cls)
        applies.update(_applies(prefix, cls))
    applies.update(_declare_named(node, "ports", PortConfig, "the sensor ports", required=True))
    applies.update(_declare_named(node, "outputs", OutputConfig, "the command outputs beside ~/action",
                                  required=False))
    return applies


def declare_fleet_parameters(node: Node) -> Dict[str, str]:
    """``fleet_node``'s own group, ``fleet.*`` (``capsule_ros.fleet.config.FleetConfig``);
    when each takes effect, by name."""
    from capsule_ros.fleet.config import FleetConfig
    _declare_section(node, FleetConfig.SECTION, FleetConfig)
    return _applies(FleetConfig.SECTION, FleetConfig)


def parameter_values(node: Node, changes: Optional[Mapping[str, Any]] = None,
                     groups: AbstractSet[str] = GROUPS) -> Dict[str, Any]:
    """The node's current parameters of ``groups`` (default: those ServingConfig.from_params
    takes), with ``changes`` (name -> value) over them, as a nested mapping (unset ones left
    out: their defaults apply)."""
    flat = {name: plain(param.value) for name, param in node.get_parameters_by_prefix("").items()
            if name.split(".", 1)[0] in groups and "." in name}
    flat.update({name: plain(value) for name, value in (changes or {}).items() if name.split(".", 1)[0] in groups})
    return unflatten({name: value for name, value in flat.items() if value is not None})


def plain(value: Any) -> Any:
    """A parameter's value with arrays as lists (rclpy hands out ``array.array`` for numeric
    arrays set through the parameter services)."""
    return list(value) if isinstance(value, (array.array, tuple)) else value
