"""The state arena: every named state buffer is a view into ONE contiguous allocation.

Why one allocation: a capsule snapshot or restore is then a single copy that runs at
the memory-bandwidth limit, where a per-buffer copy loop is launch bound and several
times slower (docs/benchmarks.md, "capsule-ros bench snapshot --device cuda"). The
layout groups buffers by kind in a fixed order (inputs, kv, recurrent, conv, chunk,
meta, outputs), each aligned to ``ALIGNMENT`` bytes, so that one kind is
one contiguous byte range (the KV-only ablation restores just that range, and the
input log copies just the input range).

Ownership: the arena owns the storage; the policy and the graph plan only ever write
its views in place. Views are created once, so their addresses never change, which is
what a captured CUDA graph needs (``ProgramGraphs`` checks it in debug mode).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from capsule_ros.config import dims
from capsule_ros.errors import InvalidArgument
from capsule_ros.runtime.schema import ALIGNMENT, DTYPE_SIZES, KIND_ORDER, STATE_KINDS, BufferKind  # noqa: F401

_DTYPES: Dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"dtype {name!r}: must be one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class BufferSpec:
    """One named, fixed-shape state buffer."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    kind: BufferKind

    def __post_init__(self) -> None:
        if not self.name or not self.name.isprintable() or any(c in self.name for c in "/\\ "):
            raise InvalidArgument(f"buffer name {self.name!r}: must be a plain non-empty name")
        if any(int(d) <= 0 for d in self.shape):
            raise InvalidArgument(f"buffer {self.name!r}: shape {self.shape} must have positive dims")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "kind", BufferKind(self.kind))

    @property
    def nbytes(self) -> int:
        return dims(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BufferSlot:
    """Where a buffer lives in the arena."""

    spec: BufferSpec
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


class ArenaLayout:
    """The frozen byte layout of a set of buffers: names, shapes, dtypes, kinds, offsets."""

    def __init__(self, specs: Iterable[BufferSpec]):
        specs = list(specs)
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise InvalidArgument(f"duplicate buffer names {duplicates}")
        ordered = sorted(specs, key=lambda s: KIND_ORDER.index(s.kind))  # stable within a kind
        slots: List[BufferSlot] = []
        offset = 0
        for spec in ordered:
            slots.append(BufferSlot(spec, offset))
            offset = _align(offset + spec.nbytes)
        self.slots: Tuple[BufferSlot, ...] = tuple(slots)
        self.nbytes = max(offset, ALIGNMENT)
        self._by_name = {slot.spec.name: slot for slot in self.slots}

    def __iter__(self) -> Iterator[BufferSlot]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, name: str) -> BufferSlot:
        return self._by_name[name]

    def names(self, *kinds: BufferKind) -> List[str]:
        return [s.spec.name for s in self.slots if not kinds or s.spec.kind in kinds]

    def byte_range(self, *kinds: BufferKind) -> Tuple[int, int]:
        """The contiguous [start, end) bytes holding all buffers of these kinds.

        The kinds must be adjacent in the layout order (so the range holds nothing else).
        """
        chosen = [s for s in self.slots if s.spec.kind in kinds]
        if not chosen:
            return (0, 0)
        start, end = chosen[0].offset, chosen[-1].end
        others = [s.spec.name for s in self.slots if s.spec.kind not in kinds and start <= s.offset < end]
        if others:
            raise InvalidArgument(f"kinds {[k.value for k in kinds]} are not contiguous (buffers {others} between)")
        return (start, end)

    def schema(self) -> List[dict]:
        """JSON-able description: name, shape, dtype, kind, offset, nbytes per buffer."""
        return [{"name": s.spec.name, "shape": list(s.spec.shape), "dtype": dtype_name(s.spec.dtype),
                 "kind": s.spec.kind.value, "offset": s.offset, "nbytes": s.spec.nbytes}
                for s in self.slots]

    def digest(self) -> str:
        """SHA-256 of the canonical schema and total size (part of the fingerprint)."""
        canonical = json.dumps({"nbytes": self.nbytes, "buffers": self.schema()},
                               sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


class StateArena:
    """One contiguous device allocation holding every buffer of a layout, as views.

    ``scratch``: buffers that are not state (no capsule holds them, the fingerprint does
    not cover them) but that the runtime's programs read: an execution mode's, such as the
    chunking mode's landing buffer for a refill worker's chunk. They get an allocation of
    their own beside ``storage`` and views of their own (``scratch_views``: never among the
    ``views`` a policy is handed), so the programs read only this arena's addresses and
    ``addresses`` covers them too.

    ``storage`` / ``scratch_storage``: bytes to lay the buffers over instead of allocating
    them (uint8 of the layouts' sizes, on ``device``): one slot of a fleet's arena, whose
    slots are each one contiguous range (``capsule_ros.runtime.slots``)."""

    def __init__(self, layout: ArenaLayout, device: torch.device, scratch: Sequence[BufferSpec] = (), *,
                 storage: Optional[torch.Tensor] = None, scratch_storage: Optional[torch.Tensor] = None):
        self.layout = layout
        self.device = torch.device(device)
        self.scratch_layout = ArenaLayout(scratch)
        self.storage = _bytes_for(layout, self.device, storage)
        self.scratch = _bytes_for(self.scratch_layout, self.device, scratch_storage)
        self._views = _views_of(self.storage, layout)
        self.scratch_views: Mapping[str, torch.Tensor] = _views_of(self.scratch, self.scratch_layout)
        clash = sorted(set(self._views) & set(self.scratch_views))
        if clash:
            raise InvalidArgument(f"scratch buffers {clash} have the names of state buffers")

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def views(self) -> Mapping[str, torch.Tensor]:
        """name -> tensor view; write them in place only."""
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name]

    def region(self, *kinds: BufferKind) -> torch.Tensor:
        """uint8 view of the contiguous byte range of these kinds."""
        start, end = self.layout.byte_range(*kinds)
        return self.storage[start:end]

    def addresses(self) -> Dict[str, int]:
        """data_ptr of every view, scratch included (for the graphs' debug check)."""
        return {name: view.data_ptr() for views in (self._views, self.scratch_views) for name, view in views.items()}

    def buffer_bytes(self, name: str) -> bytes:
        """A buffer's raw bytes (host copy), for byte-exact comparisons in tests and tools."""
        slot = self.layout[name]
        return self.storage[slot.offset:slot.end].cpu().numpy().tobytes()

    def zero_(self) -> None:
        self.storage.zero_()


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    """Whether a tensor on ``actual`` lives on ``wanted``; an index-less ``cuda`` is the current CUDA device."""
    def indexed(device: torch.device) -> torch.device:
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device
    return indexed(actual) == indexed(wanted)


def _bytes_for(layout: ArenaLayout, device: torch.device, given: Optional[torch.Tensor]) -> torch.Tensor:
    """``given`` (checked: contiguous uint8 of the layout's size on ``device``), or new zeroed bytes."""
    if given is None:
        return torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    if given.dtype != torch.uint8 or given.dim() != 1 or given.numel() != layout.nbytes \
            or not given.is_contiguous() or not _same_device(given.device, device):
        raise InvalidArgument(f"arena storage: needs contiguous uint8[{layout.nbytes}] on {device}, got "
                              f"{str(given.dtype).replace('torch.', '')}{list(given.shape)} on {given.device}")
    return given


def _views_of(storage: torch.Tensor, layout: ArenaLayout) -> Dict[str, torch.Tensor]:
    return {slot.spec.name: storage[slot.offset:slot.end].view(slot.spec.dtype).view(slot.spec.shape)
            for slot in layout}


def buffer_specs(entries: Sequence[Tuple[str, Sequence[int], torch.dtype, BufferKind]]) -> List[BufferSpec]:
    """Convenience: BufferSpec list from (name, shape, dtype, kind) tuples."""
    return [BufferSpec(name, tuple(shape), dtype, kind) for name, shape, dtype, kind in entries]
