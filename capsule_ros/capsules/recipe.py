"""A capsule's recipe: how its state was made, so that it can be made again.

A state at step ``s`` is a pure function of the state it started from and the inputs of
every step since (the determinism contract). A recipe records exactly that:

- its **root**: the initial state of an episode (episode id, RNG seed, token prefix) or the
  state of another capsule (its id and fingerprint, relabelled to an episode id);
- the **input rows** of the steps from the root up to the capsule's step, one row (the
  arena's input region, as the input log keeps it) per step *that read its inputs*: a
  chunking policy's consume steps read none and have no row, so a camera policy that plans
  a chunk every n steps stores one row in n;
- the **actions** the policy produced at every one of those steps, so that a rebuild can
  prove it followed the same path (the recompute fallback) and a new model's drift along
  it can be measured (``capsule-ros regenerate``);
- the **inputs** of a row (name, shape, dtype, offset, and a digest of what fills each:
  its port binding), so a new deployment can tell whether it reads the same sensors.

In a capsule file (``capsule_ros.capsules.fileformat``, format version 2) the header's
``recipe`` object holds ``RecipeInfo`` and the binary part (``Recipe.to_bytes``: the
read mask as bits, the actions as float32, the rows) is a section of its own, before the
state, chunked and tagged like it. A recipe that would pass ``capsules.recipe_max_mb``,
or that the input log no longer covers, is *cut*: the header keeps ``regenerable: false``
and the reason, and there is no binary part. docs/capsule-format.md has the byte table.

No torch here: ``capsule-ros check`` and ``inspect`` read recipes from headers alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import numpy as np

from capsule_ros.capsules.headerfields import U64, ErrorType, check_keys, get_int, get_str, get_typed, quote
from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.errors import CorruptCapsule, InvalidArgument
from capsule_ros.runtime.schema import DTYPE_SIZES

INITIAL = "initial"
CAPSULE = "capsule"
ACTION_BYTES = 4                      # float32
MAX_PREFIX_TOKENS = 65536             # a root's token prefix (it lives in the header JSON)
MAX_INPUTS = 4096
MAX_REASON_CHARS = 1024
MAX_ROW_BYTES = 1 << 32
MAX_ACTION_DIM = 1 << 20
MAX_STEPS = 1 << 40
_INPUT_KEYS = ("name", "shape", "dtype", "offset", "binding")
_INFO_KEYS = ("regenerable", "reason", "root", "base_step", "steps", "rows", "row_bytes", "action_dim", "inputs",
              "nbytes")


@dataclass(frozen=True)
class RecipeRoot:
    """Where a recipe starts: the initial state of ``episode`` (``seed``, ``prefix``), or
    the state of capsule ``capsule_id`` (of graph ``fingerprint``) relabelled to ``episode``."""

    kind: str
    episode: int
    seed: int = 0
    prefix: Tuple[int, ...] = ()
    capsule_id: str = ""
    fingerprint: str = ""

    @classmethod
    def initial(cls, episode: int, seed: int, prefix: Tuple[int, ...] = ()) -> RecipeRoot:
        return cls(INITIAL, int(episode), seed=int(seed), prefix=tuple(int(t) for t in prefix))

    @classmethod
    def capsule(cls, capsule_id: str, fingerprint: str, episode: int) -> RecipeRoot:
        return cls(CAPSULE, int(episode), capsule_id=capsule_id, fingerprint=fingerprint)

    def to_json(self) -> dict:
        if self.kind == INITIAL:
            return {"kind": INITIAL, "episode": self.episode, "seed": self.seed, "prefix": list(self.prefix)}
        return {"kind": CAPSULE, "episode": self.episode, "capsule_id": self.capsule_id,
                "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, obj: Any, error: ErrorType, where: str = "recipe.root.") -> RecipeRoot:
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if kind == INITIAL:
            check_keys(obj, ("kind", "episode", "seed", "prefix"), error, where)
            prefix = get_typed(obj, "prefix", list, error, where)
            if len(prefix) > MAX_PREFIX_TOKENS or any(type(t) is not int or not 0 <= t < U64 for t in prefix):
                raise error(f"{where}prefix: at most {MAX_PREFIX_TOKENS} non-negative integer tokens")
            return cls.initial(get_int(obj, "episode", 0, U64 - 1, error, where),
                               get_int(obj, "seed", 0, U64 - 1, error, where), tuple(prefix))
        if kind == CAPSULE:
            check_keys(obj, ("kind", "episode", "capsule_id", "fingerprint"), error, where)
            capsule_id = get_str(obj, "capsule_id", 128, error, where)
            try:
                check_capsule_id(capsule_id)
            except InvalidArgument as exc:
                raise error(f"{where}{exc}") from None
            fingerprint = get_str(obj, "fingerprint", 64, error, where)
            if not re.fullmatch(r"[0-9a-f]{64}", fingerprint):
                raise error(f"{where}fingerprint = {quote(fingerprint)}: must be 64 lowercase hex digits")
            return cls.capsule(capsule_id, fingerprint, get_int(obj, "episode", 0, U64 - 1, error, where))
        raise error(f"{where}kind = {quote(kind)}: must be {INITIAL!r} or {CAPSULE!r}")

    def describe(self) -> str:
        if self.kind == INITIAL:
            prefix = f", a {len(self.prefix)}-token prefix" if self.prefix else ""
            return f"the initial state of episode {self.episode} (seed {self.seed}{prefix})"
        return f"capsule {self.capsule_id} (as episode {self.episode})"


@dataclass(frozen=True)
class RecipeInput:
    """One input buffer in a recipe row: where its bytes are, and a digest of what fills it
    (``capsule_ros.runtime.fingerprint.binding_digest`` of its port binding)."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    offset: int                      # within the row
    binding: str                     # hex SHA-256

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "offset": self.offset,
                "binding": self.binding}

    @classmethod
    def from_json(cls, obj: Any, index: int, row_bytes: int, error: ErrorType) -> RecipeInput:
        where = f"recipe.inputs[{index}]."
        check_keys(obj, _INPUT_KEYS, error, where)
        name = get_str(obj, "name", 256, error, where)
        if not name or not name.isprintable():
            raise error(f"{where}name = {quote(name)}: must be a printable, non-empty name")
        shape = get_typed(obj, "shape", list, error, where)
        if len(shape) > 16 or any(type(d) is not int or not 1 <= d < MAX_ROW_BYTES for d in shape):
            raise error(f"{where}shape = {quote(shape)}: at most 16 positive integer dims")
        dtype = get_str(obj, "dtype", 32, error, where)
        if dtype not in DTYPE_SIZES:
            raise error(f"{where}dtype = {quote(dtype)}: must be one of {sorted(DTYPE_SIZES)}")
        binding = get_str(obj, "binding", 64, error, where)
        if not re.fullmatch(r"[0-9a-f]{64}", binding):
            raise error(f"{where}binding = {quote(binding)}: must be 64 lowercase hex digits")
        item = cls(name, tuple(shape), dtype, get_int(obj, "offset", 0, row_bytes, error, where), binding)
        if item.offset + item.nbytes > row_bytes:
            raise error(f"{where}: {item.nbytes} bytes at offset {item.offset} exceed the {row_bytes}-byte row")
        return item


