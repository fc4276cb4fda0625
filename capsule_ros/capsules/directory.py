"""The capsule directory: capsules on disk, one verified file per capsule id.

Guarantees (docs/capsule-format.md explains them and their limits):

- Atomic saves: a capsule is written to ``<id>.capsule.part`` (O_EXCL, mode 0600),
  fsynced, renamed to ``<id>.capsule`` and the directory fsynced. A ``*.capsule`` file
  is therefore always complete; a crash leaves at most a ``.part`` file, which the next
  ``CapsuleDirectory`` moves into ``quarantine/`` (listed in ``recovered``).
- Confinement: capsule ids are checked against the id alphabet (no separators, no
  leading dot, no ``..``), so a capsule's path sits directly in the root; files are read
  with O_NOFOLLOW, so a symbolic link planted there is refused, race-free.
- Privacy: the root (and quarantine) are mode 0700, files 0600; with a key file every
  capsule is encrypted and authenticated (AES-GCM), and unencrypted files are refused.

One process writes a directory at a time: recovery at construction treats every
``.part`` file as a crash leftover. Within the process, publishing a file (the rename)
and removing one are serialised by a lock, and a save can be told, right before its
rename, that its capsule was dropped meanwhile (``keep``): a drop that answered success
is never undone by a save that was still writing.
"""
from __future__ import annotations

import logging
import operator
import os
import stat
import threading
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple, Union

import torch

from capsule_ros.capsules.config import CapsuleStoreConfig
from capsule_ros.capsules.fileformat import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    BufferRecord,
    CapsuleHeader,
    load_kek,
    os_errors,
    read_capsule,
    read_header,
    read_recipe,
    write_capsule,
)
from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.capsules.recipe import Recipe, RecipeInfo
from capsule_ros.capsules.store import Capsule
from capsule_ros.errors import Busy, CorruptCapsule, InvalidArgument, NotFound, PermissionDenied
from capsule_ros.runtime.fingerprint import FingerprintParts

LOG = logging.getLogger(__name__)

SUFFIX = ".capsule"
PART_SUFFIX = ".capsule.part"
QUARANTINE = "quarantine"
DIR_MODE = 0o700
FILE_MODE = 0o600


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) if needed and make it 0700; returns it resolved."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    return path.resolve(strict=True)


