"""Lazy public faces for subpackages: ``from capsule_ros.runtime import PolicyRuntime`` works,
yet importing a light submodule (``capsule_ros.runtime.schema``) does not import torch
through its package's ``__init__`` (PEP 562 module ``__getattr__``)."""
from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any, Callable, List, Mapping, Tuple


def lazy_exports(package: str, exports: Mapping[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each public name is imported from its
    module (``exports``: name -> module) the first time it is used."""
    table = MappingProxyType(dict(exports))

    def __getattr__(name: str) -> Any:
        try:
            module = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        return getattr(importlib.import_module(module), name)

    def __dir__() -> List[str]:
        return sorted(table)

    return __getattr__, __dir__
