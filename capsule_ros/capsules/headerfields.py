"""Strict readers of a capsule header's JSON values (no torch), shared by the header
(``capsule_ros.capsules.fileformat``) and its recipe object (``capsule_ros.capsules.recipe``).

Each takes the error type to raise: CorruptCapsule for a file being read, InvalidArgument
for a header a caller asks to write (one validator for both directions), and names the
offending key with its value quoted and cut short.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence, Type

from capsule_ros.errors import CapsuleRosError

ErrorType = Type[CapsuleRosError]
U64 = 1 << 64


def quote(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def get_typed(obj: Mapping[str, Any], key: str, kind: type, error: ErrorType, where: str) -> Any:
    value = obj[key]
    # bool is an int subclass: refuse it where an int is meant (and vice versa)
    if type(value) is not kind:
        raise error(f"{where}{key} = {quote(value)}: must be {kind.__name__}")
    return value


def get_int(obj: Mapping[str, Any], key: str, low: int, high: int, error: ErrorType, where: str = "") -> int:
    value = get_typed(obj, key, int, error, where)
    if not low <= value <= high:
        raise error(f"{where}{key} = {quote(value)}: must be in [{low}, {high}]")
    return value


def get_str(obj: Mapping[str, Any], key: str, max_chars: int, error: ErrorType, where: str = "") -> str:
    value = get_typed(obj, key, str, error, where)
    if len(value) > max_chars:
        raise error(f"{where}{key} = {quote(value)}: longer than {max_chars} characters")
    return value


def get_hex(obj: Mapping[str, Any], key: str, nbytes: int, error: ErrorType, where: str = "") -> bytes:
    value = get_str(obj, key, 2 * nbytes, error, where)
    if len(value) != 2 * nbytes or any(c not in "0123456789abcdef" for c in value):
        raise error(f"{where}{key} = {quote(value)}: must be {2 * nbytes} lowercase hex digits")
    return bytes.fromhex(value)


def check_keys(obj: Any, keys: Sequence[str], error: ErrorType, where: str) -> None:
    if not isinstance(obj, dict):
        raise error(f"{where}{quote(obj)}: must be a JSON object")
    if set(obj) != set(keys):
        missing, extra = sorted(set(keys) - set(obj)), sorted(set(obj) - set(keys))
        raise error(f"{where}keys: missing {missing}, unexpected {[quote(k, 40) for k in extra]}")
