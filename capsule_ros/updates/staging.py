"""``capsule-ros regenerate``'s directories: DST is written completely or not at all.

The regeneration builds DST in a hidden sibling named after the process
(``staging_dir``), fsyncs every file and the directory, and renames it to DST at the end
(onto an empty DST too: one rename, so DST is never absent or partial); a run killed at
any point (``kill -9`` included) leaves no DST, and the next run removes the dead run's
leftovers; a write that fails (a full disk) stops the run with an error naming DST, the
sibling removed. SRC is opened read-only and never written.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.errors import CapsuleIOError, CapsuleRosError, one_line
from capsule_ros.updates.deployment import Deployment
from capsule_ros.updates.errors import BadArguments
from capsule_ros.updates.regeneration import Progress, Regeneration, RegenerationReport


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def staging_dir(dst: Path) -> Path:
    """Where a regeneration into ``dst`` builds it: a hidden sibling named after this
    process (renamed to ``dst`` when complete). Leftovers of processes that died (a kill
    -9) are removed first."""
    prefix = f".{dst.name}.regenerating-"
    for stale in dst.parent.glob(prefix + "*"):
        pid = stale.name[len(prefix):]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return dst.parent / f"{prefix}{os.getpid()}"


def check_directories(src: Path, dst: Path) -> None:
    """BadArguments unless SRC is a directory and DST can be made: absent or an empty
    directory, outside SRC, with an existing parent."""
    if not src.is_dir():
        raise BadArguments(f"SRC {str(src)!r} is not a directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise BadArguments(f"DST {str(dst)!r} exists and is not an empty directory: it is written completely or not "
                           "at all, never merged into")
    if not dst.parent.is_dir():
        raise BadArguments(f"DST's parent {str(dst.parent)!r} is not a directory")
    src_real, dst_real = src.resolve(), dst.parent.resolve() / dst.name
    if dst_real == src_real or src_real in dst_real.parents:
        raise BadArguments(f"DST {str(dst)!r} is SRC or inside it: SRC is never written")


def regenerate_directory(src: Path, dst: Path, load: Callable[[], Deployment], *, max_drift: Optional[float] = None,
                         key_file: Optional[str] = None, progress: Optional[Progress] = None) -> RegenerationReport:
    """``capsule-ros regenerate``: every capsule of ``src`` kept, regenerated or skipped
    into ``dst`` (see the module docstring); ``src`` is opened read-only. ``load``: the
    deployment, built once the directories are known to be usable. Raises BadArguments
    and the typed errors of unreadable inputs."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    check_directories(src, dst)
    deployment = load()
    capsules = deployment.config.capsules
    key = capsules.key_file if key_file is None else key_file
    max_file_bytes = int(capsules.max_file_mb * 2**20)
    staging = staging_dir(dst.absolute())
    try:
        source = CapsuleDirectory(src, key_file=key, max_file_bytes=max_file_bytes, read_only=True)
        try:
            out = CapsuleDirectory(staging, key_file=key, chunk_bytes=int(capsules.chunk_mb * 2**20),
                                   max_file_bytes=max_file_bytes)
            regeneration = Regeneration(source, out, deployment, max_drift, progress)
            regeneration.run()
            _fsync_dir(staging)
            os.rename(staging, dst)                # onto an empty DST too: one atomic rename, DST never absent
        except (CapsuleRosError, OSError) as exc:
            raise CapsuleIOError(f"DST {str(dst)!r} was not written: {one_line(exc)}") from exc
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        deployment.close()
    return dataclasses.replace(regeneration.report(), out=str(dst))
