"""One binding vocabulary for every policy kind: the role each tensor of a policy plays,
which tensor plays it, and which port feeds it.

A kind states its rules as data, a ``BindingRules`` table of ``RoleRule`` rows, and
calls ``bind`` with what it has read: its tensors (a model's inputs and outputs, a
checkpoint's features, a program's declared inputs and state, as ``Tensor``) and, where
the node's ports feed them, the ports (``ports_of``) and the kind's port map. ``bind``
returns a ``BindingTable`` (every tensor with its role, a state pair's output, the port
feeding it) or raises the kind's ``ConfigError`` naming the setting, port or tensor and
what is allowed, in the kind's ``Wording``. No kind has a checker of its own.

How tensors get their roles. Rules claim tensors in four rounds, each in table order:

1. the state pairs (``PairRule``): the entries of the kind's pair setting
   (``'<input>:<output>'``), or, when it is empty, each input whose name fits a pattern
   (``'{}_in'`` -> ``'{}_out'``) with the output the pattern names;
2. rules with ``labels`` or ``names``: every tensor of that label (a LeRobot feature
   type, a declared group such as a program's ``input`` / ``state``) and, when ``names``
   is given, of one of those names;
3. OPTIONAL rules: the tensor their setting names, else the first free one with a usual
   name, else none;
4. ONE rules: the tensor their setting names, else the only free one on their side, else
   the free one with a usual name; then rules with neither (an ANY rule takes every
   tensor left on its side: a model's extra outputs).

Then the checks, in this order (a kind reports the first problem, or all of them joined
when its rules say ``Report.ALL``): the pairs; settings that name no free tensor; the
port map against the ports (a port that is not declared, a port that feeds nothing, a
port of the wrong message type); a tensor whose label some rule takes under other names;
a map entry naming no tensor; per rule: count, declared buffer kind, unique and reserved
names, unlabelled tensors left over, dtype and shape, a rule's name on another label;
then tensor by tensor: a label no rule takes, or for a port-fed one: no port, a shape its
feed cannot take, the port's shape and dtype, a port feeding two tensors, a port with a
reserved name.

A VLA kind, for one: its cameras (label VISUAL, ``RGB_IMAGE`` fed by
``IMAGE_MESSAGES``), its joint state (``VECTOR``), its task tokens (a ``Tensor`` the kind
adds, ``TOKENS`` fed by ``TEXT_MESSAGES``, a ``std_msgs/msg/String`` port) and its
action chunk (an output) are four rows of a table (``test/test_binding.py`` has one).

``Requirement`` / ``require`` / ``unmet`` are the same idea for a kind's options and a
checkpoint's configuration: a table of conditions, each with what to say when it fails.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import BufferKind, BufferSpec, dtype_name

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
    """One row of a kind's table: which tensors take ``role`` (module docstring) and what they must be."""

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
        """The claiming round (module docstring): pairs are round 0."""
        if self.labels or self.names:
            return 1
        return {Count.OPTIONAL: 2, Count.ONE: 3}.get(self.count, 4)


@dataclass(frozen=True)
class PairRule:
    """State pairs: the setting that lists them, and the name patterns recognised without it."""

    setting: str
    patterns: Tuple[Tuple[str, str], ...] = ()     # ('{}_in', '{}_out'): h_in pairs with h_out


