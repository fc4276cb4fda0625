"""The on-disk capsule format: a verified (optionally encrypted) copy of one arena.

Layout (all integers little-endian; docs/capsule-format.md has the byte-by-byte table)::

    magic     8 bytes  b"CAPSULE\\0"
    version   u16      FORMAT_VERSION
    flags     u16      bit 0 = encrypted; other bits must be 0
    json_len  u32      2 .. MAX_HEADER_JSON
    header    json_len bytes of canonical JSON (sorted keys, no spaces, ASCII)
    digest    32 bytes SHA-256(magic .. header): header integrity
    chunk 0 .. chunk N-1, each followed by its tag:
      plain:     chunk bytes, then SHA-256(digest || u64 index || u8 last || chunk)
      encrypted: AES-GCM(data key, nonce = u64 index || 4 zero bytes,
                         AAD = digest || u64 index || u8 last) ciphertext, then its 16-byte tag

Every byte of the file is covered by the header digest or a chunk tag, the index and
last-chunk flag in each tag catch dropped, duplicated and reordered chunks, and the file
size is exactly determined by the header (trailing bytes and truncation are refused
before the payload is read). The header is parsed and fully validated (types, counts,
buffer bounds, sizes) before anything of the payload's size is allocated.

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
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union

if TYPE_CHECKING:
    import torch

from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.errors import (
    CapsuleIOError,
    CapsuleRosError,
    CorruptCapsule,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from capsule_ros.runtime.chunkmark import ChunkMark
from capsule_ros.runtime.schema import ALIGNMENT, DTYPE_SIZES, BufferKind

MAGIC = b"CAPSULE\x00"
FORMAT_VERSION = 1
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
_U64 = 1 << 64

_WRAP_AAD_PREFIX = b"capsule-ros/v1/data-key\x00"
_BUFFER_KEYS = ("name", "shape", "dtype", "kind", "offset", "nbytes")
_OPTIONAL_KEYS = ("numerics", "chunk")    # written when set; files from before them read as ""  / None
MAX_NUMERICS_CHARS = 32
_KINDS = frozenset(k.value for k in BufferKind)

PathLike = Union[str, os.PathLike]
ErrorType = Type[CapsuleRosError]


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
            raise InvalidArgument(f"schema entry {_quote(entry)}: needs keys {list(_BUFFER_KEYS)} "
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
    chunk: Optional[ChunkMark] = None     # a chunking policy's schedule mark (key "chunk", absent otherwise)

    def __post_init__(self) -> None:
        if not isinstance(self.schema, (list, tuple)):
            raise InvalidArgument(f"schema {_quote(self.schema)}: must be a list of buffers")
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
        if self.chunk is not None:
            out["chunk"] = self.chunk.to_json()
        return out

    def file_bytes(self) -> int:
        """The exact size of the file holding this header."""
        return file_size_for(self, len(canonical_json(self.to_json())))


def canonical_json(obj: Mapping[str, Any]) -> bytes:
    """The one byte encoding of a header object (the reader refuses any other)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def file_size_for(header: CapsuleHeader, json_len: int) -> int:
    return PREFIX.size + json_len + DIGEST_BYTES + header.nbytes + header.chunk_count * header.tag_bytes


