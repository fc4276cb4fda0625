"""The on-disk capsule format: a verified (optionally encrypted) copy of one arena.

Layout (all integers little-endian; docs/capsule-format.md has the byte-by-byte table)::

    magic     8 bytes  b"CAPSULE\\0"
    version   u16      FORMAT_VERSION (2; files of version 1 still load)
    flags     u16      bit 0 = encrypted; other bits must be 0
    json_len  u32      2 .. MAX_HEADER_JSON
    header    json_len bytes of canonical JSON (sorted keys, no spaces, ASCII)
    digest    32 bytes SHA-256(magic .. header): header integrity
    the recipe section (version 2, when the header has a regenerable recipe), then the
    state section; each is chunks 0 .. n-1, each chunk followed by its tag:
      plain:     chunk bytes, then SHA-256(A || chunk)
      encrypted: AES-GCM(data key, nonce = u64 index || u32 section, AAD = A) ciphertext,
                 then its 16-byte tag
    with A = digest || u8 section || u64 index || u8 last (version 1: digest || u64 index
    || u8 last, one section), section 0 = the state, 1 = the recipe.

Every byte of the file is covered by the header digest or a chunk tag, the section, index
and last-chunk flag in each tag catch dropped, duplicated, reordered chunks and chunks moved
between sections, and the file size is exactly determined by the header (trailing bytes and
truncation are refused before the payload is read). The header is parsed and fully
validated (types, counts, buffer bounds, sizes) before anything of the payload's size is
allocated.

The recipe section (``capsule_ros.capsules.recipe``) comes first so that a file whose
state chunks are damaged or cut off still yields its verified recipe (``read_recipe``):
what the recompute fallback rebuilds the state from. Restoring a capsule skips it.

Encryption: each capsule gets a random 32-byte data key, wrapped with AES-GCM by the
key-encryption key (KEK) under a random nonce with AAD binding the capsule id and
fingerprint. Chunk nonces are the chunk index: the data key is fresh per capsule, so a
(key, nonce) pair never repeats. The chunk AAD binds the header digest, so any change to
the header of an encrypted file fails every chunk's tag.

No pickle and no torch.load: the payload is raw bytes, the header is JSON.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import json
import os
import re
import stat
import struct
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:
    import torch

from capsule_ros.capsules.headerfields import (
    U64 as _U64,
    ErrorType,
    check_keys,
    get_hex,
    get_int,
    get_str,
    get_typed,
    quote,
)
from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.capsules.recipe import RecipeInfo
from capsule_ros.errors import (
    CapsuleIOError,
    CapsuleRosError,
    CorruptCapsule,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from capsule_ros.runtime.fingerprint import FingerprintParts
from capsule_ros.runtime.marks import ModeMark
from capsule_ros.runtime.schema import ALIGNMENT, DTYPE_SIZES, BufferKind

MAGIC = b"CAPSULE\x00"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
STATE_SECTION = 0
RECIPE_SECTION = 1
FLAG_ENCRYPTED = 0x0001
PREFIX = struct.Struct("<8sHHI")          # magic, version, flags, json_len: 16 bytes
DIGEST_BYTES = 32                         # SHA-256
GCM_TAG_BYTES = 16
KEY_BYTES = 32                            # AES-256 data key and KEK
NONCE_BYTES = 12
SALT_BYTES = 16
WRAPPED_KEY_BYTES = KEY_BYTES + GCM_TAG_BYTES

MAX_HEADER_JSON = 1 << 20                 # 1 MiB of header JSON at most
MAX_BUFFERS = 4096
MAX_NAME_CHARS = 256
MAX_LABEL_CHARS = 4096
MAX_DIMS = 16
MIN_CHUNK_BYTES = 256
MAX_CHUNK_BYTES = 64 << 20                # far below AESGCM's 2^31-1 bytes per call (GCM itself: 2^36-32)
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_PAYLOAD_BYTES = 1 << 48               # what the writer accepts; readers pass their own max_bytes

_WRAP_AAD_PREFIX = b"capsule-ros/v1/data-key\x00"
_BUFFER_KEYS = ("name", "shape", "dtype", "kind", "offset", "nbytes")
_OPTIONAL_KEYS = ("numerics", "chunk")    # written when set; files from before them read as ""  / None
# (the header's ``mark`` is stored under the key "chunk": its name from when chunking was the only mode)
_V2_KEYS = ("fingerprint_parts", "recipe")     # version 2 only, each written when set
MAX_NUMERICS_CHARS = 32
_KINDS = frozenset(k.value for k in BufferKind)

PathLike = Union[str, os.PathLike]


# -- header ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BufferRecord:
    """One buffer of the arena schema as stored in a capsule header."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    kind: str
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "kind": self.kind,
                "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def of(cls, entry: Union[BufferRecord, Mapping[str, Any]]) -> BufferRecord:
        """A record from itself or from a mapping such as ``ArenaLayout.schema()`` yields
        (types are checked later, by the header validation)."""
        if isinstance(entry, BufferRecord):
            return entry
        try:
            values = {k: entry[k] for k in _BUFFER_KEYS}
            values["shape"] = tuple(values["shape"])
        except (KeyError, TypeError) as exc:
            raise InvalidArgument(f"schema entry {quote(entry)}: needs keys {list(_BUFFER_KEYS)} "
                                  f"({exc!r})") from None
        return cls(**values)


