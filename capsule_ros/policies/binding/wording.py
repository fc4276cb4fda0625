"""Every message the binding checker can give (``Wording``), and the problems one run
collects (``Problems``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List


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


class Fields(dict):
    """Template fields; a missing one formats as '' (a message about a half-bound policy)."""

    def __missing__(self, key: str) -> str:
        return ""


class Problems:
    """The problems one run of the checker found, worded by a kind's ``Wording``; ``fields``
    are those every message may use (where, section, shown, bound, the caller's)."""

    def __init__(self, wording: Wording, **fields: Any):
        self.wording = wording
        self.fields = Fields(bound=Fields(), **fields)
        self.found: List[str] = []

    def say(self, message: str, template: str = "", **fields: Any) -> None:
        """Record ``message`` (a Wording field, or ``template`` when given) with these fields."""
        text = template or getattr(self.wording, message)
        self.found.append(text.format_map(Fields(self.fields, **fields)))