def _quote(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _get(obj: Mapping[str, Any], key: str, kind: type, error: ErrorType, where: str) -> Any:
    value = obj[key]
    # bool is an int subclass: refuse it where an int is meant (and vice versa)
    if type(value) is not kind:
        raise error(f"{where}{key} = {_quote(value)}: must be {kind.__name__}")
    return value


def _get_int(obj: Mapping[str, Any], key: str, low: int, high: int, error: ErrorType, where: str = "") -> int:
    value = _get(obj, key, int, error, where)
    if not low <= value <= high:
        raise error(f"{where}{key} = {_quote(value)}: must be in [{low}, {high}]")
    return value


def _get_str(obj: Mapping[str, Any], key: str, max_chars: int, error: ErrorType, where: str = "") -> str:
    value = _get(obj, key, str, error, where)
    if len(value) > max_chars:
        raise error(f"{where}{key} = {_quote(value)}: longer than {max_chars} characters")
    return value


def _get_hex(obj: Mapping[str, Any], key: str, nbytes: int, error: ErrorType) -> bytes:
    value = _get_str(obj, key, 2 * nbytes, error)
    if len(value) != 2 * nbytes or any(c not in "0123456789abcdef" for c in value):
        raise error(f"{key} = {_quote(value)}: must be {2 * nbytes} lowercase hex digits")
    return bytes.fromhex(value)


def _check_keys(obj: Any, keys: Sequence[str], error: ErrorType, where: str) -> None:
    if not isinstance(obj, dict):
        raise error(f"{where}{_quote(obj)}: must be a JSON object")
    if set(obj) != set(keys):
        missing, extra = sorted(set(keys) - set(obj)), sorted(set(obj) - set(keys))
        raise error(f"{where}keys: missing {missing}, unexpected {[_quote(k, 40) for k in extra]}")


def _parse_buffer(obj: Any, index: int, error: ErrorType) -> BufferRecord:
    where = f"schema[{index}]."
    _check_keys(obj, _BUFFER_KEYS, error, where)
    name = _get_str(obj, "name", MAX_NAME_CHARS, error, where)
    if not name or not name.isprintable() or any(c in name for c in "/\\\0 "):
        raise error(f"{where}name = {_quote(name)}: must be a plain, printable, non-empty name")
    shape = _get(obj, "shape", list, error, where)
    if len(shape) > MAX_DIMS or any(type(d) is not int or not 1 <= d < _U64 for d in shape):
        raise error(f"{where}shape = {_quote(shape)}: at most {MAX_DIMS} positive integer dims")
    dtype = _get_str(obj, "dtype", 32, error, where)
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is None:
        raise error(f"{where}dtype = {_quote(dtype)}: must be one of {sorted(DTYPE_SIZES)}")
    kind = _get_str(obj, "kind", 32, error, where)
    if kind not in _KINDS:
        raise error(f"{where}kind = {_quote(kind)}: must be one of {sorted(_KINDS)}")
    offset = _get_int(obj, "offset", 0, MAX_PAYLOAD_BYTES, error, where)
    if offset % ALIGNMENT:
        raise error(f"{where}offset = {offset}: must be a multiple of {ALIGNMENT}")
    nbytes = _get_int(obj, "nbytes", 1, MAX_PAYLOAD_BYTES, error, where)
    elements = 1
    for d in shape:
        elements *= d
    if nbytes != elements * itemsize:
        raise error(f"{where}nbytes = {nbytes}: shape {shape} of {dtype} is {elements * itemsize} bytes")
    return BufferRecord(name, tuple(shape), dtype, kind, offset, nbytes)


def parse_header(obj: Any, *, encrypted: bool, max_bytes: int,
                 error: ErrorType = CorruptCapsule) -> CapsuleHeader:
    """Validate a header object completely and build the header.

    ``error`` is CorruptCapsule for a file being read and InvalidArgument for a header a
    caller asks us to write: one validator for both directions.
    """
    keys = [f.name for f in fields(CapsuleHeader) if f.name not in ("wrapped_key", "key_nonce", *_OPTIONAL_KEYS)]
    keys += ["chunk_count"] + (["wrapped_key", "key_nonce"] if encrypted else [])
    keys += [k for k in _OPTIONAL_KEYS if isinstance(obj, dict) and k in obj]
    _check_keys(obj, keys, error, "header ")
    capsule_id = _get(obj, "capsule_id", str, error, "")
    parent_id = _get(obj, "parent_id", str, error, "")
    try:
        check_capsule_id(capsule_id)
        if parent_id:
            check_capsule_id(parent_id)
    except InvalidArgument as exc:
        raise error(str(exc)) from None
    label = _get_str(obj, "label", MAX_LABEL_CHARS, error)
    episode_id = _get_int(obj, "episode_id", 0, _U64 - 1, error)
    step = _get_int(obj, "step", 0, _U64 - 1, error)
    stamp_ns = _get_int(obj, "stamp_ns", 0, _U64 - 1, error)
    nbytes = _get_int(obj, "nbytes", 1, max_bytes, error)
    fingerprint = _get_str(obj, "fingerprint", 64, error)
    if len(fingerprint) != 64 or any(c not in "0123456789abcdef" for c in fingerprint):
        raise error(f"fingerprint = {_quote(fingerprint)}: must be 64 lowercase hex digits")
    chunk_bytes = _get_int(obj, "chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES, error)
    chunk_count = _get_int(obj, "chunk_count", 1, _U64 - 1, error)
    if chunk_count != -(-nbytes // chunk_bytes):
        raise error(f"chunk_count = {chunk_count}: {nbytes} bytes in chunks of {chunk_bytes} "
                    f"make {-(-nbytes // chunk_bytes)}")
    entries = _get(obj, "schema", list, error, "")
    if len(entries) > MAX_BUFFERS:
        raise error(f"schema has {len(entries)} buffers: at most {MAX_BUFFERS}")
    schema, names, end = [], set(), 0
    for index, entry in enumerate(entries):
        record = _parse_buffer(entry, index, error)
        if record.name in names:
            raise error(f"schema[{index}].name = {_quote(record.name)}: duplicate buffer name")
        if record.offset < end or record.offset + record.nbytes > nbytes:
            raise error(f"schema[{index}] {record.name!r} at [{record.offset}, {record.offset + record.nbytes}): "
                        f"overlaps the previous buffer (ends at {end}) or exceeds the {nbytes}-byte arena")
        names.add(record.name)
        end = record.offset + record.nbytes
        schema.append(record)
    salt = _get_hex(obj, "salt", SALT_BYTES, error)
    wrapped_key = _get_hex(obj, "wrapped_key", WRAPPED_KEY_BYTES, error) if encrypted else b""
    key_nonce = _get_hex(obj, "key_nonce", NONCE_BYTES, error) if encrypted else b""
    numerics = _get_str(obj, "numerics", MAX_NUMERICS_CHARS, error) if "numerics" in obj else ""
    if "numerics" in obj and not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", numerics):
        raise error(f"numerics = {_quote(numerics)}: must be a level name such as 'avx2' or 'native-avx512'")
    chunk = ChunkMark.from_json(obj["chunk"], "", error) if "chunk" in obj else None
    return CapsuleHeader(capsule_id, label, parent_id, episode_id, step, stamp_ns, nbytes, fingerprint,
                         tuple(schema), chunk_bytes, salt, wrapped_key, key_nonce, numerics, chunk)


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


def _chunk_aad(digest: bytes, index: int, last: bool) -> bytes:
    return digest + struct.pack("<QB", index, 1 if last else 0)


def _chunk_nonce(index: int) -> bytes:
    return struct.pack("<Q", index) + b"\x00" * (NONCE_BYTES - 8)


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
                  schema_checked: bool = False) -> None:
    """Write one capsule to a binary file object; encrypted iff ``kek`` is given.

    The header is validated as strictly as a reader would (InvalidArgument otherwise), and
    ``payload`` (bytes-like or host uint8 tensor) must hold exactly ``header.nbytes`` bytes.
    ``schema_checked``: the caller already validated this exact schema for this size (the
    capsule directory does it once per layout: it is most of the validation's cost).
    The caller owns durability (fsync, rename): see ``CapsuleDirectory.save``.
    """
    plain = replace(header, salt=os.urandom(SALT_BYTES), wrapped_key=b"", key_nonce=b"")
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
    count = header.chunk_count
    for index in range(count):
        chunk = data[index * header.chunk_bytes:(index + 1) * header.chunk_bytes]
        aad = _chunk_aad(digest, index, index == count - 1)
        if aead is not None:
            _write_all(fileobj, aead.encrypt(_chunk_nonce(index), chunk, aad))
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


def _read_header(f: io.FileIO, size: int, path: PathLike, max_bytes: int) -> Tuple[CapsuleHeader, bytes]:
    """Read, check and validate the header; returns it and its digest."""
    where = f"capsule file {str(path)!r}"
    if size < PREFIX.size + 2 + DIGEST_BYTES:
        raise CorruptCapsule(f"{where} is {size} bytes: too short for a capsule (truncated?)")
    prefix = _read(f, PREFIX.size, path, "the prefix")
    magic, version, flags, json_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptCapsule(f"{where}: magic {magic!r} is not {MAGIC!r}: not a capsule file")
    if version != FORMAT_VERSION:
        raise CorruptCapsule(f"{where}: format version {version} (this reader knows {FORMAT_VERSION})")
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
        raise CorruptCapsule(f"{where}: header is not valid JSON ({_quote(str(exc))})") from None
    try:
        header = parse_header(obj, encrypted=bool(flags & FLAG_ENCRYPTED), max_bytes=max_bytes)
    except CorruptCapsule as exc:
        raise CorruptCapsule(f"{where}: {exc}") from None
    if canonical_json(header.to_json()) != body:
        raise CorruptCapsule(f"{where}: header JSON is not in canonical form")
    expected = file_size_for(header, json_len)
    if size != expected:
        raise CorruptCapsule(f"{where} is {size} bytes; its header implies {expected} "
                             f"({'truncated' if size < expected else 'trailing bytes'})")
    return header, digest


@contextlib.contextmanager
def _opened(path: PathLike, max_bytes: int, follow: bool = True) -> Iterator[Tuple[io.FileIO, CapsuleHeader, bytes]]:
    f, st = _open_regular(path, "capsule file", CorruptCapsule, follow)
    with f, os_errors(path):
        header, digest = _read_header(f, st.st_size, path, max_bytes)
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


def _verified_chunks(f: io.FileIO, header: CapsuleHeader, digest: bytes, kek: Optional[bytes],
                     path: PathLike) -> Iterator[Tuple[int, memoryview]]:
    """Yield (payload offset, verified plaintext) per chunk, streaming with one record buffer."""
    cipher = _data_cipher(header, kek, path)
    invalid_tag = _aead()[1] if cipher is not None else Exception
    tag_bytes, count = header.tag_bytes, header.chunk_count
    record = memoryview(bytearray(min(header.chunk_bytes, header.nbytes) + tag_bytes))
    for index in range(count):
        start = index * header.chunk_bytes
        n = min(header.chunk_bytes, header.nbytes - start)
        view = record[:n + tag_bytes]
        _read_into(f, view, path, f"chunk {index}")
        aad = _chunk_aad(digest, index, index == count - 1)
        if cipher is not None:
            try:
                plain = memoryview(cipher.decrypt(_chunk_nonce(index), view, aad))
            except invalid_tag:
                raise CorruptCapsule(f"capsule file {str(path)!r}: chunk {index} of {count}: "
                                     "wrong key or corrupted (AES-GCM tag mismatch)") from None
        else:
            plain = view[:n]
            if not hmac.compare_digest(_plain_tag(aad, plain), view[n:]):
                raise CorruptCapsule(f"capsule file {str(path)!r}: chunk {index} of {count}: checksum mismatch")
        yield start, plain
    if f.read(1):
        raise CorruptCapsule(f"capsule file {str(path)!r}: trailing bytes after the last chunk")


def _check_expected(header: CapsuleHeader, fingerprint: Optional[str],
                    schema: Optional[Sequence[Mapping[str, Any]]]) -> None:
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise FingerprintMismatch(
            f"capsule {header.capsule_id!r} was made by graph {header.fingerprint[:12]} ({header.nbytes} bytes); "
            f"this runtime is {str(fingerprint)[:12]}")
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
        out = bytearray(header.nbytes)
        for start, plain in _verified_chunks(f, header, digest, kek, path):
            out[start:start + len(plain)] = plain
    import torch  # here, not at module level: `capsule-ros inspect` needs no tensors
    return header, torch.frombuffer(out, dtype=torch.uint8)


def verify_capsule(path: PathLike, *, kek: Optional[bytes] = None, max_bytes: int) -> CapsuleHeader:
    """Verify every byte of a capsule file, streaming (memory: one chunk); returns its header."""
    with _opened(path, max_bytes) as (f, header, digest):
        for _ in _verified_chunks(f, header, digest, kek, path):
            pass
    return header


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
           "write_capsule", "read_capsule", "read_header", "verify_capsule", "load_kek"]
