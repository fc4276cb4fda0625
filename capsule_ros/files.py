"""Writing a file completely or not at all: the bytes go to a hidden file beside it, are
fsynced, and are renamed into place. A failed write (a full disk, a file size limit, a
read-only file system) removes the hidden file and raises the typed error
(``capsule_ros.errors.path_error``) naming the file and the cause, so a reader never sees
half a file and nothing half-written is left behind."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Union

from capsule_ros.errors import path_error


def write_file(path: Union[str, os.PathLike], data: Union[bytes, str]) -> None:
    """``data`` (text as UTF-8) into ``path``, atomically (see the module docstring)."""
    path = Path(path)
    staged = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with open(staged, "xb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            staged.unlink()
        raise path_error(exc, "cannot write", path) from None
