"""A fleet's arena: S slots of one robot's arena layout in ONE allocation, slot-major.

Slot ``i`` holds bytes ``[i * B, (i + 1) * B)``, where ``B`` is the single-robot layout's
size (a multiple of ``ALIGNMENT``), laid out exactly as a single robot's arena. So:

- a robot's snapshot or restore is one copy of one contiguous range, as for a single
  runtime, and a slot's bytes are a valid single-robot state of the same layout (a
  capsule of it is an ordinary capsule of that layout);
- the batched programs see every buffer as a strided view ``[S, *shape]`` over the slots
  (``views``): buffer ``name`` of slot ``i`` is ``views[name][i]``, which is also
  ``slot(i)[name]``, the view a single-robot program reads;
- one kind of every slot is a strided view ``[S, bytes]`` (``rows_of``): the batched
  programs move every slot's inputs in, or outputs out, with one copy.

The execution mode's scratch (``StateArena.scratch``: no state, in no capsule) is laid out
slot-major beside it, one single-robot scratch layout per slot.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch

from capsule_ros.errors import InvalidArgument
from capsule_ros.runtime.arena import ArenaLayout, BufferSpec, StateArena
from capsule_ros.runtime.schema import BufferKind

MAX_SLOTS = 1024


class FleetArena:
    """S slots of ``layout`` (see the module docstring). Owns the storage; every view is
    made once, so the addresses a captured graph keeps never change."""

    def __init__(self, layout: ArenaLayout, slots: int, device: torch.device, scratch: Sequence[BufferSpec] = ()):
        if not 1 <= slots <= MAX_SLOTS:
            raise InvalidArgument(f"fleet.slots = {slots}: must be in [1, {MAX_SLOTS}]")
        self.layout = layout
        self.slots = slots
        self.device = torch.device(device)
        self.scratch_layout = ArenaLayout(scratch)
        self.stride = layout.nbytes
        self.storage = torch.zeros(slots * layout.nbytes, dtype=torch.uint8, device=self.device)
        self.scratch = torch.zeros(slots * self.scratch_layout.nbytes, dtype=torch.uint8, device=self.device)
        self.rows = self.storage.view(slots, layout.nbytes)                       # [S, B]
        self.scratch_rows = self.scratch.view(slots, self.scratch_layout.nbytes)
        self.views: Mapping[str, torch.Tensor] = _batched_views(self.rows, layout)
        self.scratch_views: Mapping[str, torch.Tensor] = _batched_views(self.scratch_rows, self.scratch_layout)
        self._slots: List[StateArena] = [
            StateArena(layout, self.device, scratch, storage=self.rows[i], scratch_storage=self.scratch_rows[i])
            for i in range(slots)]

    @property
    def nbytes(self) -> int:
        return self.storage.numel()

    def slot(self, index: int) -> StateArena:
        """Slot ``index`` as a single-robot arena over its own range (views made once)."""
        return self._slots[index]

    def rows_of(self, *kinds: BufferKind) -> torch.Tensor:
        """uint8 ``[S, bytes]``: the contiguous range of these kinds in every slot (strided)."""
        start, end = self.layout.byte_range(*kinds)
        return self.rows[:, start:end]

    def addresses(self) -> Dict[str, int]:
        """data_ptr of every batched view, scratch included (the graphs' debug check)."""
        return {name: view.data_ptr() for views in (self.views, self.scratch_views) for name, view in views.items()}


def _batched_views(rows: torch.Tensor, layout: ArenaLayout) -> Dict[str, torch.Tensor]:
    """name -> ``[S, *shape]`` strided view of each buffer over the slot rows ``[S, B]``:
    the byte columns of the buffer (each slot's run is contiguous and aligned), as its
    dtype, with its shape after the slot axis."""
    slots = rows.shape[0]
    return {slot.spec.name: rows[:, slot.offset:slot.end].view(slot.spec.dtype).view(slots, *slot.spec.shape)
            for slot in layout}
