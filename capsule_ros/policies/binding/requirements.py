"""Tables of conditions on a kind's options or a checkpoint's configuration, each row with
what to say when it fails (the same idea as the binding rules, for settings)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Type

from capsule_ros.errors import ConfigError


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
