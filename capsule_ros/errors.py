"""Typed errors shared by every layer, each carrying the error code the services answer.

The numbers are the ``error_code`` constants of every ``capsule_ros/srv`` service
(test_foundation.py::test_interfaces_share_error_codes_and_response_fields checks they
agree). Raise the most specific class; the node maps any
``CapsuleRosError`` to its code and any other exception to ``INTERNAL``.
"""
import errno
import os
from enum import IntEnum
from typing import Optional, Union


class ErrorCode(IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    FINGERPRINT_MISMATCH = 3
    CORRUPT = 4
    WRONG_STATE = 5
    BUSY = 6
    INTERNAL = 7
    RESOURCE_EXHAUSTED = 8
    IO_ERROR = 9
    PERMISSION_DENIED = 10


class CapsuleRosError(Exception):
    """Base class: a refused request. The live state is unchanged when one is raised."""

    code = ErrorCode.INTERNAL


class InvalidArgument(CapsuleRosError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


class NotFound(CapsuleRosError, KeyError):
    code = ErrorCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class FingerprintMismatch(CapsuleRosError):
    """The capsule was made by another graph (weights, schema, dtype or device kind)."""

    code = ErrorCode.FINGERPRINT_MISMATCH


class CorruptCapsule(CapsuleRosError):
    """The capsule's bytes failed verification (format, checksum, AEAD tag, size)."""

    code = ErrorCode.CORRUPT


class WrongState(CapsuleRosError):
    code = ErrorCode.WRONG_STATE


class Busy(CapsuleRosError):
    code = ErrorCode.BUSY


class ResourceExhausted(CapsuleRosError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class CapsuleIOError(CapsuleRosError, OSError):
    code = ErrorCode.IO_ERROR


class PermissionDenied(CapsuleRosError, PermissionError):
    code = ErrorCode.PERMISSION_DENIED


class ConfigError(InvalidArgument):
    """A configuration value is out of range or malformed; the message quotes it."""


def error_code_of(exc: BaseException) -> ErrorCode:
    """The service error code for any exception (INTERNAL for unexpected ones)."""
    return exc.code if isinstance(exc, CapsuleRosError) else ErrorCode.INTERNAL


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (whitespace runs collapsed); an OSError that
    carries its path reads ``'PATH': cause`` (``'PATH' -> 'OTHER': cause`` for a rename)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        where = repr(os.fsdecode(exc.filename))
        if exc.filename2 is not None:
            where += f" -> {os.fsdecode(exc.filename2)!r}"
        return f"{where}: {exc.strerror}"
    return " ".join(str(exc).split()) or type(exc).__name__


def path_error(exc: OSError, what: str, path: Union[str, os.PathLike, None] = None) -> CapsuleRosError:
    """The typed error of a failed operation on a file or directory, in one line naming it
    and the cause in the system's words: ``{what} 'PATH': cause`` (``path``: the one to
    name, by default the error's own). ENOENT is NotFound; EACCES and EPERM (an immutable
    file) PermissionDenied; ENOSPC, EDQUOT and EFBIG (a file size limit)
    ResourceExhausted; any other CapsuleIOError."""
    name: Optional[str] = os.fsdecode(path) if path is not None else \
        os.fsdecode(exc.filename) if exc.filename is not None else None
    cause = exc.strerror or one_line(exc)
    text = f"{what} {name!r}: {cause}" if name is not None else f"{what}: {cause}"
    kind = {errno.ENOENT: NotFound, errno.EACCES: PermissionDenied, errno.EPERM: PermissionDenied,
            errno.ENOSPC: ResourceExhausted, errno.EDQUOT: ResourceExhausted,
            errno.EFBIG: ResourceExhausted}.get(exc.errno or 0, CapsuleIOError)
    return kind(text)
