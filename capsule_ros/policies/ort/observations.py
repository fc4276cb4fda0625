"""Observation terms: the model's observation vector assembled from ports, as Isaac Lab's
observation manager assembles it from its terms.

``policy.onnx.observations`` lists the terms in the order the policy was trained with,
one string each (ROS parameters cannot be lists of mappings)::

    '<function>:<port>[.<field>] [scale=S] [offset=O] [clip=LO,HI]'

- ``<port>[.<field>]``: a port, or one of its fields (``imu.angular_velocity``,
  ``joints.velocity``, ``cmd_vel.linear``). The field must be one of the port's
  ``fields``; its values are that field's slice of the port's buffer.
- functions (Isaac Lab's ``mdp`` names where it has one):

  - ``value`` and its aliases ``base_lin_vel``, ``base_ang_vel``, ``generated_commands``,
    ``joint_pos``, ``joint_vel``, ``joint_vel_rel``: the values as they are (Isaac Lab's
    default joint velocities are zero);
  - ``joint_pos_rel``: the values minus ``policy.onnx.default_joint_pos``;
  - ``projected_gravity``: gravity ``(0, 0, -1)`` in the body frame from an orientation
    quaternion ``(x, y, z, w)``: ``(2(wy - xz), -2(wx + yz), 2(x^2 + y^2) - 1)``;
  - ``last_action`` (no port): the model's raw action output of the previous step
    (zeros after a reset).

- modifiers, each one number or one per value (comma separated): ``offset`` is
  subtracted, then ``clip=LO,HI`` clamps, then ``scale`` multiplies; Isaac Lab clips
  before it scales. All arithmetic is float32, one operation at a time (no fused
  multiply-add), so a plain numpy loop doing the same operations gets the same bits.

With no terms the observation is every port's values, concatenated in ``ports.names``
order. Every term's port must be float32.

``ObservationPlan`` is the parsed, checked list; at serving time ``assembler`` turns it
into a few in-place operations over views of the arena (numpy on a CPU, torch on CUDA:
``capsule_ros.policies.ort.arrays``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.policies.ort.arrays import ArrayOps

VALUE, JOINT_POS_REL, GRAVITY, LAST_ACTION = "value", "joint_pos_rel", "projected_gravity", "last_action"
FUNCTIONS = {"value": VALUE, "base_lin_vel": VALUE, "base_ang_vel": VALUE, "generated_commands": VALUE,
             "joint_pos": VALUE, "joint_vel": VALUE, "joint_vel_rel": VALUE, "joint_pos_rel": JOINT_POS_REL,
             "projected_gravity": GRAVITY, "last_action": LAST_ACTION}
MODIFIERS = ("scale", "offset", "clip")

# Sizes of the message fields a port can read, by message type (JointState fields have one
# value per joint; a component such as ``linear.x`` is one value).
FIELD_SIZES: Dict[str, Dict[str, int]] = {
    "sensor_msgs/msg/Imu": {"orientation": 4, "angular_velocity": 3, "linear_acceleration": 3,
                            "orientation_covariance": 9, "angular_velocity_covariance": 9,
                            "linear_acceleration_covariance": 9},
    "geometry_msgs/msg/Twist": {"linear": 3, "angular": 3},
    "geometry_msgs/msg/TwistStamped": {"twist": 6, "twist.linear": 3, "twist.angular": 3},
    "geometry_msgs/msg/PoseStamped": {"pose": 7, "pose.position": 3, "pose.orientation": 4},
    "geometry_msgs/msg/PointStamped": {"point": 3},
}
COMPONENTS = ("x", "y", "z", "w")


@dataclass(frozen=True)
class Term:
    """One parsed, bound observation term (see the module docstring)."""

    text: str
    function: str                  # VALUE, JOINT_POS_REL, GRAVITY or LAST_ACTION
    port: str                      # '' for last_action
    start: int                     # the term's source values: port buffer elements [start, start + size)
    size: int                      # values the term contributes (3 for projected_gravity)
    offset: Tuple[float, ...]      # per value, the function's (default joint positions) plus the modifier's
    clip: Tuple[float, float]      # (-inf, inf) when not clipped
    scale: Tuple[float, ...]       # per value

    def describe(self) -> dict:
        """JSON-able (part of the capsule fingerprint)."""
        return {"function": self.function, "port": self.port, "start": self.start, "size": self.size,
                "offset": list(self.offset), "clip": [str(v) for v in self.clip], "scale": list(self.scale)}


def field_slices(port: Any) -> Dict[str, Tuple[int, int]]:
    """{field: (start, size)} of a port's buffer, in the order of its ``fields``; a field
    whose size cannot be told from the message type gets the rest of the buffer when it
    is the port's only field."""
    fields = list(port.fields)
    size = int(math.prod(port.shape))
    short = port.type.rsplit("/", 1)[-1]
    sizes: List[Optional[int]] = []
    for name in fields:
        if short == "JointState":
            sizes.append(len(port.names) if port.names else size // max(len(fields), 1))
            continue
        known = FIELD_SIZES.get(port.type, {})
        base, _, last = name.rpartition(".")
        sizes.append(known.get(name, 1 if last in COMPONENTS and base in known else None))
    if None in sizes:
        if len(fields) != 1:
            unknown = fields[sizes.index(None)]
            raise ConfigError(f"cannot tell where field {unknown!r} lies in a {port.type} port of fields {fields}; "
                              "give that field a port of its own")
        sizes = [size]
    out, start = {}, 0
    for name, n in zip(fields, sizes, strict=True):
        out[name] = (start, int(n or 0))
        start += int(n or 0)
    return out


def _numbers(text: str, where: str) -> Tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a number or a comma-separated list of numbers") from None
    if not all(math.isfinite(v) for v in values):
        raise ConfigError(f"{where}: {text!r} must be finite")
    return values


def _per_value(values: Tuple[float, ...], size: int, where: str) -> Tuple[float, ...]:
    if len(values) == 1:
        return values * size
    if len(values) != size:
        raise ConfigError(f"{where}: {len(values)} values for a term of {size} (give one, or one per value)")
    return values


def parse_term(text: str, ports: Mapping[str, Any], default_joint_pos: Sequence[float], where: str) -> Term:
    """One entry of policy.onnx.observations, bound to the ports (ConfigError naming it)."""
    where = f"{where} entry {text!r}"
    head, *modifiers = text.split()
    name, _, source = head.partition(":")
    if name not in FUNCTIONS:
        raise ConfigError(f"{where}: unknown function {name!r}; known: {sorted(FUNCTIONS)}")
    function = FUNCTIONS[name]
    if function == LAST_ACTION:
        if source:
            raise ConfigError(f"{where}: last_action takes no port (it is the model's previous action)")
        port, start, size = "", 0, -1                       # sized by the model's action output
    else:
        port, _, field = source.partition(".")
        if port not in ports:
            raise ConfigError(f"{where}: no port {port!r} (ports.names: {list(ports)})")
        config = ports[port]
        if config.dtype != "float32":
            raise ConfigError(f"{where}: ports.{port} is {config.dtype}; observation terms read float32 ports")
        slices = field_slices(config)
        if field:
            if field not in slices:
                raise ConfigError(f"{where}: {field!r} is not one of ports.{port}.fields {list(slices)}")
            start, size = slices[field]
        else:
            start, size = 0, int(math.prod(config.shape))
        if function == GRAVITY and size != 4:
            raise ConfigError(f"{where}: projected_gravity takes an orientation quaternion (x, y, z, w), 4 values, "
                              f"not {size}")
    values = {}
    for modifier in modifiers:
        key, _, value = modifier.partition("=")
        if key not in MODIFIERS or not value or key in values:
            raise ConfigError(f"{where}: {modifier!r} is not one of {[f'{m}=...' for m in MODIFIERS]} "
                              "(each at most once)")
        values[key] = _numbers(value, f"{where} {key}")
    out = 3 if function == GRAVITY else size
    offset = values.get("offset", (0.0,))
    clip = values.get("clip", (-math.inf, math.inf))
    if len(clip) != 2 or clip[0] > clip[1]:
        raise ConfigError(f"{where}: clip={','.join(map(str, clip))} must be LO,HI with LO <= HI")
    if function == JOINT_POS_REL:
        if len(default_joint_pos) != size:
            raise ConfigError(f"{where}: joint_pos_rel needs policy.onnx.default_joint_pos with {size} values (one per "
                              f"joint, in the port's joint order), it has {len(default_joint_pos)}")
        offset = tuple(d + o for d, o in zip(default_joint_pos, _per_value(offset, size, where), strict=True))
    return Term(text, function, port, start, out, offset if out < 0 else _per_value(offset, out, where),
                (float(clip[0]), float(clip[1])), values.get("scale", (1.0,)) if out < 0
                else _per_value(values.get("scale", (1.0,)), out, where))


@dataclass(frozen=True)
class ObservationPlan:
    """The terms in order (see the module docstring); ``size`` values in all."""

    terms: Tuple[Term, ...]

    @classmethod
    def parse(cls, entries: Sequence[str], ports: Mapping[str, Any], default_joint_pos: Sequence[float],
              action_size: int, where: str) -> ObservationPlan:
        if not entries:
            entries = [f"value:{name}" for name in ports]
        terms = []
        for text in entries:
            term = parse_term(text, ports, default_joint_pos, where)
            if term.function == LAST_ACTION:
                term = Term(term.text, LAST_ACTION, "", 0, action_size, _per_value(term.offset, action_size, where),
                            term.clip, _per_value(term.scale, action_size, where))
            terms.append(term)
        return cls(tuple(terms))

    @property
    def size(self) -> int:
        return sum(t.size for t in self.terms)

    def vectors(self) -> Tuple[List[float], List[float], List[float], List[float]]:
        """(offset, low, high, scale), one entry per observation value."""
        offset: List[float] = []
        low: List[float] = []
        high: List[float] = []
        scale: List[float] = []
        for t in self.terms:
            offset += t.offset
            low += [t.clip[0]] * t.size
            high += [t.clip[1]] * t.size
            scale += t.scale
        return offset, low, high, scale

    def describe(self) -> List[dict]:
        return [t.describe() for t in self.terms]


# --- serving: in-place operations over the arena ---------------------------------------------------

# products (w*y, x*z, w*x, y*z, x*x, y*y) of a quaternion (x, y, z, w): first factors, then second
GRAVITY_FACTORS = (3, 0, 3, 1, 0, 1, 1, 2, 0, 2, 0, 1)
# each product's factor in projected gravity: (2wy - 2xz, -2wx - 2yz, 2xx + 2yy), then z - 1;
# multiplying by 2 is exact, so this is 2(wy - xz), -2(wx + yz), 2(x^2 + y^2) - 1 to the bit
GRAVITY_COEFFICIENTS = (2.0, -2.0, -2.0, -2.0, 2.0, 2.0)


def assembler(plan: ObservationPlan, state: Mapping[str, torch.Tensor], out: torch.Tensor, last_action: torch.Tensor,
              constants: Mapping[str, torch.Tensor], ops: ArrayOps) -> Callable[[], None]:
    """A function writing the observation of ``plan`` into ``out`` (float32, ``plan.size``
    values) from the views in ``state`` and ``last_action`` (the raw action buffer), with
    ``ops`` (numpy over a CPU arena, torch over a CUDA one: ``arrays.ops_for``).
    ``constants``: 'offset', 'low', 'high', 'scale' vectors, the gravity tables and 'one',
    on the arena's device. Everything it needs is made here, once; a call allocates
    nothing: each projected gravity term is four operations into a scratch vector (its
    z's ``- 1`` is done by the offset when the term has none of its own), then one
    concatenation of every term's source into ``out``, then the offset, clip and scale over
    the whole vector (each skipped when it does nothing)."""
    flat_out = ops.array(out.reshape(-1))
    sources: List[Any] = []
    gravity: List[Tuple[Any, ...]] = []
    factors, coefficients, one = (ops.array(constants[k]) for k in ("gravity_factors", "gravity_coefficients", "one"))
    offset, low, high, scale = (constants[k] for k in ("offset", "low", "high", "scale"))
    offset = offset.clone()

    def scratch(size: int) -> Any:
        return ops.array(torch.empty(size, dtype=torch.float32, device=out.device))
    position = 0
    for term in plan.terms:
        values = ops.array((last_action if term.function == LAST_ACTION else state[term.port]).reshape(-1))
        if term.function == GRAVITY:
            pairs, products, result = scratch(12), scratch(6), scratch(3)
            z = result[2:]
            if offset[position + 2] == 0:          # z's "- 1" becomes its offset: (a - 1) - 0 is a - 1, bit for bit
                offset[position + 2] = 1.0
                z = None
            # every view made once: (quaternion, pairs, first factors, second factors, products,
            # their even and odd entries, result, its z when it is not folded into the offset)
            gravity.append((values[term.start:term.start + 4], pairs, pairs[:6], pairs[6:], products,
                            products[0::2], products[1::2], result, z))
            sources.append(result)
        else:
            sources.append(values[term.start:term.start + term.size])
        position += term.size
    subtract = bool(torch.any(offset != 0))
    raise_to_low = bool(torch.any(torch.isfinite(low)))
    lower_to_high = bool(torch.any(torch.isfinite(high)))
    multiply = bool(torch.any(scale != 1))
    offset, low, high, scale = (ops.array(c) for c in (offset, low, high, scale))
    take, mul, add, sub, cat, maximum, minimum = ops.take, ops.mul, ops.add, ops.sub, ops.cat, ops.maximum, ops.minimum

    def assemble() -> None:
        for quaternion, pairs, first, second, products, even, odd, result, z in gravity:
            take(quaternion, factors, out=pairs)
            mul(first, second, out=products)                      # wy, xz, wx, yz, xx, yy
            mul(products, coefficients, out=products)             # 2wy, -2xz, -2wx, -2yz, 2xx, 2yy
            add(even, odd, out=result)
            if z is not None:
                sub(z, one, out=z)                                # 2(x^2 + y^2) - 1
        cat(sources, out=flat_out)
        if subtract:
            sub(flat_out, offset, out=flat_out)
        if raise_to_low:
            maximum(flat_out, low, out=flat_out)                  # clip: max, then min (as numpy's clip)
        if lower_to_high:
            minimum(flat_out, high, out=flat_out)
        if multiply:
            mul(flat_out, scale, out=flat_out)
    return assemble


def constant_tensors(plan: ObservationPlan) -> Dict[str, torch.Tensor]:
    """The plan's constant vectors (CPU float32; the policy registers them as buffers)."""
    offset, low, high, scale = plan.vectors()
    return {"offset": torch.tensor(offset, dtype=torch.float32), "low": torch.tensor(low, dtype=torch.float32),
            "high": torch.tensor(high, dtype=torch.float32), "scale": torch.tensor(scale, dtype=torch.float32),
            "gravity_factors": torch.tensor(GRAVITY_FACTORS, dtype=torch.int64),
            "gravity_coefficients": torch.tensor(GRAVITY_COEFFICIENTS, dtype=torch.float32),
            "one": torch.ones(1, dtype=torch.float32)}
