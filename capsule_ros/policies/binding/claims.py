"""Which tensor of a policy takes which role: the claiming rounds of ``binding``'s docstring
(state pairs, then rules with labels or names, then OPTIONAL choices, then ONE choices,
then rules that take what is left)."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from capsule_ros.policies.binding.vocabulary import Binding, BindingRules, Count, PairRule, Role, RoleRule, Side, Tensor
from capsule_ros.policies.binding.wording import Problems


def _base(name: str, pattern: str) -> str:
    """The part of ``name`` that fills ``pattern``'s '{}' ('' when it does not fit)."""
    head, _, tail = pattern.partition("{}")
    fits = name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail)
    return name[len(head):len(name) - len(tail)] if fits else ""


class Claims:
    """The roles of ``tensors`` (each with its side) under ``rules``; what claiming finds wrong
    (a pair setting, a setting naming no free tensor, a choice it cannot make) goes to
    ``problems``. ``chosen``: {setting: value} of the rules' settings; ``pair_entries``:
    the pair setting's entries."""

    def __init__(self, rules: BindingRules, tensors: Sequence[Tuple[Tensor, Side]], chosen: Mapping[str, str],
                 pair_entries: Sequence[str], problems: Problems):
        self.rules, self.tensors, self.chosen, self.problems = rules, list(tensors), chosen, problems
        self.claims: Dict[int, Binding] = {}            # tensor index -> its binding (a pair's: both indices)
        self.pair_bindings: List[Binding] = []          # in the pair setting's order
        self._pair(pair_entries)
        for rule in sorted(rules.roles, key=RoleRule.stage):
            self._claim(rule)

    # -- what was claimed ---------------------------------------------------------------------------
    def bindings(self) -> List[Binding]:
        """The bindings: state pairs in the pair setting's order, then the rest in tensor order."""
        return self.pair_bindings + [b for _, b in sorted(self.claims.items()) if b.partner is None]

    def at(self, index: int) -> Optional[Binding]:
        return self.claims.get(index)

    def leftover(self) -> List[Tuple[Tensor, Side]]:
        """The tensors no rule took, in order."""
        return [pair for i, pair in enumerate(self.tensors) if i not in self.claims]

    def named(self, side: Side, name: str) -> Optional[int]:
        return next((i for i, (t, s) in enumerate(self.tensors) if s == side and t.name == name), None)

    def input_named(self, name: str) -> Optional[Tensor]:
        i = self.named(Side.INPUT, name)
        return None if i is None else self.tensors[i][0]

    def names(self, side: Side) -> List[str]:
        return [t.name for t, s in self.tensors if s == side]

    def rule_of(self, tensor: Tensor) -> Optional[RoleRule]:
        """The rule that took ``tensor``, else the one its label belongs to."""
        taken = next((b.rule for b in self.claims.values() if b.tensor is tensor), None)
        return taken or self.rules.rule_for_label(tensor.label)

    # -- claiming -----------------------------------------------------------------------------------
    def _free(self, side: Side) -> List[int]:
        return [i for i, (_, s) in enumerate(self.tensors) if s == side and i not in self.claims]

    def _bind(self, index: int, rule: RoleRule, partner: Optional[Tensor] = None) -> None:
        self.claims[index] = Binding(rule.role, self.tensors[index][0], rule, partner)

    def _pair(self, entries: Sequence[str]) -> None:
        rule = self.rules.pairs
        if rule is None:
            return
        bound: List[Tuple[int, int]] = []
        for left, right in self._pair_names(rule, entries):
            i, o = self.named(Side.INPUT, left), self.named(Side.OUTPUT, right)
            if i is None or o is None:
                missing = f"input {left!r}" if i is None else f"output {right!r}"
                self.problems.say("pair_unknown", setting=rule.setting, left=left, right=right, missing=missing)
                continue
            a, b = self.tensors[i][0], self.tensors[o][0]
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                self.problems.say("pair_mismatch", input=a.describe(), output=b.describe())
            bound.append((i, o))
        if len({i for i, _ in bound}) != len(bound) or len({o for _, o in bound}) != len(bound):
            self.problems.say("pair_twice", setting=rule.setting, entries=list(entries))
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
                self.problems.say("pair_entry", setting=rule.setting, entry=entry)
            else:
                names.append((left, right))
        return names

    def _recognised(self, rule: PairRule) -> List[Tuple[str, str]]:
        """Each input with the first output a pattern names for it."""
        outputs = set(self.names(Side.OUTPUT))
        pairs = []
        for name in self.names(Side.INPUT):
            candidates = (out.format(_base(name, pattern)) for pattern, out in rule.patterns if _base(name, pattern))
            partner = next((candidate for candidate in candidates if candidate in outputs), None)
            if partner is not None:
                pairs.append((name, partner))
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
        """A ONE or OPTIONAL rule's tensor: the one its setting names; else an OPTIONAL rule's
        first usual name, a ONE rule's only free tensor, or its usual name among several."""
        by_name = {self.tensors[i][0].name: i for i in free}
        chosen = self.chosen.get(rule.setting, "") if rule.setting else ""
        usual = next((by_name[n] for n in rule.usual if n in by_name), None)
        if chosen:
            if chosen not in by_name:
                self.problems.say("not_free", setting=rule.setting, chosen=chosen, side=rule.side.value)
            return by_name.get(chosen)
        if rule.count is Count.OPTIONAL or (len(free) > 1 and usual is not None):
            return usual
        if len(free) != 1:
            self.problems.say("ambiguous", side=rule.side.value, role=rule.role.value, setting=rule.setting,
                              names=sorted(by_name) or "none")
            return None
        return free[0]
