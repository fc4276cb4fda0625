"""Weights in the safetensors format, through the ``safetensors`` library: no pickle anywhere.

The format (https://github.com/huggingface/safetensors) is an 8-byte header length, a JSON
header (name -> dtype, shape, byte offsets, plus an optional ``__metadata__`` string map)
and the raw little-endian bytes. The library validates the header and every offset and
maps the file instead of reading it into memory; a file that is not safetensors (a
pickle, a truncated download, text) is refused by its header check, never executed.

``read_weights`` raises ConfigError for a missing or malformed file; ``load_strict`` is
``load_state_dict(strict=True)`` with an error that lists every missing, unexpected and
mis-shaped name (the hybrid's ``policy.weights`` and the LeRobot checkpoints share it).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from capsule_ros.errors import ConfigError


def save_weights(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``tensors`` atomically (temporary file, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(contiguous, str(tmp), metadata={str(k): str(v) for k, v in dict(metadata or {}).items()} or None)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_weights(path: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(name -> CPU tensor, metadata) of a safetensors file; ConfigError naming the file
    when it is missing or not a valid safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such weights file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{path}: {_not_safetensors(path)} ({' '.join(str(exc).split())})") from None
    return tensors, metadata


def _not_safetensors(path: Path) -> str:
    """Why ``path`` does not read as safetensors; when its header reads and describes more
    bytes than the file holds, that it was cut short (an interrupted copy)."""
    invalid = "not a valid safetensors file"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            if 8 + header_bytes > size:
                return invalid
            header = json.loads(f.read(header_bytes))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return invalid
    if 8 + header_bytes + end > size:
        return f"{invalid}: it is truncated (its header describes {8 + header_bytes + end} bytes, the file has {size})"
    return invalid


SHOWN_NAMES = 5     # names listed per kind of problem in a load error (the rest are counted)


def _names(kind: str, names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
    return f"{len(names)} {kind} ({shown}{more})"


def load_strict(module: nn.Module, tensors: Mapping[str, torch.Tensor], what: str, assign: bool = False) -> None:
    """Load ``tensors`` into ``module`` by name, all or nothing: ConfigError starting with
    ``what`` and naming the missing, unexpected and mismatched (shape or dtype) names, a
    few of each with the counts, in one line. ``assign``: the tensors become the module's
    parameters and buffers (``load_state_dict(assign=True)``: a module built on the meta device)."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = sorted(f"{k}: file {tuple(tensors[k].shape)} {tensors[k].dtype}, model "
                        f"{tuple(expected[k].shape)} {expected[k].dtype}"
                        for k in set(tensors) & set(expected)
                        if tensors[k].shape != expected[k].shape or tensors[k].dtype != expected[k].dtype)
    if missing or unexpected or mismatched:
        problems = [_names(kind, names) for kind, names in (("missing", missing), ("unexpected", unexpected),
                                                             ("mismatched", mismatched)) if names]
        raise ConfigError(f"{what}: {'; '.join(problems)}")
    module.load_state_dict(dict(tensors), strict=True, assign=assign)


def load_weights(module: nn.Module, path: Path) -> Dict[str, str]:
    """Load a safetensors file into ``module`` strictly; returns the file's metadata."""
    tensors, metadata = read_weights(path)
    load_strict(module, tensors, f"{path} does not fit the policy")
    return metadata