@dataclass(frozen=True)
class RecipeInfo:
    """The header's ``recipe`` object: what the binary part holds (or why there is none).

    ``regenerable`` False: the recipe was cut (``reason`` says why: over the size bound, or
    the input log did not cover the capsule); the counts then say what it would have held,
    and there is no binary part (``nbytes`` 0)."""

    regenerable: bool
    reason: str
    root: Optional[RecipeRoot]
    base_step: int                   # the root's step
    steps: int                       # steps from the root to the capsule (its step - base_step)
    rows: int                        # of those, steps that read their inputs (one row each)
    row_bytes: int
    action_dim: int
    inputs: Tuple[RecipeInput, ...]

    @property
    def data_bytes(self) -> int:
        """Bytes of the binary part as the counts describe it (``Recipe.to_bytes``)."""
        return -(-self.steps // 8) + self.steps * self.action_dim * ACTION_BYTES + self.rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the binary part in the file: ``data_bytes``, or 0 when cut."""
        return self.data_bytes if self.regenerable else 0

    @property
    def step(self) -> int:
        """The step of the state the recipe makes."""
        return self.base_step + self.steps

    def to_json(self) -> dict:
        return {"regenerable": self.regenerable, "reason": self.reason,
                "root": self.root.to_json() if self.root is not None else None, "base_step": self.base_step,
                "steps": self.steps, "rows": self.rows, "row_bytes": self.row_bytes, "action_dim": self.action_dim,
                "inputs": [i.to_json() for i in self.inputs], "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, obj: Any, error: ErrorType = CorruptCapsule, *, step: Optional[int] = None,
                  episode: Optional[int] = None) -> RecipeInfo:
        """Validated strictly (``error`` otherwise); ``step`` and ``episode``: the capsule's
        own, which a regenerable recipe must reach and its root must name (a recipe makes
        its root's state relabelled to the root's episode, and the capsule's episode is that)."""
        where = "recipe."
        check_keys(obj, _INFO_KEYS, error, where)
        regenerable = get_typed(obj, "regenerable", bool, error, where)
        reason = get_str(obj, "reason", MAX_REASON_CHARS, error, where)
        root = RecipeRoot.from_json(obj["root"], error) if obj["root"] is not None else None
        base_step = get_int(obj, "base_step", 0, U64 - 1, error, where)
        steps = get_int(obj, "steps", 0, MAX_STEPS, error, where)
        rows = get_int(obj, "rows", 0, steps, error, where)
        row_bytes = get_int(obj, "row_bytes", 0, MAX_ROW_BYTES, error, where)
        action_dim = get_int(obj, "action_dim", 0, MAX_ACTION_DIM, error, where)
        entries = get_typed(obj, "inputs", list, error, where)
        if len(entries) > MAX_INPUTS:
            raise error(f"{where}inputs: {len(entries)} inputs, at most {MAX_INPUTS}")
        inputs = tuple(RecipeInput.from_json(e, i, row_bytes, error) for i, e in enumerate(entries))
        if len({i.name for i in inputs}) != len(inputs):
            raise error(f"{where}inputs: duplicate input names")
        info = cls(regenerable, reason, root, base_step, steps, rows, row_bytes, action_dim, inputs)
        if regenerable and (root is None or reason):
            raise error(f"{where}a regenerable recipe needs a root and no reason (root {quote(obj['root'])}, "
                        f"reason {quote(reason)})")
        if not regenerable and not reason:
            raise error(f"{where}a recipe that is not regenerable must say why (reason is empty)")
        if regenerable and step is not None and info.step != step:
            raise error(f"{where}base_step {base_step} + steps {steps} = {info.step}: the capsule is at step {step}")
        if root is not None and episode is not None and root.episode != episode:
            raise error(f"{where}root: {root.describe()}, but the capsule is of episode {episode}: the recipe "
                        "makes another episode's state")
        nbytes = get_int(obj, "nbytes", 0, U64 - 1, error, where)
        if nbytes != info.nbytes:
            raise error(f"{where}nbytes = {nbytes}: its counts make {info.nbytes}")
        return info

    @classmethod
    def cut(cls, reason: str, root: Optional[RecipeRoot] = None, base_step: int = 0, steps: int = 0, rows: int = 0,
            row_bytes: int = 0, action_dim: int = 0, inputs: Tuple[RecipeInput, ...] = ()) -> RecipeInfo:
        """A recipe that is not stored, and why (the counts: what it would have held)."""
        return cls(False, reason[:MAX_REASON_CHARS], root, base_step, steps, rows, row_bytes, action_dim, inputs)

    def describe(self) -> str:
        """One line: what it holds, or why it cannot rebuild the capsule."""
        if not self.regenerable:
            return f"not regenerable: {self.reason}"
        assert self.root is not None
        return (f"{self.steps} step(s) from {self.root.describe()}, {self.rows} input row(s) of "
                f"{self.row_bytes} bytes, {self.nbytes} bytes")


@dataclass(frozen=True)
class Recipe:
    """A regenerable recipe with its binary part: ``reads`` (bool, one per step: the step
    read its inputs), ``rows`` (uint8, one row per step that did) and ``actions``
    (float32, one per step)."""

    info: RecipeInfo
    reads: np.ndarray
    rows: np.ndarray
    actions: np.ndarray
    data: Optional[Any] = field(default=None, repr=False, compare=False)   # the binary part it views, if any

    def __post_init__(self) -> None:
        info = self.info
        if not info.regenerable:
            raise InvalidArgument(f"a recipe that is not regenerable has no binary part ({info.reason})")
        shapes = {"reads": (self.reads.shape, (info.steps,)), "rows": (self.rows.shape, (info.rows, info.row_bytes)),
                  "actions": (self.actions.shape, (info.steps, info.action_dim))}
        for name, (shape, expected) in shapes.items():
            if shape != expected:
                raise InvalidArgument(f"recipe {name} of shape {shape}: its info says {expected}")
        if int(np.count_nonzero(self.reads)) != info.rows:
            raise InvalidArgument(f"recipe: {int(np.count_nonzero(self.reads))} steps read inputs, "
                                  f"its info says {info.rows}")

    def to_bytes(self) -> Any:
        """The binary part (bytes-like): the read mask as bits (little-endian bit order),
        then the actions (float32, little-endian), then the rows. A recipe made from its
        binary part (``from_bytes``) gives that back, without a copy."""
        if self.data is not None:
            return self.data
        return b"".join((np.packbits(self.reads.astype(bool), bitorder="little").tobytes(),
                         self.actions.astype("<f4", copy=False).tobytes(),
                         np.ascontiguousarray(self.rows, dtype=np.uint8).tobytes()))

    @classmethod
    def from_bytes(cls, info: RecipeInfo, data: Any, where: str = "recipe") -> Recipe:
        """The recipe of a verified binary part; CorruptCapsule when its content does not
        agree with its info (a file whose tags verify can still be forged, when plain)."""
        view = memoryview(data).cast("B")
        if len(view) != info.nbytes:
            raise CorruptCapsule(f"{where}: {len(view)} bytes, its header says {info.nbytes}")
        mask_bytes = -(-info.steps // 8)
        action_bytes = info.steps * info.action_dim * ACTION_BYTES
        packed = np.frombuffer(view[:mask_bytes], dtype=np.uint8)
        reads = np.unpackbits(packed, bitorder="little", count=info.steps).astype(bool) if info.steps else \
            np.zeros(0, dtype=bool)
        if info.steps % 8 and packed[-1] >> (info.steps % 8):
            raise CorruptCapsule(f"{where}: bits set past its {info.steps} steps")
        if int(np.count_nonzero(reads)) != info.rows:
            raise CorruptCapsule(f"{where}: {int(np.count_nonzero(reads))} steps read inputs, its header says "
                                 f"{info.rows}")
        actions = np.frombuffer(view[mask_bytes:mask_bytes + action_bytes], dtype="<f4").reshape(
            info.steps, info.action_dim).astype(np.float32, copy=False)
        rows = np.frombuffer(view[mask_bytes + action_bytes:], dtype=np.uint8).reshape(info.rows, info.row_bytes)
        return cls(info, reads, rows, actions, data)