@dataclass(frozen=True)
class Wording:
    """Every message the checker can give, as ``str.format`` templates. Fields: where,
    section, map_setting, shown (the policy's tensors), bound (role -> first tensor
    name), any the caller adds, and per message those its default uses."""

    pair_entry: str = "{where}: {setting} entry {entry!r}: expected '<input>:<output>'"
    pair_unknown: str = "{where}: {setting} pairs {left!r} with {right!r}, but the model has no {missing} {shown}"
    pair_mismatch: str = ("{where}: state {input} comes back as {output}; a state pair needs one shape and dtype on "
                          "both sides")
    pair_twice: str = "{where}: {setting} uses a tensor in two pairs: {entries}"
    not_free: str = "{where}: {setting} = {chosen!r} is not a free {side} of the model {shown}"
    ambiguous: str = ("{where}: cannot tell which {side} is the {role}: {names} are left after the state pairs; "
                      "set {setting} {shown}")
    leftover: str = "{where}: the {side}s {names} have no role; capsule_ros cannot feed them {shown}"
    unknown_label: str = "{where}: {side} {key!r} has type {label!r}; supported: {labels}"
    unexpected_name: str = "{where}: {side} {key!r} ({label}) is read only as {names}; rename it or drop it"
    empty: str = "{where}: the policy has no {noun} ({count})"
    too_many: str = "{where}: {names} are each a {noun}; the policy takes {count}"
    wrong_kind: str = "{where}: {label} {key!r} has kind {kind} (must be {kinds})"
    twice: str = "{where}: name {key!r} is used twice"
    reserved: str = "{where}: name {key!r} is a buffer the runtime writes ({reserved})"
    wrong_type: str = "{where}: the {noun} {tensor} must be {allowed}"
    wrong_label: str = "{where}: {key!r} must be {labels}, not {label}"
    wrong_shape: str = "{where}: {noun} {key!r} has shape {shape}; {expected}"
    port_undeclared: str = "{section}.{map_setting} maps {key!r} to port {port!r}, which is not in ports.names {ports}"
    port_unused: str = ("port {port!r} feeds nothing of {where}: map it in {section}.{map_setting} or remove it from "
                        "ports.names")
    port_message: str = "port {port!r} ({port_type}) cannot feed {key!r} ({label}): it needs {need}"
    map_unknown: str = "{section}.{map_setting} entry {key!r} is not an input of {where}; its inputs are {names}"
    no_port: str = ("{key!r} of {where} has no port in {section}.{map_setting}: map it to the {port_noun} port that "
                    "feeds it")
    port_mismatch: str = ("port {port!r} cannot feed {key!r}: it is {have_dtype} {have_shape}, {where} needs {what} "
                          "{want_dtype} {want_shape}{hint}")
    port_twice: str = "port {port!r} feeds both {other!r} and {key!r}; give each its own port"
    port_reserved: str = "port name {port!r} (feeding {key!r}) is a buffer of the policy itself; rename the port"
    resize_hint: str = ""                 # appended to port_mismatch for a resizable feed with resizing off


@dataclass(frozen=True)
class BindingRules:
    """A policy kind's binding rules (module docstring)."""

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


class _Fields(dict):
    """Template fields; a missing one formats as '' (a message about a half-bound policy)."""

    def __missing__(self, key: str) -> str:
        return ""


def _listed(values: Sequence[str]) -> str:
    """One value as it is, several as 'one of [...]'."""
    return values[0] if len(values) == 1 else f"one of {list(values)}"


