"""Weights in the safetensors format, read strictly, with no pickle anywhere.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header mapping each tensor name to its dtype, shape and byte offsets
(plus an optional ``__metadata__`` string map), then the raw little-endian bytes. It is
small enough to implement here, which keeps the dependency list to what rosdep knows.

``load_weights`` is strict like ``load_state_dict(strict=True)`` and says which names
are missing or unexpected and which shapes or dtypes differ.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import nn

from capsule_ros.errors import InvalidArgument

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
MAX_HEADER_BYTES = 100 * 2**20


def save_weights(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``tensors`` atomically (temporary file, fsync, rename)."""
    header: Dict[str, dict] = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in dict(metadata).items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * ((-len(encoded)) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_weights(path: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(name -> tensor, metadata) from a safetensors file, validating every offset."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise InvalidArgument(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise InvalidArgument(f"{path}: header length {n} is out of bounds")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as exc:
        raise InvalidArgument(f"{path}: malformed header: {exc}") from exc
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, entry in header.items():
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            start, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{path}: bad entry for {name!r}: {exc}") from exc
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= start <= end <= len(body) or end - start != nbytes:
            raise InvalidArgument(f"{path}: {name!r} offsets [{start}, {end}) do not hold {shape} {entry['dtype']}")
        raw = (torch.frombuffer(bytearray(body[start:end]), dtype=torch.uint8) if nbytes
               else torch.empty(0, dtype=torch.uint8))
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def load_weights(module: nn.Module, path: Path) -> Dict[str, str]:
    """Load a safetensors file into ``module`` strictly; returns the file's metadata."""
    tensors, metadata = read_weights(path)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = sorted(f"{k}: file {tuple(tensors[k].shape)} {tensors[k].dtype}, model "
                        f"{tuple(expected[k].shape)} {expected[k].dtype}"
                        for k in set(tensors) & set(expected)
                        if tensors[k].shape != expected[k].shape or tensors[k].dtype != expected[k].dtype)
    if missing or unexpected or mismatched:
        raise InvalidArgument(f"{path} does not fit the policy: missing {missing}, unexpected {unexpected}, "
                              f"mismatched {mismatched}")
    module.load_state_dict(tensors, strict=True)
    return metadata
