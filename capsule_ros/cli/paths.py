"""The command line's path arguments, checked before any work starts: a typed error
(``capsule_ros.errors.path_error``) that names the argument, the path and the cause in the
system's words, e.g. ``--params '/x/p.yaml': Is a directory``.

Inputs are opened (a file) or listed (a directory) here, so a missing path, a symlink
loop or a missing permission is found by the operation itself, never guessed from the
mode bits. An output's directory gets an empty entry made and removed at once, which
finds a read-only file system, an immutable directory and a missing permission before
a long computation; what only the write can tell (a full disk, a file size limit) is
reported by the write, and the command removes what it staged.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path
from typing import Optional, Tuple, Union

from capsule_ros.errors import path_error

PathArg = Union[str, os.PathLike]
FS_IOC_GETFLAGS = 0x80086601       # linux/fs.h: the inode flags chattr sets
FS_IMMUTABLE_FL, FS_APPEND_FL = 0x10, 0x20


def _fail(code: int, what: str, path: PathArg) -> None:
    raise path_error(OSError(code, os.strerror(code), os.fspath(path)), what)


def _stat(path: Path, what: str) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as exc:
        raise path_error(exc, what, path) from None


def input_file(path: PathArg, what: str) -> Path:
    """``path``, a file this process can open for reading (followed through symlinks; not
    a directory; opened without blocking, so a FIFO planted there cannot hang the command:
    what a file holds is for its reader to judge)."""
    path = Path(path).expanduser()
    if stat.S_ISDIR(_stat(path, what).st_mode):
        _fail(errno.EISDIR, what, path)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError as exc:
        raise path_error(exc, what, path) from None
    return path


def input_dir(path: PathArg, what: str) -> Path:
    """``path``, a directory this process can list."""
    path = Path(path).expanduser()
    if not stat.S_ISDIR(_stat(path, what).st_mode):
        _fail(errno.ENOTDIR, what, path)
    try:
        with os.scandir(path) as entries:
            next(entries, None)
    except OSError as exc:
        raise path_error(exc, what, path) from None
    return path


def _resolved(path: Path, what: str) -> Path:
    """``path`` with a symlink at it followed (a rename would replace the link itself);
    a symlink loop or a dangling link is refused."""
    if path.is_symlink():
        _stat(path, what)                       # ELOOP, or ENOENT for a dangling link
        return Path(os.path.realpath(path))
    return path


def _parent_dir(path: Path, what: str) -> None:
    """``path``'s directory exists and is one (the error names ``path``)."""
    try:
        st = os.stat(path.parent)
    except OSError as exc:
        raise path_error(exc, what, path) from None
    if not stat.S_ISDIR(st.st_mode):
        _fail(errno.ENOTDIR, what, path)


def probe_dir(directory: Path, what: str, path: Path) -> None:
    """An empty entry made in ``directory`` and removed at once: EACCES, EROFS or EPERM
    (immutable) now rather than after the work (the error names ``path``)."""
    try:
        probe = tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=directory)
    except OSError as exc:
        raise path_error(exc, what, path) from None
    os.rmdir(probe)


def output_file(path: PathArg, what: str) -> Path:
    """Where a command writes a file (staged beside it, renamed into place): not a
    directory, in a directory where an entry can be made; symlinks followed."""
    path = _resolved(Path(path).expanduser(), what)
    if path.exists() and path.is_dir():
        _fail(errno.EISDIR, what, path)
    _parent_dir(path, what)
    probe_dir(path.parent, what, path)
    return path


def _flags(path: Path) -> int:
    """The inode flags ``chattr`` sets (0 where the file system does not keep them)."""
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (ImportError, OSError):
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("i", 0)))[0]
    except OSError:
        return 0
    finally:
        os.close(fd)


def replaceable_dir(path: PathArg, what: str) -> Path:
    """Where a command puts a directory it built beside it, by one rename: absent, or an
    empty directory that a rename can replace (not a mount point, not immutable), in an
    existing directory; symlinks followed. Nothing is written here: ``probe_dir`` the
    parent once the caller knows where DST lies."""
    path = _resolved(Path(path).expanduser(), what)
    _parent_dir(path, what)
    if path.exists():
        if not path.is_dir():
            _fail(errno.ENOTDIR, what, path)
        if os.path.ismount(path):
            raise path_error(OSError(errno.EBUSY, f"{os.strerror(errno.EBUSY)} (a mount point: it cannot be "
                                                  "replaced)", str(path)), what)
        if _flags(path) & (FS_IMMUTABLE_FL | FS_APPEND_FL):
            raise path_error(OSError(errno.EPERM, f"{os.strerror(errno.EPERM)} (immutable: chattr -i it, or choose "
                                                  "another directory)", str(path)), what)
    return path


def run_dir(path: PathArg, what: str) -> Tuple[Path, Optional[Path]]:
    """A directory a command writes its outputs into, made (with its parents) when missing,
    where an entry can be made: (the directory, the topmost directory made here or None,
    so that a run refused before it wrote anything can remove what it made)."""
    path = _resolved(Path(path).expanduser(), what)
    made = None
    if path.exists():
        if not path.is_dir():
            _fail(errno.ENOTDIR, what, path)
    else:
        made = path
        while not made.parent.exists() and made.parent != made:
            made = made.parent
    try:
        if made is not None:
            path.mkdir(parents=True)
        probe_dir(path, what, path)
    except OSError as exc:
        if made is not None and made.is_dir():
            shutil.rmtree(made, ignore_errors=True)
        raise path_error(exc, what, path) from None
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    return path, made
