"""What a batched fleet's programs are made of: a policy's single-robot functions run over
the slot axis with ``torch.func.vmap``, and the per-slot masks the host writes before each
fleet step.

vmap runs a function written for one robot over ``[S, ...]`` views as one batched
computation (one GEMM of S rows where a robot's step has a GEMM of one), and writes its
in-place updates into the strided slot views, so the policy's own ``step`` (or a chunking
policy's phases) serve a fleet unchanged. Where vmap has no batching rule for an operation
it would silently loop over the slots (its "fallback"); a fleet's programs are warmed up
with the fallback off (``no_fallback``), so such a policy is refused at start-up naming
the operation (``unbatchable``), and the loop batching serves it instead.

What the bits depend on (measured: docs/fleet.md): a slot's row of a batched operation
never depends on the other rows' values (a robot's actions are the same whatever its
neighbours hold, and in whichever slot it sits), but the batch size S is part of what
computes them: the same robot alone (S = 1) differs in the last bits. A batched fleet's
fingerprint therefore includes S (``capsule_ros.runtime.fleet``).
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple

import torch
from torch.func import vmap

from capsule_ros.errors import ConfigError

READY = "ready"       # the slots a fleet step advances: every other slot keeps its bytes exactly
CORE_MASKS = (READY,)

_functorch: Any = torch._C._functorch


def vmapped(fn: Callable[..., None], *batched: object) -> Callable[[], None]:
    """``fn`` over the slot axis (axis 0) of each argument: a mapping of ``[S, ...]``
    tensors (the policy's state) or one ``[S, ...]`` tensor; ``fn`` writes in place and
    returns nothing. The result takes no arguments: it runs over the given views."""
    dims = tuple(dict.fromkeys(arg, 0) if isinstance(arg, Mapping) else 0 for arg in batched)
    run = vmap(fn, in_dims=dims, out_dims=None)
    return lambda: run(*batched)


@contextlib.contextmanager
def no_fallback() -> Iterator[None]:
    """vmap raises instead of looping over the slots where it has no batching rule (for
    warm-ups: process-wide while the block runs, so only at start-up)."""
    enabled = _functorch._is_vmap_fallback_enabled()
    _functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        _functorch._set_vmap_fallback_enabled(enabled)


def unbatchable(exc: BaseException) -> Optional[str]:
    """The operation vmap could not batch, when ``exc`` (or its cause) says so (under
    ``no_fallback``); None for any other error."""
    seen: Optional[BaseException] = exc
    while seen is not None:
        found = re.search(r"(\S+) hit the vmap fallback", str(seen))
        if found:
            return found.group(1)
        seen = seen.__cause__ or seen.__context__
    return None


def refuse_unbatchable(exc: BaseException, what: str) -> None:
    """ConfigError naming the operation, when ``exc`` is vmap's missing batching rule."""
    op = unbatchable(exc)
    if op is not None:
        raise ConfigError(f"fleet.batching vmap: {what} uses {op}, which torch.func.vmap cannot batch (it would loop "
                          "over the slots); set fleet.batching: loop (each slot runs the single-robot program, "
                          "docs/fleet.md) or write the step with batchable operations") from exc


class SlotMasks:
    """Boolean masks over the slots, by name (``CORE_MASKS`` and the mode's own): the host
    writes them before each fleet step (``set``), the programs copy them to the device
    (``upload``, inside the program: captured with it on a GPU) and read ``column``."""

    def __init__(self, names: Sequence[str], slots: int, device: torch.device):
        self.names: Tuple[str, ...] = tuple(dict.fromkeys(names))
        cuda = device.type == "cuda"
        self.host = torch.zeros(len(self.names), slots, dtype=torch.bool, pin_memory=cuda)
        self.device = torch.zeros(len(self.names), slots, dtype=torch.bool, device=device) if cuda else self.host
        self._index = {name: i for i, name in enumerate(self.names)}
        self._columns = {name: self.device[i].view(slots, 1) for name, i in self._index.items()}
        self._host_rows = {name: self.host[i].numpy() for name, i in self._index.items()}

    def set(self, name: str, slots: Iterable[int]) -> None:
        """Host side: ``name`` is true for ``slots`` only."""
        row = self._host_rows[name]
        row[:] = False
        for slot in slots:
            row[slot] = True

    def upload(self) -> None:
        """Inside a program: the host masks onto the device (non-blocking; a no-op on a CPU)."""
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)

    def row(self, name: str) -> torch.Tensor:
        """bool ``[S]`` on the device (one value per slot: a batched program's per-slot flag)."""
        return self.device[self._index[name]]

    def column(self, name: str) -> torch.Tensor:
        """bool ``[S, 1]`` on the device (broadcasts over a slot's row)."""
        return self._columns[name]

    def owned(self) -> Dict[str, torch.Tensor]:
        """The buffers the programs touch (the graphs' debug check)."""
        return {"slot masks (host)": self.host, "slot masks (device)": self.device}


def keep_where(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
    """``new`` where ``mask`` (``[S, 1]`` bool), else ``old``, written into ``new``: a
    byte-level masked merge (dtype-agnostic and exact), in one pass (each element reads and
    writes only its own place, so ``out=new`` is safe; no temporary and copy back)."""
    torch.where(mask, new, old, out=new)
