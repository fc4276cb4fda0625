"""The binding vocabulary's words: roles, tensors, ports, feeds, message types, the rules a
kind writes as data, and the table a binding yields (``capsule_ros.policies.binding``)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from capsule_ros.policies.binding.wording import Wording
from capsule_ros.runtime.arena import BufferSpec, dtype_name

IMAGE_MESSAGE = "sensor_msgs/msg/Image"
TEXT_MESSAGE = "std_msgs/msg/String"


class Role(str, enum.Enum):
    """What a tensor of a policy is for."""

    OBSERVATION = "observation"          # an input the ports fill: one port as it is, or assembled from ports
    CAMERA = "camera"                    # an RGB image [3, H, W], fed by a uint8 [H, W, 3] image port
    ROBOT_STATE = "robot_state"          # proprioception [n] (joint state; LeRobot's observation.state)
    ENV_STATE = "env_state"              # the environment's state [n] (LeRobot's observation.environment_state)
    TASK = "task"                        # the task instruction as token ids, fed by a text port
    ACTION = "action"                    # the action [A], an output
    ACTION_CHUNK = "action_chunk"        # the predicted actions [H, A], an output
    STATE = "state"                      # carried between steps: an input, returned by its pair's output
    EPISODE_START = "episode_start"      # 1 on an episode's first step, 0 after
    RNG = "rng"                          # the runtime's counter-based generator (seed, counter), int64[2]
    EXTRA_OUTPUT = "extra_output"        # an output bound to a buffer nobody reads (a value estimate)


class Side(str, enum.Enum):
    """Whether the policy takes a tensor or returns it."""

    INPUT = "input"
    OUTPUT = "output"


class Count(enum.Enum):
    """How many tensors a rule binds."""

    ONE = "exactly one"
    OPTIONAL = "at most one"
    SOME = "at least one"
    ANY = "any number"


class Report(enum.Enum):
    """What a kind's error says: the first problem, or every problem joined with '; '."""

    FIRST = "first"
    ALL = "all"


@dataclass(frozen=True)
class Tensor:
    """A tensor of a policy as the checker sees it; ``source`` is the kind's own object
    (a TensorInfo, a BufferSpec, a checkpoint Feature), handed back in its binding."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    label: str = ""          # what the policy calls its sort: a feature type (VISUAL), a declared group ('state')
    kind: str = ""           # the buffer kind it declares (a program's state), checked against its rule
    source: Any = None

    @classmethod
    def of(cls, source: Any, label: str = "", kind: str = "") -> Tensor:
        """A tensor from anything with ``name``, ``shape`` and ``dtype``."""
        return cls(source.name, tuple(source.shape), source.dtype, label, kind, source)

    def describe(self) -> str:
        return f"{self.name} {dtype_name(self.dtype)}{list(self.shape)}"


@dataclass(frozen=True)
class Port:
    """A port as the checker sees it: its buffer and its message type ('' when unknown: not checked)."""

    spec: BufferSpec
    type: str = ""


def ports_of(inputs: Iterable[BufferSpec], configs: Optional[Mapping[str, Any]] = None) -> Dict[str, Port]:
    """{port name: Port} from the node's INPUT buffers and (optionally) its port configs' types."""
    configs = configs or {}
    return {s.name: Port(s, str(getattr(configs.get(s.name), "type", ""))) for s in inputs}


@dataclass(frozen=True)
class Feed:
    """How a port's buffer feeds a tensor: which tensor shapes it can feed, and the port
    buffer (shape, dtype) it needs for one."""

    what: str = ""                        # how errors name the port buffer it needs
    rank: Optional[int] = None            # the tensor's rank (None: any)
    channels: Optional[int] = None        # the tensor's first dimension (an image's 3)
    order: Tuple[int, ...] = ()           # the port's dimensions as the tensor's ((1, 2, 0): [3, H, W] -> [H, W, 3])
    dtype: Optional[torch.dtype] = None   # the port's dtype (None: the tensor's)
    resizable: bool = False               # with resizing on, a port of another size (same rank and channels)
    expected: str = ""                    # what a tensor of another shape is told
    port_noun: str = ""                   # how errors name such a port ('camera')

    def fits(self, tensor: Tensor) -> bool:
        """Whether this feed can feed a tensor of that shape at all."""
        shape = tensor.shape
        return (self.rank is None or len(shape) == self.rank) and (self.channels is None or shape[0] == self.channels)

    def port_for(self, tensor: Tensor, port: Optional[BufferSpec] = None,
                 resize: bool = False) -> Tuple[Tuple[int, ...], torch.dtype]:
        """The port (shape, dtype) that feeds ``tensor``; with ``resize``, a resizable feed
        takes ``port``'s own size when it keeps the layout (rank and last dimension)."""
        shape = tuple(tensor.shape[i] for i in self.order) if self.order else tuple(tensor.shape)
        if resize and self.resizable and port is not None and len(port.shape) == len(shape) \
                and port.shape[-1] == shape[-1]:
            shape = tuple(port.shape)
        return shape, self.dtype or tensor.dtype


AS_IS = Feed()                            # the port's buffer is the tensor (name, shape, dtype)
RGB_IMAGE = Feed("an RGB camera image [H, W, 3]", rank=3, channels=3, order=(1, 2, 0), dtype=torch.uint8,
                 resizable=True, expected="only RGB [3, H, W] images are supported", port_noun="camera")
VECTOR = Feed("a vector", rank=1, dtype=torch.float32, expected="expected a vector [n]", port_noun="vector")
TOKENS = Feed("token ids [L]", rank=1, expected="expected token ids [L]", port_noun="text")