class CapsuleDirectory:
    """Capsule files under one root directory (see the module docstring)."""

    def __init__(self, root: Union[Path, str], *, key_file: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 max_file_bytes: int, read_only: bool = False, recover: bool = True):
        """``read_only``: access an existing directory without changing it (a replay, a
        tool): nothing is created, chmod-ed or recovered, and save / remove are refused
        (PermissionDenied); a missing root simply holds no capsules. ``recover`` False:
        leave ``.part`` files where they are (a helper process writing into a directory
        that its node, the one writer that recovers it, has open)."""
        if type(chunk_bytes) is not int or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(f"chunk_bytes = {chunk_bytes!r}: must be an int in "
                                  f"[{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        if type(max_file_bytes) is not int or max_file_bytes < 1:
            raise InvalidArgument(f"max_file_bytes = {max_file_bytes!r}: must be a positive int")
        self.chunk_bytes = chunk_bytes
        self.max_file_bytes = max_file_bytes
        self._kek: Optional[bytes] = load_kek(Path(key_file).expanduser()) if key_file else None
        self._names = threading.Lock()        # publishing (rename) vs removing a capsule file
        self._checked_schemas: Set[Tuple[int, Tuple]] = set()   # (nbytes, schema) validated by a save
        self.read_only = read_only
        self.recovered: List[Path] = []
        if read_only:
            self.root = Path(root).expanduser().absolute()
            return
        with os_errors(root, "capsule directory"):
            self.root = _private_dir(Path(root).expanduser())
            self.recovered = self._quarantine_leftovers() if recover else []

    @classmethod
    def from_config(cls, config: CapsuleStoreConfig) -> CapsuleDirectory:
        """The directory a ``capsules`` config section names (which must not be '')."""
        if not config.directory:
            raise InvalidArgument("capsules.directory = '': no capsule directory is configured")
        return cls(config.directory, key_file=config.key_file, chunk_bytes=int(config.chunk_mb * 2**20),
                   max_file_bytes=int(config.max_file_mb * 2**20))

    @property
    def encrypted(self) -> bool:
        return self._kek is not None

    # -- paths ----------------------------------------------------------------------------------
    def path_of(self, capsule_id: str) -> Path:
        """``<root>/<id>.capsule``; refuses (InvalidArgument) malformed ids. The id alphabet
        has no separators, so the path is always directly in the root; a symbolic link
        planted there is refused when opened (files are read with O_NOFOLLOW)."""
        return self.root / (check_capsule_id(capsule_id) + SUFFIX)

    def exists(self, capsule_id: str) -> bool:
        """A regular capsule file (not a link, a directory...) is there."""
        try:
            return stat.S_ISREG(os.lstat(self.path_of(capsule_id)).st_mode)
        except FileNotFoundError:
            return False

    def ids(self) -> List[str]:
        """Ids of the complete capsule files, sorted (other files are ignored)."""
        if self.read_only and not self.root.is_dir():
            return []
        with os_errors(self.root, "capsule directory"):
            names = [entry.name for entry in os.scandir(self.root) if entry.is_file(follow_symlinks=False)]
        out = []
        for name in names:
            if name.endswith(SUFFIX):
                try:
                    out.append(check_capsule_id(name[:-len(SUFFIX)]))
                except InvalidArgument:
                    continue
        return sorted(out)

    # -- verbs --------------------------------------------------------------------------------
    def save(self, capsule: Capsule, data: Any, schema: Sequence[dict],
             keep: Callable[[], bool] = lambda: True, *, recipe: Union[None, Recipe, RecipeInfo] = None,
             parts: Optional[FingerprintParts] = None) -> Path:
        """Write a capsule atomically (see the module docstring); returns its path.

        ``data``: host uint8 tensor or bytes of ``capsule.nbytes``; ``schema``: the arena's
        ``ArenaLayout.schema()``. Saving an existing id replaces its file atomically.
        ``keep`` is asked under the directory's lock right before the file is published:
        False discards the written data (NotFound: the capsule was dropped meanwhile).
        ``recipe``: how the state was made (a ``Recipe``), or only why it is not kept (a cut
        ``RecipeInfo``), or None (the header has no recipe); ``parts``: the fingerprint's
        components (``FingerprintParts``).
        Raises InvalidArgument, Busy (a ``.part`` of that id exists), NotFound, CapsuleIOError.
        """
        self._require_writable("save")
        path = self.path_of(capsule.id)
        try:   # int-likes (numpy / torch scalars) become ints; the writer then validates strictly
            episode, step, stamp, nbytes = (operator.index(v) for v in (capsule.episode_id, capsule.step,
                                                                        capsule.stamp_ns, capsule.nbytes))
        except TypeError as exc:
            raise InvalidArgument(f"capsule {capsule.id!r}: episode, step, stamp and nbytes must be "
                                  f"integers ({exc})") from None
        if nbytes > self.max_file_bytes:
            raise InvalidArgument(f"capsule {capsule.id!r} is {nbytes} bytes: larger than "
                                  f"max_file_bytes = {self.max_file_bytes}, it could not be loaded back")
        info = recipe.info if isinstance(recipe, Recipe) else recipe
        header = CapsuleHeader(capsule.id, capsule.label, capsule.parent_id, episode, step, stamp, nbytes,
                               capsule.fingerprint, tuple(BufferRecord.of(e) for e in schema), self.chunk_bytes,
                               numerics=capsule.numerics, mark=capsule.mark, fingerprint_parts=parts,
                               recipe=info)
        recipe_data = recipe.to_bytes() if isinstance(recipe, Recipe) else b""
        part = path.with_name(capsule.id + PART_SUFFIX)
        with os_errors(part):
            try:
                fd = os.open(part, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
            except FileExistsError:
                raise Busy(f"{str(part)!r} exists: another save of {capsule.id!r} is in progress "
                           "(or a crash left it; the next start quarantines it)") from None
            try:
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), FILE_MODE)
                    checked = (header.nbytes, header.schema)
                    write_capsule(f, header, data, self._kek, schema_checked=checked in self._checked_schemas,
                                  recipe=recipe_data)
                    self._checked_schemas.add(checked)
                    f.flush()
                    os.fsync(f.fileno())
                with self._names:
                    if not keep():
                        raise NotFound(f"capsule {capsule.id!r} was dropped while it was being saved: "
                                       "nothing was written")
                    os.rename(part, path)
                    _fsync_dir(self.root)
            except BaseException:
                part.unlink(missing_ok=True)
                raise
        LOG.debug("saved capsule %s (%d bytes) to %s", capsule.id, capsule.nbytes, path)
        return path

    def load(self, capsule_id: str, *, expected_fingerprint: str,
             expected_schema: Optional[Sequence[dict]] = None) -> Tuple[Capsule, torch.Tensor]:
        """Read and verify a capsule file: its metadata (payload None, path set) and bytes.

        Raises NotFound, FingerprintMismatch, CorruptCapsule, PermissionDenied, CapsuleIOError.
        """
        path = self.path_of(capsule_id)
        header, data = read_capsule(path, kek=self._kek, max_bytes=self.max_file_bytes, follow=False,
                                    expected_fingerprint=expected_fingerprint, expected_schema=expected_schema)
        return self.capsule_of(header, path, capsule_id), data

    def header(self, capsule_id: str) -> CapsuleHeader:
        """The validated header of a capsule file (its chunks are not read)."""
        return read_header(self.path_of(capsule_id), max_bytes=self.max_file_bytes, follow=False)

    def recipe(self, capsule_id: str, max_recipe_bytes: int) -> Tuple[CapsuleHeader, Optional[Recipe]]:
        """A capsule file's header and its verified recipe (None: it has no regenerable one),
        read even when its state chunks are damaged or cut off (``read_recipe``).
        Raises NotFound, CorruptCapsule, PermissionDenied, CapsuleIOError."""
        path = self.path_of(capsule_id)
        header, data = read_recipe(path, kek=self._kek, max_bytes=self.max_file_bytes,
                                   max_recipe_bytes=max_recipe_bytes, follow=False)
        self.capsule_of(header, path, capsule_id)
        if data is None or header.recipe is None:
            return header, None
        return header, Recipe.from_bytes(header.recipe, data, f"capsule file {str(path)!r}: recipe")

    def describe(self, capsule_id: str) -> Capsule:
        """A capsule's metadata from its file's header (payload None, path set; chunks not read)."""
        path = self.path_of(capsule_id)
        return self.capsule_of(read_header(path, max_bytes=self.max_file_bytes, follow=False), path, capsule_id)

    @staticmethod
    def capsule_of(header: CapsuleHeader, path: Path, capsule_id: str) -> Capsule:
        """A capsule's metadata from its file's header (CorruptCapsule when the file holds another id)."""
        if header.capsule_id != capsule_id:
            raise CorruptCapsule(f"capsule file {str(path)!r} holds capsule {header.capsule_id!r}, not {capsule_id!r}")
        return Capsule(header.capsule_id, header.label, header.parent_id, header.episode_id, header.step,
                       header.nbytes, header.fingerprint, header.stamp_ns, pinned=False, payload=None,
                       path=str(path), numerics=header.numerics, mark=header.mark, recipe=header.recipe)

    def remove(self, capsule_id: str) -> None:
        """Delete a capsule file (NotFound if there is none)."""
        self._require_writable("remove")
        path = self.path_of(capsule_id)
        with os_errors(path), self._names:
            path.unlink()
            _fsync_dir(self.root)

    def _require_writable(self, verb: str) -> None:
        if self.read_only:
            raise PermissionDenied(f"capsule directory {str(self.root)!r} is opened read-only: cannot {verb}")

    # -- recovery -------------------------------------------------------------------------------
    def _quarantine_leftovers(self) -> List[Path]:
        """Move crash leftovers (``*.part``) into ``quarantine/``; returns their new paths."""
        parts = sorted(p for p in self.root.iterdir() if p.name.endswith(".part") and not p.is_dir())
        if not parts:
            return []
        quarantine = _private_dir(self.root / QUARANTINE)
        moved = []
        for part in parts:
            target = quarantine / part.name
            serial = 0
            while target.exists():
                serial += 1
                target = quarantine / f"{part.name}.{serial}"
            os.rename(part, target)
            moved.append(target)
            LOG.warning("capsule directory %s: moved the unfinished save %s to %s", self.root, part.name, target)
        _fsync_dir(quarantine)
        _fsync_dir(self.root)
        return moved