class _Examination:
    """One run of the checker: the claims, then the checks (module docstring)."""

    def __init__(self, rules: BindingRules, tensors: List[Tuple[Tensor, Side]], chosen: Mapping[str, str],
                 pair_entries: Sequence[str], ports: Optional[Mapping[str, Port]],
                 feeds: Optional[Mapping[str, str]], resize: bool, fields: Mapping[str, Any]):
        self.rules, self.tensors, self.chosen = rules, tensors, chosen
        self.ports, self.resize = ports, resize
        self.claims: Dict[int, Binding] = {}
        self.pair_bindings: List[Binding] = []
        self.problems: List[str] = []
        inputs = [t.describe() for t, s in tensors if s == Side.INPUT]
        outputs = [t.describe() for t, s in tensors if s == Side.OUTPUT]
        self.fields = _Fields(map_setting=rules.map_setting, shown=f"(inputs {inputs}, outputs {outputs})",
                              bound=_Fields(), **fields)
        self._pair(pair_entries)
        for rule in sorted(rules.roles, key=RoleRule.stage):
            self._claim(rule)
        self.fields["bound"].update({b.role.value: b.tensor.name for b in reversed(self._in_order())})
        self.feeds = dict(feeds) if feeds is not None else {
            b.tensor.name: b.tensor.name for b in self._in_order() if b.rule.feed is not None}

    # -- claims ----------------------------------------------------------------------------------
    def say(self, message: str, **fields: Any) -> None:
        """Record the problem ``message`` (a Wording field) with these template fields."""
        self.problems.append(getattr(self.rules.wording, message).format_map(_Fields(self.fields, **fields)))

    def _free(self, side: Side) -> List[int]:
        return [i for i, (_, s) in enumerate(self.tensors) if s == side and i not in self.claims]

    def _named(self, side: Side, name: str) -> Optional[int]:
        return next((i for i, (t, s) in enumerate(self.tensors) if s == side and t.name == name), None)

    def _bind(self, index: int, rule: RoleRule, partner: Optional[Tensor] = None) -> None:
        self.claims[index] = Binding(rule.role, self.tensors[index][0], rule, partner)

    def _pair(self, entries: Sequence[str]) -> None:
        rule = self.rules.pairs
        if rule is None:
            return
        names = self._pair_names(rule, entries)
        bound: List[Tuple[int, int]] = []
        for left, right in names:
            i, o = self._named(Side.INPUT, left), self._named(Side.OUTPUT, right)
            if i is None or o is None:
                missing = f"input {left!r}" if i is None else f"output {right!r}"
                self.say("pair_unknown", setting=rule.setting, left=left, right=right, missing=missing)
                continue
            a, b = self.tensors[i][0], self.tensors[o][0]
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                self.say("pair_mismatch", input=a.describe(), output=b.describe())
            bound.append((i, o))
        if len({i for i, _ in bound}) != len(bound) or len({o for _, o in bound}) != len(bound):
            self.say("pair_twice", setting=rule.setting, entries=list(entries))
        state = RoleRule(Role.STATE, setting=rule.setting)
        for i, o in bound:
            self._bind(i, state, self.tensors[o][0])
            self.claims[o] = self.claims[i]
            self.pair_bindings.append(self.claims[i])

    def _pair_names(self, rule: PairRule, entries: Sequence[str]) -> List[Tuple[str, str]]:
        """The pairs the setting lists, else those the patterns recognise."""
        if not entries:
            return self._recognised(rule)
        names = []
        for entry in entries:
            left, sep, right = entry.partition(":")
            if not sep or not left or not right:
                self.say("pair_entry", setting=rule.setting, entry=entry)
            else:
                names.append((left, right))
        return names

    def _recognised(self, rule: PairRule) -> List[Tuple[str, str]]:
        outputs = {t.name for t, s in self.tensors if s == Side.OUTPUT}
        pairs = []
        for t, side in self.tensors:
            matches = (out.format(_base(t.name, pattern)) for pattern, out in rule.patterns
                       if side == Side.INPUT and _base(t.name, pattern))
            partner = next((name for name in matches if name in outputs), None)
            if partner is not None:
                pairs.append((t.name, partner))
        return pairs

    def _claim(self, rule: RoleRule) -> None:
        free = self._free(rule.side)
        if rule.labels or rule.names:
            claimed = [i for i in free if rule.takes(self.tensors[i][0])]
        elif rule.count in (Count.ONE, Count.OPTIONAL):
            chosen = self._choose(rule, free)
            claimed = [] if chosen is None else [chosen]
        else:
            claimed = free
        for i in claimed:
            self._bind(i, rule)

    def _choose(self, rule: RoleRule, free: List[int]) -> Optional[int]:
        """A ONE or OPTIONAL rule's tensor (module docstring)."""
        by_name = {self.tensors[i][0].name: i for i in free}
        chosen = self.chosen.get(rule.setting, "") if rule.setting else ""
        usual = next((by_name[n] for n in rule.usual if n in by_name), None)
        if chosen:
            if chosen not in by_name:
                self.say("not_free", setting=rule.setting, chosen=chosen, side=rule.side.value)
            return by_name.get(chosen)
        if rule.count is Count.OPTIONAL or (len(free) > 1 and usual is not None):
            return usual
        if len(free) != 1:
            self.say("ambiguous", side=rule.side.value, role=rule.role.value, setting=rule.setting,
                     names=sorted(by_name) or "none")
            return None
        return free[0]

    def _in_order(self) -> List[Binding]:
        """The bindings: state pairs in the pair setting's order, then the rest in tensor order."""
        return self.pair_bindings + [b for _, b in sorted(self.claims.items()) if b.partner is None]

    # -- checks ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Every check, in the module docstring's order."""
        if self.ports is not None:
            self._ports_declared()
            self._ports_used()
            self._port_messages()
        self._unexpected_names()
        if self.ports is not None:
            self._map_entries()
        for check in (self._counts, self._kinds, self._unique, self._reserved, self._leftovers, self._types,
                      self._labels):
            check()
        fed: Dict[str, str] = {}                  # port name -> the first tensor it feeds
        for index, (tensor, _) in enumerate(self.tensors):
            binding = self.claims.get(index)
            if binding is None:
                self._unknown_label(tensor)
            elif binding.rule.feed is not None and self.ports is not None:
                self._port_of(binding, binding.rule.feed, fed)

    def _tensor(self, name: str) -> Optional[Tensor]:
        i = self._named(Side.INPUT, name)
        return None if i is None else self.tensors[i][0]

    def _rule_of(self, tensor: Tensor) -> Optional[RoleRule]:
        claimed = next((b.rule for b in self.claims.values() if b.tensor is tensor), None)
        return claimed or self.rules.rule_for_label(tensor.label)

    def _want(self, tensor: Optional[Tensor]) -> Dict[str, Any]:
        return {} if tensor is None else {"want_dtype": dtype_name(tensor.dtype), "want_shape": list(tensor.shape)}

    def _ports_declared(self) -> None:
        assert self.ports is not None
        for key, port in self.feeds.items():
            if port not in self.ports:
                self.say("port_undeclared", key=key, port=port, ports=list(self.ports), **self._want(self._tensor(key)))

    def _ports_used(self) -> None:
        assert self.ports is not None
        used = set(self.feeds.values())
        for port in self.ports:
            if port not in used:
                self.say("port_unused", port=port)

    def _port_messages(self) -> None:
        assert self.ports is not None
        for key, name in self.feeds.items():
            tensor, port = self._tensor(key), self.ports.get(name)
            rule = self._rule_of(tensor) if tensor is not None else None
            if tensor is None or rule is None or port is None or rule.messages.admits(port.type):
                continue
            self.say("port_message", port=name, port_type=port.type, key=key, label=tensor.label,
                     need=rule.messages.need)

    def _leftover(self) -> List[Tuple[Tensor, Side]]:
        return [self.tensors[i] for i in range(len(self.tensors)) if i not in self.claims]

    def _unexpected_names(self) -> None:
        for t, side in self._leftover():
            rule = self.rules.rule_for_label(t.label)
            if rule is not None:
                names = [n for r in self.rules.roles if t.label in r.labels for n in r.names]
                self.say("unexpected_name", side=side.value, key=t.name, label=t.label,
                         names=repr(names[0]) if len(names) == 1 else names)

    def _map_entries(self) -> None:
        inputs = [t.name for t, s in self.tensors if s == Side.INPUT]
        for key in self.feeds:
            if key not in inputs:
                self.say("map_unknown", key=key, names=inputs)

    def _unknown_label(self, tensor: Tensor) -> None:
        if tensor.label and self.rules.rule_for_label(tensor.label) is None:
            labels = ", ".join(label for r in self.rules.roles for label in r.labels)
            self.say("unknown_label", side=Side.INPUT.value, key=tensor.name, label=tensor.label, labels=labels)

    def _counts(self) -> None:
        for rule in self.rules.roles:
            names = [b.tensor.name for b in self._in_order() if b.rule is rule]
            noun = rule.noun or rule.role.value
            if not names and rule.count in (Count.ONE, Count.SOME):
                self.say("empty", noun=noun, count=rule.count.value)
            if len(names) > 1 and rule.count in (Count.ONE, Count.OPTIONAL):
                self.say("too_many", names=names, noun=noun, count=rule.count.value)

    def _kinds(self) -> None:
        for b in self._in_order():
            if b.rule.kinds and b.tensor.kind not in b.rule.kinds:
                self.say("wrong_kind", label=b.tensor.label, key=b.tensor.name, kind=b.tensor.kind,
                         kinds=_listed(b.rule.kinds))

    def _unique(self) -> None:
        if self.rules.unique:
            names = [t.name for t, _ in self.tensors]
            for name in sorted({n for n in names if names.count(n) > 1}):
                self.say("twice", key=name)

    def _reserved(self) -> None:
        for t, _ in self.tensors:
            if t.name in self.rules.reserved:
                self.say("reserved", key=t.name, reserved=list(self.rules.reserved))

    def _leftovers(self) -> None:
        for side in Side:
            names = [t.name for t, s in self._leftover() if s == side and not t.label]
            if names:
                self.say("leftover", side=side.value, names=names)

    def _types(self) -> None:
        for rule in self.rules.roles:
            for b in self._in_order():
                if b.rule is rule and not rule.admits_type(b.tensor):
                    self.problems.append((rule.wrong_type or self.rules.wording.wrong_type).format_map(_Fields(
                        self.fields, noun=rule.noun or rule.role.value, tensor=b.tensor.describe(),
                        allowed=rule.allowed, key=b.tensor.name, dtype=dtype_name(b.tensor.dtype),
                        shape=list(b.tensor.shape))))

    def _labels(self) -> None:
        for rule in self.rules.roles:
            if rule.labels and rule.names:
                for t, _ in self.tensors:
                    if t.name in rule.names and t.label not in rule.labels:
                        self.say("wrong_label", key=t.name, labels=_listed(rule.labels), label=t.label)

    def _port_of(self, b: Binding, feed: Feed, fed: Dict[str, str]) -> None:
        """A port-fed tensor's checks: its port is mapped, its shape fits the feed, the port
        fits it, feeds nothing else and has no reserved name."""
        assert self.ports is not None
        key = b.tensor.name
        if key not in self.feeds:
            self.say("no_port", key=key, port_noun=feed.port_noun)
            return
        if not feed.fits(b.tensor):
            self.say("wrong_shape", noun=b.rule.noun or b.role.value, key=key, shape=list(b.tensor.shape),
                     expected=feed.expected)
            return
        port = self.ports.get(self.feeds[key])
        if port is None:
            return                                  # port_undeclared said so
        spec = port.spec
        shape, dtype = feed.port_for(b.tensor, spec, self.resize)
        if tuple(spec.shape) != shape or spec.dtype != dtype:
            self.say("port_mismatch", port=spec.name, key=key, have_dtype=dtype_name(spec.dtype),
                     have_shape=list(spec.shape), what=feed.what, want_dtype=dtype_name(dtype), want_shape=list(shape),
                     hint=self.rules.wording.resize_hint if feed.resizable and not self.resize else "")
        if spec.name in fed:
            self.say("port_twice", port=spec.name, other=fed[spec.name], key=key)
        fed.setdefault(spec.name, key)
        if spec.name in self.rules.reserved_ports:
            self.say("port_reserved", port=spec.name, key=key)

    def table(self) -> BindingTable:
        ports = self.ports or {}
        out = []
        for b in self._in_order():
            port = ports.get(self.feeds.get(b.tensor.name, "")) if b.rule.feed is not None else None
            spec = None if port is None else BufferSpec(port.spec.name, port.spec.shape, port.spec.dtype,
                                                        BufferKind.INPUT)
            out.append(Binding(b.role, b.tensor, b.rule, b.partner, spec))
        return BindingTable(tuple(out))