@dataclass(frozen=True)
class MessageTypes:
    """The message types a port feeding a role may have (empty ``only``: any but ``never``)."""

    only: Tuple[str, ...] = ()
    never: Tuple[str, ...] = ()
    need: str = ""                        # how errors say it: 'a sensor_msgs/msg/Image port'

    def admits(self, message_type: str) -> bool:
        if not message_type:
            return True                   # unknown (a port map given as buffers only): not checked
        return (not self.only or message_type in self.only) and message_type not in self.never


ANY_MESSAGES = MessageTypes()
IMAGE_MESSAGES = MessageTypes(only=(IMAGE_MESSAGE,), need=f"a {IMAGE_MESSAGE} port")
VECTOR_MESSAGES = MessageTypes(never=(IMAGE_MESSAGE,), need=f"a vector port (not {IMAGE_MESSAGE})")
TEXT_MESSAGES = MessageTypes(only=(TEXT_MESSAGE,), need=f"a {TEXT_MESSAGE} port")


@dataclass(frozen=True)
class RoleRule:
    """One row of a kind's table: which tensors take ``role`` (``binding``'s docstring) and
    what they must be."""

    role: Role
    side: Side = Side.INPUT
    count: Count = Count.ANY
    labels: Tuple[str, ...] = ()          # claim the tensors of these labels
    names: Tuple[str, ...] = ()           # claim only these names (with labels: the names those labels may take)
    setting: str = ""                     # the setting naming the tensor ('policy.onnx.observation')
    usual: Tuple[str, ...] = ()           # names taken when the setting is empty
    kinds: Tuple[str, ...] = ()           # the buffer kinds a tensor may declare (empty: not checked)
    dtypes: Tuple[torch.dtype, ...] = ()  # allowed dtypes (empty: any, unless ``floats``)
    floats: bool = False                  # any floating-point dtype is allowed too
    shape: Optional[Tuple[int, ...]] = None   # the one shape allowed
    allowed: str = ""                     # how errors say the allowed dtype / shape ('float32')
    noun: str = ""                        # how errors name such a tensor ('observation input'; '': the role)
    feed: Optional[Feed] = None           # fed by a port this way (None: by no port)
    messages: MessageTypes = ANY_MESSAGES
    wrong_type: str = ""                  # the wording for a wrong dtype / shape ('': Wording.wrong_type)

    def admits_type(self, tensor: Tensor) -> bool:
        dtype_ok = not (self.dtypes or self.floats) or tensor.dtype in self.dtypes \
            or (self.floats and tensor.dtype.is_floating_point)
        return dtype_ok and (self.shape is None or tuple(tensor.shape) == self.shape)

    def takes(self, tensor: Tensor) -> bool:
        """Whether a rule with labels or names claims this tensor."""
        return (not self.labels or tensor.label in self.labels) and (not self.names or tensor.name in self.names)

    def stage(self) -> int:
        """The claiming round (``binding``'s docstring): pairs are round 0."""
        if self.labels or self.names:
            return 1
        return {Count.OPTIONAL: 2, Count.ONE: 3}.get(self.count, 4)


@dataclass(frozen=True)
class PairRule:
    """State pairs: the setting that lists them, and the name patterns recognised without it."""

    setting: str
    patterns: Tuple[Tuple[str, str], ...] = ()     # ('{}_in', '{}_out'): h_in pairs with h_out


@dataclass(frozen=True)
class BindingRules:
    """A policy kind's binding rules (``binding``'s docstring)."""

    roles: Tuple[RoleRule, ...]
    pairs: Optional[PairRule] = None
    reserved: Tuple[str, ...] = ()        # names no tensor may take (the runtime's buffers)
    reserved_ports: Tuple[str, ...] = ()  # names no port feeding a tensor may take (the policy's own buffers)
    unique: bool = False                  # tensor names must be unique
    map_setting: str = "features"         # the setting of the kind's port map (in its section)
    report: Report = Report.FIRST
    wording: Wording = field(default_factory=Wording)

    def rule_for_label(self, label: str) -> Optional[RoleRule]:
        return next((r for r in self.roles if label and label in r.labels), None)


@dataclass(frozen=True)
class Binding:
    """One tensor with its role, and what binds to it."""

    role: Role
    tensor: Tensor
    rule: RoleRule
    partner: Optional[Tensor] = None      # a state pair's output (the input is ``tensor``)
    port: Optional[BufferSpec] = None     # the port feeding it (an INPUT buffer)


@dataclass(frozen=True)
class BindingTable:
    """Every bound tensor: the state pairs in the order of the pair setting, then the rest
    in the order the policy listed them (inputs, then outputs)."""

    bindings: Tuple[Binding, ...]

    def of(self, role: Role) -> Tuple[Binding, ...]:
        return tuple(b for b in self.bindings if b.role == role)

    def one(self, role: Role) -> Optional[Binding]:
        """The binding of a role that binds at most one tensor (None: none)."""
        found = self.of(role)
        return found[0] if found else None

    def sources(self, role: Role) -> Tuple[Any, ...]:
        """The kind's own objects bound to ``role``."""
        return tuple(b.tensor.source for b in self.of(role))

    def fed(self) -> Tuple[Binding, ...]:
        """The bindings a port feeds, in tensor order."""
        return tuple(b for b in self.bindings if b.port is not None)

    def describe(self) -> List[dict]:
        """JSON-able (fit for a capsule fingerprint)."""
        return [{"role": b.role.value, "tensor": b.tensor.describe(),
                 **({"output": b.partner.describe()} if b.partner is not None else {}),
                 **({"port": b.port.name} if b.port is not None else {})} for b in self.bindings]
