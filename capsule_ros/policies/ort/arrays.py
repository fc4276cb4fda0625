"""The few element-wise operations an ONNX policy's step does around ONNX Runtime's run
(the observation terms, the action map, the state copy-back, the counters), over numpy or
over torch.

On a CPU the step works on numpy views of the arena (``torch.Tensor.numpy`` shares the
memory): for vectors of a few dozen values a call costs its dispatch, and numpy's is a
fraction of torch's, which was most of what the served step added to ONNX Runtime's own
run (docs/benchmarks.md, "ONNX policies: capsule-ros bench step --policy onnx"). On CUDA
the same operations run as torch kernels on the runtime's stream. Either way each is one
IEEE float32 operation per value, the same bits a plain numpy loop gets.

Every operation writes into an array made once (``out=``); none allocates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class ArrayOps:
    """One array library's in-place operations, called as numpy's ufuncs are."""

    array: Callable[[torch.Tensor], Any]       # an arena view (or a scratch tensor) as this library's array
    take: Callable[..., Any]                   # (source, index, out=): source[index], 1-D
    mul: Callable[..., Any]                    # (a, b, out=)
    add: Callable[..., Any]
    sub: Callable[..., Any]
    maximum: Callable[..., Any]
    minimum: Callable[..., Any]
    cat: Callable[..., Any]                    # (arrays, out=)
    copy: Callable[[Any, Any], Any]            # (target, source)
    fill: Callable[[Any, Any], Any]            # (target, value)
    increment: Callable[[Sequence[Any]], Any]  # add 1 to each of some one-value counters


def _index_select(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.index_select(source, 0, index, out=out)


def _increment_items(counters: Sequence[np.ndarray]) -> None:
    for counter in counters:          # a scalar's add: a ufunc call on one value costs several times more
        counter[0] += 1


def _increment_tensors(counters: Sequence[torch.Tensor]) -> None:
    torch._foreach_add_(list(counters), 1)          # one kernel for all of them


NUMPY = ArrayOps(array=torch.Tensor.numpy, take=np.take, mul=np.multiply, add=np.add, sub=np.subtract,
                 maximum=np.maximum, minimum=np.minimum, cat=np.concatenate, copy=np.copyto, fill=np.ndarray.fill,
                 increment=_increment_items)
TORCH = ArrayOps(array=lambda view: view, take=_index_select, mul=torch.mul, add=torch.add, sub=torch.sub,
                 maximum=torch.maximum, minimum=torch.minimum, cat=torch.cat, copy=torch.Tensor.copy_,
                 fill=torch.Tensor.fill_, increment=_increment_tensors)


def ops_for(device: torch.device) -> ArrayOps:
    """numpy for a CPU arena, torch for any other (see the module docstring)."""
    return NUMPY if device.type == "cpu" else TORCH