def _base(name: str, pattern: str) -> str:
    """The part of ``name`` that fills ``pattern``'s '{}' ('' when it does not fit)."""
    head, _, tail = pattern.partition("{}")
    fits = name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail)
    return name[len(head):len(name) - len(tail)] if fits else ""


def examine(rules: BindingRules, *, inputs: Sequence[Tensor] = (), outputs: Sequence[Tensor] = (),
            chosen: Optional[Mapping[str, str]] = None, pairs: Sequence[str] = (),
            ports: Optional[Mapping[str, Port]] = None, feeds: Optional[Mapping[str, str]] = None,
            resize: bool = False, where: str = "", section: str = "",
            fields: Optional[Mapping[str, Any]] = None) -> Tuple[BindingTable, List[str]]:
    """The binding table and every problem found, in the checker's order (module docstring).

    ``inputs`` / ``outputs``: the policy's tensors; ``chosen``: {setting: value} of the
    rules' settings; ``pairs``: the pair setting's entries; ``ports``: the node's ports
    (None: no port is checked); ``feeds``: {tensor name: port name}, the kind's port map
    (None: each port-fed tensor is fed by the port of its name); ``resize``: resizable
    feeds take ports of another size; ``where`` / ``section`` / ``fields``: for the wording.
    """
    tensors = [(t, Side.INPUT) for t in inputs] + [(t, Side.OUTPUT) for t in outputs]
    run = _Examination(rules, tensors, chosen or {}, pairs, ports, feeds, resize,
                       {"where": where, "section": section, **(fields or {})})
    run.check()
    return run.table(), run.problems


