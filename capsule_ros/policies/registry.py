"""Which policies ``policy.kind`` can name: the built-in kinds and those other Python
packages register, with no change to capsule_ros.

A kind is a ``PolicyKind``: its name, its own typed configuration section (a
``ConfigSection`` whose settings become the ROS parameters ``policy.<kind>.*``, with
descriptors, ranges and read-only flags like the built-in ones), and a ``build`` function
that makes a ``StatefulPolicy`` for the configured ports.

Another package registers kinds through the entry-point group ``capsule_ros.policies``;
each entry point names a ``PolicyKind`` (or a function returning one), e.g. in its
``pyproject.toml``::

    [project.entry-points."capsule_ros.policies"]
    gru_chunk = "my_policies.gru:POLICY_KIND"

docs/bring-your-own-policy.md is the guide (the contract a policy must keep).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple, Type

from capsule_ros.config import ConfigSection
from capsule_ros.errors import ConfigError
from capsule_ros.runtime.arena import BufferSpec
from capsule_ros.runtime.policy import StatefulPolicy

if TYPE_CHECKING:
    from capsule_ros.policies.vla.rtc import RTCSettings

ENTRY_POINT_GROUP = "capsule_ros.policies"


@dataclass(frozen=True)
class BuildContext:
    """What a kind's ``build`` gets: its own validated settings and what the node knows."""

    settings: ConfigSection                # the section policy.<kind>
    inputs: Tuple[BufferSpec, ...]         # one INPUT buffer per port (name, shape, dtype)
    ports: Mapping[str, Any]               # port name -> PortConfig (types, fields: e.g. for feature maps)
    weights: Optional[Path]                # policy.weights resolved to a file (None: '', random init)
    seed: int                              # policy.init_seed: random initialisation, deterministic per device kind
    device: Any                            # torch.device the modules may be built on directly
    task: str = ""                         # policy.task: a VLA's task instruction until a text port says another
    rtc: Optional[RTCSettings] = None      # control.rtc and its settings (None: off)


@dataclass(frozen=True)
class PolicyKind:
    """One kind of policy (see the module docstring)."""

    name: str
    settings: Type[ConfigSection]
    build: Callable[[BuildContext], StatefulPolicy]
    summary: str = ""


# Built-in kinds: name -> "module:attribute" of their PolicyKind (imported when used).
BUILTIN = {
    "hybrid": "capsule_ros.policies.hybrid:POLICY_KIND",
    "exported": "capsule_ros.policies.exported:POLICY_KIND",
    "lerobot_act": "capsule_ros.policies.lerobot.kinds:ACT_KIND",
    "lerobot_diffusion": "capsule_ros.policies.lerobot.kinds:DIFFUSION_KIND",
    "onnx": "capsule_ros.policies.ort.kind:POLICY_KIND",
    "lerobot_smolvla": "capsule_ros.policies.lerobot.smolvla_kind:SMOLVLA_KIND",
    "lerobot_pi0": "capsule_ros.policies.lerobot.pi.kind:PI0_KIND",
    "lerobot_pi05": "capsule_ros.policies.lerobot.pi.kind:PI05_KIND",
}


def _resolve(target: Any, where: str) -> PolicyKind:
    kind = target() if callable(target) and not isinstance(target, PolicyKind) else target
    if not isinstance(kind, PolicyKind):
        raise ConfigError(f"{where} is not a capsule_ros PolicyKind (got {type(kind).__name__})")
    return kind


def _import(spec: str) -> Any:
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


def kind_names() -> Tuple[str, ...]:
    """Every kind ``policy.kind`` can name: built-in, then registered (sorted)."""
    registered = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in BUILTIN)
    return tuple(BUILTIN) + tuple(registered)


def policy_kind(name: str) -> PolicyKind:
    """The kind ``name`` names; ConfigError listing the known ones otherwise (or naming the
    package whose entry point fails to load)."""
    if name in BUILTIN:
        return _resolve(_import(BUILTIN[name]), f"built-in policy kind {name!r}")
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise ConfigError(f"policy.kind = {name!r}: no such policy; known: {list(kind_names())} (a package "
                          f"registers more through the entry-point group {ENTRY_POINT_GROUP!r})")
    ep = found[0]
    try:
        target = ep.load()
    except Exception as exc:
        raise ConfigError(f"policy.kind = {name!r}: its entry point {ep.value!r} does not load "
                          f"({type(exc).__name__}: {exc})") from exc
    kind = _resolve(target, f"entry point {ep.value!r}")
    if kind.name != name:
        raise ConfigError(f"entry point {name!r} ({ep.value!r}) registers a kind named {kind.name!r}")
    return kind


def kind_settings(name: str) -> Dict[str, Type[ConfigSection]]:
    """{'policy.<name>': its settings class}: the section the node declares for a kind."""
    return {f"policy.{name}": policy_kind(name).settings}