@dataclass(frozen=True)
class CapsuleHeader:
    """Everything a capsule file says about itself (the JSON header).

    ``write_capsule`` sets ``salt`` (16 random bytes per file, so that no two files share a
    header digest and chunks of one never verify in another, even when their metadata are
    equal) and, when it encrypts, ``wrapped_key`` / ``key_nonce`` (empty for a plain
    capsule), whatever the caller passed.
    """

    capsule_id: str
    label: str
    parent_id: str
    episode_id: int
    step: int
    stamp_ns: int
    nbytes: int
    fingerprint: str
    schema: Tuple[BufferRecord, ...]
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    salt: bytes = field(default=b"", repr=False)
    wrapped_key: bytes = field(default=b"", repr=False)
    key_nonce: bytes = field(default=b"", repr=False)
    numerics: str = ""          # CPU numerics level it was made at (runtime/numerics.py); '' = not recorded
    mark: Optional[ModeMark] = None       # the runtime's mode mark (key "chunk"; absent when it had none)
    fingerprint_parts: Optional[FingerprintParts] = None   # version 2: the fingerprint's components
    recipe: Optional[RecipeInfo] = None   # version 2: how the state was made (absent: no recipe kept)
    version: int = FORMAT_VERSION         # of the file it was read from (not a header key: the prefix's)

    def __post_init__(self) -> None:
        if not isinstance(self.schema, (list, tuple)):
            raise InvalidArgument(f"schema {quote(self.schema)}: must be a list of buffers")
        object.__setattr__(self, "schema", tuple(BufferRecord.of(e) for e in self.schema))

    @property
    def encrypted(self) -> bool:
        return bool(self.wrapped_key)

    @property
    def chunk_count(self) -> int:
        """ceil(nbytes / chunk_bytes); 0 for values the validation will refuse anyway."""
        try:
            return -(-self.nbytes // self.chunk_bytes)
        except (TypeError, ZeroDivisionError):
            return 0

    @property
    def tag_bytes(self) -> int:
        return GCM_TAG_BYTES if self.encrypted else DIGEST_BYTES

    @property
    def recipe_bytes(self) -> int:
        """Bytes of the recipe's binary part (0: none stored)."""
        return self.recipe.nbytes if self.recipe is not None else 0

    @property
    def recipe_chunk_count(self) -> int:
        return -(-self.recipe_bytes // self.chunk_bytes) if self.chunk_bytes > 0 else 0

    def section(self, section: int) -> Tuple[int, int]:
        """(bytes, chunks) of a section."""
        if section == RECIPE_SECTION:
            return self.recipe_bytes, self.recipe_chunk_count
        return self.nbytes, self.chunk_count

    def section_file_bytes(self, section: int) -> int:
        """Bytes a section takes in the file (its chunks and their tags)."""
        nbytes, chunks = self.section(section)
        return nbytes + chunks * self.tag_bytes

    def schema_dicts(self) -> List[dict]:
        """The schema as ``ArenaLayout.schema()`` writes it."""
        return [b.to_json() for b in self.schema]

    def to_json(self) -> dict:
        """The header object exactly as stored (bytes as hex)."""
        out = {"capsule_id": self.capsule_id, "label": self.label, "parent_id": self.parent_id,
               "episode_id": self.episode_id, "step": self.step, "stamp_ns": self.stamp_ns,
               "nbytes": self.nbytes, "fingerprint": self.fingerprint, "schema": self.schema_dicts(),
               "chunk_bytes": self.chunk_bytes, "chunk_count": self.chunk_count, "salt": self.salt.hex()}
        if self.encrypted:
            out["wrapped_key"] = self.wrapped_key.hex()
            out["key_nonce"] = self.key_nonce.hex()
        if self.numerics:
            out["numerics"] = self.numerics
        if self.mark is not None:
            out["chunk"] = self.mark.to_json()
        if self.fingerprint_parts is not None:
            out["fingerprint_parts"] = self.fingerprint_parts.to_json()
        if self.recipe is not None:
            out["recipe"] = self.recipe.to_json()
        return out

    def file_bytes(self) -> int:
        """The exact size of the file holding this header."""
        return file_size_for(self, len(canonical_json(self.to_json())))


def canonical_json(obj: Mapping[str, Any]) -> bytes:
    """The one byte encoding of a header object (the reader refuses any other)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def file_size_for(header: CapsuleHeader, json_len: int) -> int:
    return (PREFIX.size + json_len + DIGEST_BYTES + header.section_file_bytes(RECIPE_SECTION)
            + header.section_file_bytes(STATE_SECTION))


def _parse_buffer(obj: Any, index: int, error: ErrorType) -> BufferRecord:
    where = f"schema[{index}]."
    check_keys(obj, _BUFFER_KEYS, error, where)
    name = get_str(obj, "name", MAX_NAME_CHARS, error, where)
    if not name or not name.isprintable() or any(c in name for c in "/\\\0 "):
        raise error(f"{where}name = {quote(name)}: must be a plain, printable, non-empty name")
    shape = get_typed(obj, "shape", list, error, where)
    if len(shape) > MAX_DIMS or any(type(d) is not int or not 1 <= d < _U64 for d in shape):
        raise error(f"{where}shape = {quote(shape)}: at most {MAX_DIMS} positive integer dims")
    dtype = get_str(obj, "dtype", 32, error, where)
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is None:
        raise error(f"{where}dtype = {quote(dtype)}: must be one of {sorted(DTYPE_SIZES)}")
    kind = get_str(obj, "kind", 32, error, where)
    if kind not in _KINDS:
        raise error(f"{where}kind = {quote(kind)}: must be one of {sorted(_KINDS)}")
    offset = get_int(obj, "offset", 0, MAX_PAYLOAD_BYTES, error, where)
    if offset % ALIGNMENT:
        raise error(f"{where}offset = {offset}: must be a multiple of {ALIGNMENT}")
    nbytes = get_int(obj, "nbytes", 1, MAX_PAYLOAD_BYTES, error, where)
    elements = 1
    for d in shape:
        elements *= d
    if nbytes != elements * itemsize:
        raise error(f"{where}nbytes = {nbytes}: shape {shape} of {dtype} is {elements * itemsize} bytes")
    return BufferRecord(name, tuple(shape), dtype, kind, offset, nbytes)


def parse_header(obj: Any, *, encrypted: bool, max_bytes: int, error: ErrorType = CorruptCapsule,
                 version: int = FORMAT_VERSION) -> CapsuleHeader:
    """Validate a header object completely and build the header.

    ``error`` is CorruptCapsule for a file being read and InvalidArgument for a header a
    caller asks us to write: one validator for both directions. ``version``: the file's
    format version (a version 1 header has no fingerprint parts and no recipe).
    """
    optional = _OPTIONAL_KEYS + (_V2_KEYS if version >= 2 else ())
    keys = [f.name for f in fields(CapsuleHeader)
            if f.name not in ("wrapped_key", "key_nonce", "version", "mark", *_OPTIONAL_KEYS, *_V2_KEYS)]
    keys += ["chunk_count"] + (["wrapped_key", "key_nonce"] if encrypted else [])
    keys += [k for k in optional if isinstance(obj, dict) and k in obj]
    check_keys(obj, keys, error, "header ")
    capsule_id = get_typed(obj, "capsule_id", str, error, "")
    parent_id = get_typed(obj, "parent_id", str, error, "")
    try:
        check_capsule_id(capsule_id)
        if parent_id:
            check_capsule_id(parent_id)
    except InvalidArgument as exc:
        raise error(str(exc)) from None
    label = get_str(obj, "label", MAX_LABEL_CHARS, error)
    episode_id = get_int(obj, "episode_id", 0, _U64 - 1, error)
    step = get_int(obj, "step", 0, _U64 - 1, error)
    stamp_ns = get_int(obj, "stamp_ns", 0, _U64 - 1, error)
    nbytes = get_int(obj, "nbytes", 1, max_bytes, error)
    fingerprint = get_str(obj, "fingerprint", 64, error)
    if len(fingerprint) != 64 or any(c not in "0123456789abcdef" for c in fingerprint):
        raise error(f"fingerprint = {quote(fingerprint)}: must be 64 lowercase hex digits")
    chunk_bytes = get_int(obj, "chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES, error)
    chunk_count = get_int(obj, "chunk_count", 1, _U64 - 1, error)
    if chunk_count != -(-nbytes // chunk_bytes):
        raise error(f"chunk_count = {chunk_count}: {nbytes} bytes in chunks of {chunk_bytes} "
                    f"make {-(-nbytes // chunk_bytes)}")
    entries = get_typed(obj, "schema", list, error, "")
    if len(entries) > MAX_BUFFERS:
        raise error(f"schema has {len(entries)} buffers: at most {MAX_BUFFERS}")
    schema, names, end = [], set(), 0
    for index, entry in enumerate(entries):
        record = _parse_buffer(entry, index, error)
        if record.name in names:
            raise error(f"schema[{index}].name = {quote(record.name)}: duplicate buffer name")
        if record.offset < end or record.offset + record.nbytes > nbytes:
            raise error(f"schema[{index}] {record.name!r} at [{record.offset}, {record.offset + record.nbytes}): "
                        f"overlaps the previous buffer (ends at {end}) or exceeds the {nbytes}-byte arena")
        names.add(record.name)
        end = record.offset + record.nbytes
        schema.append(record)
    salt = get_hex(obj, "salt", SALT_BYTES, error)
    wrapped_key = get_hex(obj, "wrapped_key", WRAPPED_KEY_BYTES, error) if encrypted else b""
    key_nonce = get_hex(obj, "key_nonce", NONCE_BYTES, error) if encrypted else b""
    numerics = get_str(obj, "numerics", MAX_NUMERICS_CHARS, error) if "numerics" in obj else ""
    if "numerics" in obj and not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", numerics):
        raise error(f"numerics = {quote(numerics)}: must be a level name such as 'avx2' or 'native-avx512'")
    mark = ModeMark.from_json(obj["chunk"], "", error) if "chunk" in obj else None
    parts = FingerprintParts.from_json(obj["fingerprint_parts"], error) if "fingerprint_parts" in obj else None
    recipe = RecipeInfo.from_json(obj["recipe"], error, step=step) if "recipe" in obj else None
    return CapsuleHeader(capsule_id, label, parent_id, episode_id, step, stamp_ns, nbytes, fingerprint,
                         tuple(schema), chunk_bytes, salt, wrapped_key, key_nonce, numerics, mark, parts, recipe,
                         version)


# -- keys and tags ---------------------------------------------------------------------------------
def _aead():
    """(AESGCM, InvalidTag) from `cryptography`, imported on first use: plain capsules work
    where it is not installed (e.g. a GPU machine with only the core dependencies)."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:
        raise InvalidArgument(f"encrypted capsules need the `cryptography` package ({exc})") from None
    return AESGCM, InvalidTag


def _check_key(key: Any, what: str = "key-encryption key") -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        size = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise InvalidArgument(f"{what}: {size} bytes, must be exactly {KEY_BYTES} raw bytes")
    return bytes(key)


def _wrap_aad(header: CapsuleHeader) -> bytes:
    return _WRAP_AAD_PREFIX + header.capsule_id.encode() + b"\x00" + header.fingerprint.encode()


def _chunk_aad(digest: bytes, section: int, index: int, last: bool, version: int) -> bytes:
    """A chunk's additional data: the header digest, its section (version 2), index and
    last flag, so a chunk verifies only in its place in its own file."""
    if version == 1:
        return digest + struct.pack("<QB", index, 1 if last else 0)
    return digest + struct.pack("<BQB", section, index, 1 if last else 0)


def _chunk_nonce(section: int, index: int) -> bytes:
    """u64 index || u32 section (section 0: the nonce of a version 1 file's chunk)."""
    return struct.pack("<QI", index, section)


def _plain_tag(aad: bytes, chunk: memoryview) -> bytes:
    h = hashlib.sha256(aad)
    h.update(chunk)
    return h.digest()


def _byte_view(payload: Any) -> memoryview:
    """A flat byte view of bytes-like data or a host uint8 tensor, without copying."""
    if type(payload).__module__.startswith("torch"):          # a tensor (torch is imported by its owner)
        if str(payload.dtype) != "torch.uint8" or payload.device.type != "cpu":
            raise InvalidArgument(f"payload tensor is {payload.dtype} on {payload.device}: must be host uint8")
        payload = payload.detach().contiguous().reshape(-1).numpy()
    try:
        return memoryview(payload).cast("B")
    except TypeError as exc:
        raise InvalidArgument(f"payload of type {type(payload).__name__}: must be bytes-like "
                              f"or a host uint8 tensor ({exc})") from None


# -- writing ---------------------------------------------------------------------------------------
def _write_all(fileobj: BinaryIO, data: Union[bytes, memoryview]) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        n = fileobj.write(view[done:])
        if not n:
            raise CapsuleIOError(f"short write to {getattr(fileobj, 'name', fileobj)!r}")
        done += n


def write_capsule(fileobj: BinaryIO, header: CapsuleHeader, payload: Any, kek: Optional[bytes], *,
                  schema_checked: bool = False, recipe: Any = b"") -> None:
    """Write one capsule (format ``FORMAT_VERSION``) to a binary file object; encrypted iff
    ``kek`` is given.

    The header is validated as strictly as a reader would (InvalidArgument otherwise), and
    ``payload`` (bytes-like or host uint8 tensor) must hold exactly ``header.nbytes`` bytes,
    ``recipe`` exactly ``header.recipe.nbytes`` (the binary part of a regenerable recipe,
    ``Recipe.to_bytes``; nothing otherwise).
    ``schema_checked``: the caller already validated this exact schema for this size (the
    capsule directory does it once per layout: it is most of the validation's cost).
    The caller owns durability (fsync, rename): see ``CapsuleDirectory.save``.
    """
    plain = replace(header, salt=os.urandom(SALT_BYTES), wrapped_key=b"", key_nonce=b"", version=FORMAT_VERSION)
    fields_only = plain.to_json()
    if schema_checked:
        fields_only["schema"] = []
    header = parse_header(fields_only, encrypted=False, max_bytes=MAX_PAYLOAD_BYTES, error=InvalidArgument)
    if schema_checked:
        header = replace(header, schema=plain.schema)
    data = _byte_view(payload)
    if len(data) != header.nbytes:
        raise InvalidArgument(f"payload of capsule {header.capsule_id!r} is {len(data)} bytes; "
                              f"its header says {header.nbytes}")
    recipe_data = _byte_view(recipe)
    if len(recipe_data) != header.recipe_bytes:
        raise InvalidArgument(f"recipe of capsule {header.capsule_id!r} is {len(recipe_data)} bytes; "
                              f"its header says {header.recipe_bytes}")
    aead = None
    if kek is not None:
        data_key, key_nonce = os.urandom(KEY_BYTES), os.urandom(NONCE_BYTES)
        AESGCM, _ = _aead()
        wrapped = AESGCM(_check_key(kek)).encrypt(key_nonce, data_key, _wrap_aad(header))
        header = replace(header, wrapped_key=wrapped, key_nonce=key_nonce)
        aead = AESGCM(data_key)
    body = canonical_json(header.to_json())
    if len(body) > MAX_HEADER_JSON:
        raise InvalidArgument(f"header of capsule {header.capsule_id!r} is {len(body)} bytes of JSON: "
                              f"at most {MAX_HEADER_JSON} (schema too large?)")
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_ENCRYPTED if aead else 0, len(body)) + body
    digest = hashlib.sha256(prefix).digest()
    _write_all(fileobj, prefix + digest)
    for section, section_data in ((RECIPE_SECTION, recipe_data), (STATE_SECTION, data)):
        count = header.section(section)[1]
        for index in range(count):
            chunk = section_data[index * header.chunk_bytes:(index + 1) * header.chunk_bytes]
            aad = _chunk_aad(digest, section, index, index == count - 1, FORMAT_VERSION)
            if aead is not None:
                _write_all(fileobj, aead.encrypt(_chunk_nonce(section, index), chunk, aad))
            else:
                _write_all(fileobj, chunk)
                _write_all(fileobj, _plain_tag(aad, chunk))


# -- reading ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def os_errors(path: PathLike, what: str = "capsule file") -> Iterator[None]:
    """Turn OS errors into typed errors that name the file."""
    try:
        yield
    except CapsuleRosError:
        raise
    except FileNotFoundError:
        raise NotFound(f"no {what} {str(path)!r}") from None
    except PermissionError as exc:
        raise PermissionDenied(f"{what} {str(path)!r}: {exc.strerror}") from None
    except OSError as exc:
        raise CapsuleIOError(f"{what} {str(path)!r}: {exc.strerror or exc}") from None


def _open_regular(path: PathLike, what: str, error: ErrorType, follow: bool = True) -> Tuple[io.FileIO, os.stat_result]:
    """Open a regular file for reading (O_NONBLOCK: a FIFO planted there cannot hang us);
    anything else raises ``error``. ``follow=False`` refuses a symbolic link at ``path``
    (checked by the open itself: no window between a check and the open)."""
    with os_errors(path, what):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
        except OSError as exc:
            if exc.errno == errno.ELOOP and not follow:
                raise error(f"{what} {str(path)!r} is a symbolic link: it must be a regular file") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):     # checked on the descriptor: no race with a rename
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise error(f"{what} {str(path)!r} is {kind}")
            return os.fdopen(fd, "rb", buffering=0), st
        except BaseException:
            os.close(fd)
            raise