def bind(rules: BindingRules, *, error: Type[ConfigError] = ConfigError, **request: Any) -> BindingTable:
    """``examine``'s table, or ``error`` with the first problem (``Report.FIRST``) or
    ``'<where>: '`` and every problem joined (``Report.ALL``)."""
    table, problems = examine(rules, **request)
    if problems:
        raise error(problems[0] if rules.report is Report.FIRST
                    else f"{request.get('where', '')}: {'; '.join(problems)}")
    return table


# --- options and configurations ---------------------------------------------------------------

@dataclass(frozen=True)
class Requirement:
    """A condition on a kind's options or a checkpoint's configuration, and what to say when
    it fails. A table of them is checked in order, so a row may assume the rows before it hold."""

    holds: Callable[[Any], bool]
    says: Callable[[Any], str]


def unmet(requirements: Iterable[Requirement], subject: Any) -> List[str]:
    """What every failing requirement says (rows that do not depend on each other)."""
    return [r.says(subject) for r in requirements if not r.holds(subject)]


def require(requirements: Iterable[Requirement], subject: Any, error: Type[ConfigError] = ConfigError,
            prefix: str = "") -> None:
    """Raise ``error`` with ``prefix`` and what the first failing requirement says."""
    for requirement in requirements:
        if not requirement.holds(subject):
            raise error(prefix + requirement.says(subject))
