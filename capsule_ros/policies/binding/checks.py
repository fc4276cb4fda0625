"""The binding checker: ``examine`` claims the roles (``claims.py``) and runs every check in
the order of ``binding``'s docstring; ``bind`` raises what it found, in the kind's words."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from capsule_ros.errors import ConfigError
from capsule_ros.policies.binding.claims import Claims
from capsule_ros.policies.binding.vocabulary import (
    Binding,
    BindingRules,
    BindingTable,
    Count,
    Feed,
    Port,
    Report,
    Side,
    Tensor,
)
from capsule_ros.policies.binding.wording import Problems
from capsule_ros.runtime.arena import BufferKind, BufferSpec, dtype_name


def _listed(values: Sequence[str]) -> str:
    """One value as it is, several as 'one of [...]'."""
    return values[0] if len(values) == 1 else f"one of {list(values)}"


class _Checks:
    """The checks of one run over ``claims``; ``feeds``: {tensor name: port name}."""

    def __init__(self, claims: Claims, problems: Problems, ports: Optional[Mapping[str, Port]],
                 feeds: Dict[str, str], resize: bool):
        self.claims, self.problems, self.ports, self.feeds, self.resize = claims, problems, ports, feeds, resize
        self.rules = claims.rules
        self.say = problems.say

    def run(self) -> None:
        """Every check, in ``binding``'s docstring's order."""
        ports = self.ports is not None
        for check in (self._ports_declared, self._ports_used, self._port_messages):
            if ports:
                check()
        self._unexpected_names()
        if ports:
            self._map_entries()
        for check in (self._counts, self._kinds, self._unique, self._reserved, self._leftovers, self._types,
                      self._labels):
            check()
        fed: Dict[str, str] = {}                  # port name -> the first tensor it feeds
        for index, (tensor, _) in enumerate(self.claims.tensors):
            binding = self.claims.at(index)
            if binding is None:
                self._unknown_label(tensor)
            elif binding.rule.feed is not None and ports:
                self._port_of(binding, binding.rule.feed, fed)

    # -- the port map ------------------------------------------------------------------------------
    def _ports_declared(self) -> None:
        assert self.ports is not None
        for key, port in self.feeds.items():
            if port not in self.ports:
                tensor = self.claims.input_named(key)
                wanted: Dict[str, Any] = {} if tensor is None else {"want_dtype": dtype_name(tensor.dtype),
                                                                    "want_shape": list(tensor.shape)}
                self.say("port_undeclared", key=key, port=port, ports=list(self.ports), **wanted)

    def _ports_used(self) -> None:
        assert self.ports is not None
        used = set(self.feeds.values())
        for port in self.ports:
            if port not in used:
                self.say("port_unused", port=port)

    def _port_messages(self) -> None:
        assert self.ports is not None
        for key, name in self.feeds.items():
            tensor, port = self.claims.input_named(key), self.ports.get(name)
            rule = self.claims.rule_of(tensor) if tensor is not None else None
            if tensor is None or rule is None or port is None or rule.messages.admits(port.type):
                continue
            self.say("port_message", port=name, port_type=port.type, key=key, label=tensor.label,
                     need=rule.messages.need)

    def _map_entries(self) -> None:
        inputs = self.claims.names(Side.INPUT)
        for key in self.feeds:
            if key not in inputs:
                self.say("map_unknown", key=key, names=inputs)

    # -- the tensors ----------------------------------------------------------------------------------
    def _unexpected_names(self) -> None:
        for t, side in self.claims.leftover():
            if self.rules.rule_for_label(t.label) is not None:
                names = [n for r in self.rules.roles if t.label in r.labels for n in r.names]
                self.say("unexpected_name", side=side.value, key=t.name, label=t.label,
                         names=repr(names[0]) if len(names) == 1 else names)

    def _counts(self) -> None:
        for rule in self.rules.roles:
            names = [b.tensor.name for b in self.claims.bindings() if b.rule is rule]
            noun = rule.noun or rule.role.value
            if not names and rule.count in (Count.ONE, Count.SOME):
                self.say("empty", noun=noun, count=rule.count.value)
            if len(names) > 1 and rule.count in (Count.ONE, Count.OPTIONAL):
                self.say("too_many", names=names, noun=noun, count=rule.count.value)

    def _kinds(self) -> None:
        for b in self.claims.bindings():
            if b.rule.kinds and b.tensor.kind not in b.rule.kinds:
                self.say("wrong_kind", label=b.tensor.label, key=b.tensor.name, kind=b.tensor.kind,
                         kinds=_listed(b.rule.kinds))

    def _unique(self) -> None:
        if self.rules.unique:
            names = [t.name for t, _ in self.claims.tensors]
            for name in sorted({n for n in names if names.count(n) > 1}):
                self.say("twice", key=name)

    def _reserved(self) -> None:
        for t, _ in self.claims.tensors:
            if t.name in self.rules.reserved:
                self.say("reserved", key=t.name, reserved=list(self.rules.reserved))

    def _leftovers(self) -> None:
        for side in Side:
            names = [t.name for t, s in self.claims.leftover() if s == side and not t.label]
            if names:
                self.say("leftover", side=side.value, names=names)

    def _types(self) -> None:
        for rule in self.rules.roles:
            for b in self.claims.bindings():
                if b.rule is rule and not rule.admits_type(b.tensor):
                    self.say("wrong_type", template=rule.wrong_type, noun=rule.noun or rule.role.value,
                             tensor=b.tensor.describe(), allowed=rule.allowed, key=b.tensor.name,
                             dtype=dtype_name(b.tensor.dtype), shape=list(b.tensor.shape))

    def _labels(self) -> None:
        for rule in self.rules.roles:
            if rule.labels and rule.names:
                for t, _ in self.claims.tensors:
                    if t.name in rule.names and t.label not in rule.labels:
                        self.say("wrong_label", key=t.name, labels=_listed(rule.labels), label=t.label)

    # -- tensor by tensor -------------------------------------------------------------------------------
    def _unknown_label(self, tensor: Tensor) -> None:
        if tensor.label and self.rules.rule_for_label(tensor.label) is None:
            labels = ", ".join(label for r in self.rules.roles for label in r.labels)
            self.say("unknown_label", side=Side.INPUT.value, key=tensor.name, label=tensor.label, labels=labels)

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
        """The claims with their ports (an INPUT buffer each)."""
        ports = self.ports or {}
        out = []
        for b in self.claims.bindings():
            port = ports.get(self.feeds.get(b.tensor.name, "")) if b.rule.feed is not None else None
            spec = None if port is None else BufferSpec(port.spec.name, port.spec.shape, port.spec.dtype,
                                                        BufferKind.INPUT)
            out.append(Binding(b.role, b.tensor, b.rule, b.partner, spec))
        return BindingTable(tuple(out))


def examine(rules: BindingRules, *, inputs: Sequence[Tensor] = (), outputs: Sequence[Tensor] = (),
            chosen: Optional[Mapping[str, str]] = None, pairs: Sequence[str] = (),
            ports: Optional[Mapping[str, Port]] = None, feeds: Optional[Mapping[str, str]] = None,
            resize: bool = False, where: str = "", section: str = "",
            fields: Optional[Mapping[str, Any]] = None) -> Tuple[BindingTable, List[str]]:
    """The binding table and every problem found, in the checker's order (``binding``'s docstring).

    ``inputs`` / ``outputs``: the policy's tensors; ``chosen``: {setting: value} of the
    rules' settings; ``pairs``: the pair setting's entries; ``ports``: the node's ports
    (None: no port is checked); ``feeds``: {tensor name: port name}, the kind's port map
    (None: each port-fed tensor is fed by the port of its name); ``resize``: resizable
    feeds take ports of another size; ``where`` / ``section`` / ``fields``: for the wording.
    """
    tensors = [(t, Side.INPUT) for t in inputs] + [(t, Side.OUTPUT) for t in outputs]
    shown = f"(inputs {[t.describe() for t in inputs]}, outputs {[t.describe() for t in outputs]})"
    problems = Problems(rules.wording, where=where, section=section, map_setting=rules.map_setting, shown=shown,
                        **(fields or {}))
    claims = Claims(rules, tensors, chosen or {}, pairs, problems)
    problems.fields["bound"].update({b.role.value: b.tensor.name for b in reversed(claims.bindings())})
    if feeds is None:
        feeds = {b.tensor.name: b.tensor.name for b in claims.bindings() if b.rule.feed is not None}
    checks = _Checks(claims, problems, ports, dict(feeds), resize)
    checks.run()
    return checks.table(), problems.found


def bind(rules: BindingRules, *, error: Type[ConfigError] = ConfigError, **request: Any) -> BindingTable:
    """``examine``'s table, or ``error`` with the first problem (``Report.FIRST``) or
    ``'<where>: '`` and every problem joined (``Report.ALL``)."""
    table, problems = examine(rules, **request)
    if problems:
        raise error(problems[0] if rules.report is Report.FIRST
                    else f"{request.get('where', '')}: {'; '.join(problems)}")
    return table