def _read_into(f: io.FileIO, view: memoryview, path: PathLike, what: str) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CorruptCapsule(f"capsule file {str(path)!r} is truncated in {what}")
        done += n


def _read(f: io.FileIO, n: int, path: PathLike, what: str) -> bytes:
    buf = bytearray(n)
    _read_into(f, memoryview(buf), path, what)
    return bytes(buf)


def _read_header(f: io.FileIO, size: int, path: PathLike, max_bytes: int,
                 short_state: bool = False) -> Tuple[CapsuleHeader, bytes]:
    """Read, check and validate the header; returns it and its digest. ``short_state``:
    accept a file cut off inside its state section (``read_recipe`` reads only the recipe)."""
    where = f"capsule file {str(path)!r}"
    if size < PREFIX.size + 2 + DIGEST_BYTES:
        raise CorruptCapsule(f"{where} is {size} bytes: too short for a capsule (truncated?)")
    prefix = _read(f, PREFIX.size, path, "the prefix")
    magic, version, flags, json_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptCapsule(f"{where}: magic {magic!r} is not {MAGIC!r}: not a capsule file")
    if version not in READABLE_VERSIONS:
        raise CorruptCapsule(f"{where}: format version {version} (this reader knows {list(READABLE_VERSIONS)})")
    if flags & ~FLAG_ENCRYPTED:
        raise CorruptCapsule(f"{where}: unknown flags {flags:#06x}")
    if not 2 <= json_len <= MAX_HEADER_JSON:
        raise CorruptCapsule(f"{where}: header length {json_len}: must be in [2, {MAX_HEADER_JSON}]")
    if size < PREFIX.size + json_len + DIGEST_BYTES:
        raise CorruptCapsule(f"{where} is {size} bytes: truncated inside its {json_len}-byte header")
    body = _read(f, json_len, path, "the header")
    stored = _read(f, DIGEST_BYTES, path, "the header digest")
    digest = hashlib.sha256(prefix + body).digest()
    if not hmac.compare_digest(digest, stored):
        raise CorruptCapsule(f"{where}: header checksum mismatch (corrupted header)")
    try:
        obj = json.loads(body.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCapsule(f"{where}: header is not valid JSON ({quote(str(exc))})") from None
    try:
        header = parse_header(obj, encrypted=bool(flags & FLAG_ENCRYPTED), max_bytes=max_bytes, version=version)
    except CorruptCapsule as exc:
        raise CorruptCapsule(f"{where}: {exc}") from None
    if canonical_json(header.to_json()) != body:
        raise CorruptCapsule(f"{where}: header JSON is not in canonical form")
    expected = file_size_for(header, json_len)
    recipe_end = PREFIX.size + json_len + DIGEST_BYTES + header.section_file_bytes(RECIPE_SECTION)
    if size != expected and not (short_state and recipe_end <= size < expected):
        raise CorruptCapsule(f"{where} is {size} bytes; its header implies {expected} "
                             f"({'truncated' if size < expected else 'trailing bytes'})")
    return header, digest


@contextlib.contextmanager
def _opened(path: PathLike, max_bytes: int, follow: bool = True,
            short_state: bool = False) -> Iterator[Tuple[io.FileIO, CapsuleHeader, bytes]]:
    f, st = _open_regular(path, "capsule file", CorruptCapsule, follow)
    with f, os_errors(path):
        header, digest = _read_header(f, st.st_size, path, max_bytes, short_state)
        yield f, header, digest


def _data_cipher(header: CapsuleHeader, kek: Optional[bytes], path: PathLike) -> Optional[Any]:
    """The chunk cipher of an encrypted capsule (None for a plain one)."""
    where = f"capsule file {str(path)!r}"
    if not header.encrypted:
        if kek is not None:
            raise CorruptCapsule(f"{where} is not encrypted but a key is configured: "
                                 "refusing an unauthenticated capsule")
        return None
    if kek is None:
        raise PermissionDenied(f"{where} is encrypted: a key file is needed to read it")
    AESGCM, InvalidTag = _aead()
    try:
        data_key = AESGCM(_check_key(kek)).decrypt(header.key_nonce, header.wrapped_key, _wrap_aad(header))
    except InvalidTag:
        raise CorruptCapsule(f"{where}: wrong key or corrupted (the data key does not unwrap)") from None
    return AESGCM(data_key)


def _verified_chunks(f: io.FileIO, header: CapsuleHeader, digest: bytes, cipher: Optional[Any], path: PathLike,
                     section: int = STATE_SECTION) -> Iterator[Tuple[int, memoryview]]:
    """Yield (offset in the section, verified plaintext) per chunk of one section (the file
    positioned at its start), streaming with one record buffer; ``cipher``: ``_data_cipher``'s."""
    invalid_tag = _aead()[1] if cipher is not None else Exception
    tag_bytes = header.tag_bytes
    nbytes, count = header.section(section)
    name = "recipe chunk" if section == RECIPE_SECTION else "chunk"
    record = memoryview(bytearray(min(header.chunk_bytes, nbytes) + tag_bytes))
    for index in range(count):
        start = index * header.chunk_bytes
        n = min(header.chunk_bytes, nbytes - start)
        view = record[:n + tag_bytes]
        _read_into(f, view, path, f"{name} {index}")
        aad = _chunk_aad(digest, section, index, index == count - 1, header.version)
        if cipher is not None:
            try:
                plain = memoryview(cipher.decrypt(_chunk_nonce(section, index), view, aad))
            except invalid_tag:
                raise CorruptCapsule(f"capsule file {str(path)!r}: {name} {index} of {count}: "
                                     "wrong key or corrupted (AES-GCM tag mismatch)") from None
        else:
            plain = view[:n]
            if not hmac.compare_digest(_plain_tag(aad, plain), view[n:]):
                raise CorruptCapsule(f"capsule file {str(path)!r}: {name} {index} of {count}: checksum mismatch")
        yield start, plain


def _end_of_file(f: io.FileIO, path: PathLike) -> None:
    if f.read(1):
        raise CorruptCapsule(f"capsule file {str(path)!r}: trailing bytes after the last chunk")


def _check_expected(header: CapsuleHeader, fingerprint: Optional[str],
                    schema: Optional[Sequence[Mapping[str, Any]]]) -> None:
    if fingerprint is not None and header.fingerprint != fingerprint:
        kernel = f"kernel {header.fingerprint_parts.kernel}, " if header.fingerprint_parts is not None else ""
        raise FingerprintMismatch(
            f"capsule {header.capsule_id!r} was made by graph {header.fingerprint[:12]} ({kernel}{header.nbytes} "
            f"bytes); this runtime is {str(fingerprint)[:12]}")
    if schema is None:
        return
    expected = tuple(BufferRecord.of(e) for e in schema)
    if expected != header.schema:
        pairs = enumerate(zip(header.schema, expected, strict=False))
        diff = next((f"buffer {i}: {a} != {b}" for i, (a, b) in pairs if a != b),
                    f"{len(header.schema)} buffers, expected {len(expected)}")
        raise FingerprintMismatch(f"capsule {header.capsule_id!r}: schema differs from this runtime's ({diff})")


def read_header(path: PathLike, *, max_bytes: int, follow: bool = True) -> CapsuleHeader:
    """The validated header of a capsule file (its chunks are not read).

    For a plain file the header is checked by its SHA-256; for an encrypted one it is
    authenticated only when the chunks are (their AAD binds the header digest).
    Raises NotFound, CorruptCapsule, CapsuleIOError, PermissionDenied.
    """
    with _opened(path, max_bytes, follow) as (_, header, _digest):
        return header


def read_capsule(path: PathLike, *, kek: Optional[bytes] = None, max_bytes: int,
                 expected_fingerprint: Optional[str] = None,
                 expected_schema: Optional[Sequence[Mapping[str, Any]]] = None,
                 follow: bool = True) -> Tuple[CapsuleHeader, torch.Tensor]:
    """Read and verify a whole capsule; returns its header and payload (host uint8 tensor).

    The payload is allocated only after the header validated, matched the expected
    fingerprint / schema (FingerprintMismatch otherwise) and the file size. ``max_bytes``
    bounds the payload size; ``follow=False`` refuses a symbolic link (CorruptCapsule).
    Raises NotFound, CorruptCapsule (any damage, or wrong key),
    FingerprintMismatch, PermissionDenied (encrypted, no key), CapsuleIOError.
    """
    with _opened(path, max_bytes, follow) as (f, header, digest):
        _check_expected(header, expected_fingerprint, expected_schema)
        cipher = _data_cipher(header, kek, path)
        out = bytearray(header.nbytes)
        f.seek(header.section_file_bytes(RECIPE_SECTION), io.SEEK_CUR)     # the state needs no recipe
        for start, plain in _verified_chunks(f, header, digest, cipher, path):
            out[start:start + len(plain)] = plain
        _end_of_file(f, path)
    import torch  # here, not at module level: `capsule-ros inspect` needs no tensors
    return header, torch.frombuffer(out, dtype=torch.uint8)


def verify_capsule(path: PathLike, *, kek: Optional[bytes] = None, max_bytes: int) -> CapsuleHeader:
    """Verify every byte of a capsule file (its recipe too), streaming (memory: one chunk);
    returns its header."""
    with _opened(path, max_bytes) as (f, header, digest):
        cipher = _data_cipher(header, kek, path)
        for section in (RECIPE_SECTION, STATE_SECTION):
            for _ in _verified_chunks(f, header, digest, cipher, path, section):
                pass
        _end_of_file(f, path)
    return header


def read_recipe(path: PathLike, *, kek: Optional[bytes] = None, max_bytes: int, max_recipe_bytes: int,
                follow: bool = True) -> Tuple[CapsuleHeader, Optional[bytearray]]:
    """A capsule's header and the verified binary part of its recipe (None when the file has
    no regenerable recipe: version 1, recipes off, or cut). The state section is not read,
    so a file whose state chunks are damaged, or cut off after its recipe, still yields its
    recipe; a damaged header or recipe is refused as any damage is (CorruptCapsule).
    ``max_recipe_bytes`` bounds what is allocated. Raises NotFound, CorruptCapsule,
    PermissionDenied (encrypted, no key), CapsuleIOError."""
    with _opened(path, max_bytes, follow, short_state=True) as (f, header, digest):
        if header.recipe_bytes == 0:
            return header, None
        if header.recipe_bytes > max_recipe_bytes:
            raise CorruptCapsule(f"capsule file {str(path)!r}: its recipe is {header.recipe_bytes} bytes, over "
                                 f"the {max_recipe_bytes} bytes this reader accepts")
        cipher = _data_cipher(header, kek, path)
        out = bytearray(header.recipe_bytes)
        for start, plain in _verified_chunks(f, header, digest, cipher, path, RECIPE_SECTION):
            out[start:start + len(plain)] = plain
    return header, out


def load_kek(path: PathLike) -> bytes:
    """Read a key-encryption key: exactly 32 raw bytes in a regular file that neither group
    nor others may read or write (PermissionDenied otherwise, InvalidArgument for a wrong size)."""
    f, st = _open_regular(path, "key file", InvalidArgument)
    with f, os_errors(path, "key file"):
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise PermissionDenied(f"key file {str(path)!r} has mode {mode:#o}: group and others must have "
                                   f"no access (chmod 600 {str(path)!r})")
        data = f.read(KEY_BYTES + 1)
    if len(data) != KEY_BYTES:
        raise InvalidArgument(f"key file {str(path)!r} holds {st.st_size} bytes: must be exactly "
                              f"{KEY_BYTES} raw bytes")
    return data


__all__ = ["MAGIC", "FORMAT_VERSION", "BufferRecord", "CapsuleHeader", "canonical_json", "parse_header",
           "write_capsule", "read_capsule", "read_header", "read_recipe", "verify_capsule", "load_kek"]
